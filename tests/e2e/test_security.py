"""TLS on every server, mutual TLS between the orchestrator and the pools, bearer-token
authentication on the public API, a password on Redis, and no secret in any log."""
from __future__ import annotations

import asyncio

import grpc
import pytest
import redis
from cryptography.hazmat.primitives import serialization
from grpc_health.v1 import health_pb2, health_pb2_grpc
from redis.backoff import NoBackoff
from redis.retry import Retry

from localstack.stack import LocalStack
from orchestrator.frame_stream import FrameStream
from orchestrator.mux_link import MuxLink
from specdec.frames import client_ssl_context
from specdec.internal.v1 import replica_pb2, replica_pb2_grpc
from specdec.registry import PREFIX, ReplicaInfo
from specdec.v1 import orchestrator_pb2_grpc as pb_grpc
from tests.e2e.helpers import request
from tests.pki import issue, make_ca, write_pki

pytestmark = pytest.mark.e2e
TOKEN = "s3cret-token-for-tests"
REDIS_PASSWORD = "redis-pass-for-tests"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    files, paths = write_pki(d)
    files["other-ca"] = make_ca("some other CA")[1].public_bytes(serialization.Encoding.PEM)
    (d / "other-ca.pem").write_bytes(files["other-ca"])
    paths["other-ca"] = str(d / "other-ca.pem")
    (d / "token").write_text(TOKEN + "\n")
    paths["token"] = str(d / "token")
    return {"files": files, "paths": paths}


@pytest.fixture(scope="module")
def secure_stack(bundled_paths, pki):
    """Redis with a password; replicas that serve TLS and require client certificates;
    an orchestrator on TLS that dials the pools with mutual TLS, and a second one that
    also requires a bearer token."""
    p, f = pki["paths"], pki["files"]
    stack = LocalStack(redis_password=REDIS_PASSWORD, health_credentials=grpc.ssl_channel_credentials(
        f["ca"], private_key=f["client-key"], certificate_chain=f["client"]))
    server_tls = ["--tls-cert-file", p["server"], "--tls-key-file", p["server-key"]]
    pool_tls = ["--pool-ca-file", p["ca"], "--client-cert-file", p["client"], "--client-key-file", p["client-key"]]
    try:
        stack.start_redis()
        for kind in ("target", "draft"):
            stack.start_replica(kind, wait=False, extra=server_tls + ["--tls-ca-file", p["ca"]])
        stack.start_orchestrator(wait=False, extra=server_tls + pool_tls)
        stack.start_orchestrator(wait=False, extra=server_tls + pool_tls + ["--api-token-file", p["token"]])
        stack.wait_all(1, 1)
    except BaseException:
        stack.stop()
        raise
    yield stack
    stack.stop()


def tls_channel(address: str, ca: bytes, cert: bytes | None = None, key: bytes | None = None) -> grpc.Channel:
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(ca, private_key=key, certificate_chain=cert))


def refused_code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def test_a_tls_client_generates_through_mutual_tls_pools(secure_stack, pki):
    stub = pb_grpc.OrchestratorStub(tls_channel(secure_stack.orchestrators[0].address, pki["files"]["ca"]))
    resp = stub.Generate(request("def handler(event):\n", 16, 0.0, gamma=3), timeout=120)
    assert len(resp.token_ids) == 16
    assert resp.stats.drafted_tokens > 0, "the draft pool was not reached over mutual TLS"
    assert resp.stats.target_replica == next(r.address for r in secure_stack.replicas if r.kind == "target")


def test_plaintext_and_untrusted_clients_are_refused(secure_stack, pki):
    address = secure_stack.orchestrators[0].address
    plain = pb_grpc.OrchestratorStub(grpc.insecure_channel(address))
    assert refused_code(lambda: plain.Generate(request("x", 4, 0.0), timeout=10)) == grpc.StatusCode.UNAVAILABLE
    untrusting = pb_grpc.OrchestratorStub(tls_channel(address, pki["files"]["other-ca"]))
    assert refused_code(lambda: untrusting.Generate(request("x", 4, 0.0), timeout=10)) == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("kind", ["draft", "target"])
def test_replicas_accept_only_clients_with_a_certificate(secure_stack, pki, kind):
    f = pki["files"]
    address = next(r.address for r in secure_stack.replicas if r.kind == kind)
    stub_of = replica_pb2_grpc.DraftStub if kind == "draft" else replica_pb2_grpc.TargetStub
    for channel in (grpc.insecure_channel(address), tls_channel(address, f["ca"])):  # no client certificate
        code = refused_code(lambda: stub_of(channel).Load(replica_pb2.LoadRequest(), timeout=10))
        assert code == grpc.StatusCode.UNAVAILABLE
    report = stub_of(tls_channel(address, f["ca"], f["client"], f["client-key"])).Load(replica_pb2.LoadRequest(), timeout=10)
    assert report.pool == kind


@pytest.mark.parametrize("kind", ["draft", "target"])
def test_the_frame_links_are_mutual_tls_too(secure_stack, pki, kind):
    """The replicas' frame links (the orchestrator's default way to the pools) take the
    gRPC port's certificates: a client without a certificate, or in plaintext, is refused."""
    p = pki["paths"]
    address = next(r.address for r in secure_stack.replicas if r.kind == kind)
    entry = redis.Redis(port=secure_stack.redis_port, password=REDIS_PASSWORD).get(f"{PREFIX}{kind}:{address}")
    port = ReplicaInfo.from_json(entry).frame_port
    assert port > 0
    pb = replica_pb2
    method, call_cls, calls_cls, answers = (("ProposeMux", pb.ProposeCall, pb.ProposeCalls, pb.ProposeAnswers)
                                            if kind == "draft" else
                                            ("VerifyMux", pb.VerifyCall, pb.VerifyCalls, pb.VerifyAnswers))
    request = replica_pb2.ProposeRequest() if kind == "draft" else replica_pb2.VerifyRequest()

    async def call(context):
        link = MuxLink(lambda: FrameStream("127.0.0.1", port, method, answers, kind, context), kind, kind,
                       call_cls, calls_cls, "frames")
        try:
            return await link.call(request, 10)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        finally:
            link.close()

    for context in (None, client_ssl_context(p["ca"])):
        assert asyncio.run(call(context)) == grpc.StatusCode.UNAVAILABLE
    # with a certificate the replica answers: here it refuses the empty request as invalid
    assert asyncio.run(call(client_ssl_context(p["ca"], p["client"], p["client-key"]))) \
        == grpc.StatusCode.INVALID_ARGUMENT


def test_the_bearer_token_is_required_on_the_public_api(secure_stack, pki):
    channel = tls_channel(secure_stack.orchestrators[1].address, pki["files"]["ca"])
    stub = pb_grpc.OrchestratorStub(channel)
    req = request("def auth():\n", 8, 0.0)
    for metadata in ((), (("authorization", "Bearer wrong-token"),), (("authorization", TOKEN),)):
        for call in (lambda: stub.Generate(req, timeout=30, metadata=metadata),
                     lambda: list(stub.GenerateStream(req, timeout=30, metadata=metadata))):
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "bearer token" in err.value.details()
    good = (("authorization", f"Bearer {TOKEN}"),)
    assert len(stub.Generate(req, timeout=120, metadata=good).token_ids) == 8
    assert len([t for c in stub.GenerateStream(req, timeout=120, metadata=good) for t in c.token_ids]) == 8
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no token


def test_redis_requires_its_password_and_no_secret_is_logged(secure_stack):
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(port=secure_stack.redis_port, retry=Retry(NoBackoff(), 0)).ping()
    assert redis.Redis(port=secure_stack.redis_port, password=REDIS_PASSWORD).ping()
    logs = "".join(p.read_text(errors="replace") for p in secure_stack.workdir.glob("*.log"))
    assert "serving" in logs  # the servers did log
    assert TOKEN not in logs and REDIS_PASSWORD not in logs


def test_the_gpu_overlays_tls_settings_generate_through_pools_named_by_their_services(bundled_paths, tmp_path):
    """Each server of the gpu overlay started with the TLS settings its rendered container
    gets (its SPECDEC_TLS_*, and the orchestrator's pool ones, the Secret's mount being here
    a directory of the same three files), under one certificate for all, server and client,
    that names the Services and localhost only, as the README's cert-manager Certificate
    does, while the replicas register addresses it does not name. Without the orchestrator's
    pool settings it dialled the pools in plaintext and every generation failed."""
    from cryptography.x509.oid import ExtendedKeyUsageOID

    from deploy.render import render_objects

    objs = render_objects("gpu")
    mount = "/var/run/secrets/specdec/tls"
    ca = make_ca("specdec test CA")
    cert, key = issue(ca, "specdec", [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
                      dns_names=("localhost", "specdec-orchestrator", "specdec-orchestrator.specdec.svc",
                                 "specdec-draft.specdec.svc", "specdec-target.specdec.svc"))
    ca_pem = ca[1].public_bytes(serialization.Encoding.PEM)
    for name, data in (("ca.crt", ca_pem), ("tls.crt", cert), ("tls.key", key)):
        (tmp_path / name).write_bytes(data)

    def tls_flags(component: str) -> list[str]:
        deployment = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == f"specdec-{component}")
        env = {v["name"]: v["value"] for v in deployment["spec"]["template"]["spec"]["containers"][0]["env"]
               if "value" in v}
        flags = []
        for name, value in env.items():
            if "TLS" in name or name in ("SPECDEC_POOL_CA_FILE", "SPECDEC_CLIENT_CERT_FILE", "SPECDEC_CLIENT_KEY_FILE"):
                flags += ["--" + name.removeprefix("SPECDEC_").lower().replace("_", "-"), value.replace(mount, str(tmp_path))]
        return flags

    assert "--pool-ca-file" in tls_flags("orchestrator") and "--tls-ca-file" in tls_flags("target")
    stack = LocalStack()
    try:
        stack.start_redis()
        for kind in ("target", "draft"):
            stack.start_replica(kind, wait=False, extra=tls_flags(kind))
        orchestrator = stack.start_orchestrator(wait=False, extra=tls_flags("orchestrator"))
        stack.wait_registered(1, 1, timeout=300)
        channel = grpc.secure_channel(orchestrator.address, grpc.ssl_channel_credentials(ca_pem),
                                      options=[("grpc.ssl_target_name_override", "specdec-orchestrator")])
        grpc.channel_ready_future(channel).result(timeout=300)
        stub = pb_grpc.OrchestratorStub(channel)
        resp = stub.Generate(request("def handler(event):\n", 16, 0.0, gamma=3), timeout=120)
        assert len(resp.token_ids) == 16
        assert resp.stats.drafted_tokens > 0, "the draft pool was not reached over mutual TLS"
    finally:
        stack.stop()
