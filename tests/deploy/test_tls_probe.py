"""The exec probe of the TLS component against a real mutual-TLS gRPC server.

Certificates are made with the openssl command line for the test (a CA, and one leaf
with the SAN "localhost" used as server and client certificate, as in the pods).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from deploy import DEPLOY_DIR

PROBE = DEPLOY_DIR / "components" / "tls" / "grpc_health_tls.py"

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=specdec-test-ca",
            "-keyout", "ca.key", "-out", "ca.crt", cwd=d)
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=specdec", "-keyout", "tls.key", "-out", "tls.csr",
            cwd=d)
    (d / "ext.cnf").write_text("subjectAltName=DNS:localhost,DNS:specdec-draft.specdec.svc\n"
                               "extendedKeyUsage=serverAuth,clientAuth\n")
    openssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "1", "-extfile", "ext.cnf", "-out", "tls.crt", cwd=d)
    return d


def start_mtls_server(certs, status) -> tuple[grpc.Server, int]:
    creds = grpc.ssl_server_credentials(
        [((certs / "tls.key").read_bytes(), (certs / "tls.crt").read_bytes())],
        root_certificates=(certs / "ca.crt").read_bytes(), require_client_auth=True)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", status)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    return server, port


def run_probe(certs, port: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "SPECDEC_PORT": str(port),
           "SPECDEC_TLS_CERT_FILE": str(certs / "tls.crt"), "SPECDEC_TLS_KEY_FILE": str(certs / "tls.key"),
           "SPECDEC_TLS_CA_FILE": str(certs / "ca.crt")}
    return subprocess.run([sys.executable, str(PROBE)], env=env, capture_output=True, text=True, timeout=30)


def test_probe_passes_on_a_serving_mtls_server(certs):
    server, port = start_mtls_server(certs, health_pb2.HealthCheckResponse.SERVING)
    try:
        result = run_probe(certs, port)
    finally:
        server.stop(None)
    assert result.returncode == 0, result.stderr


def test_probe_fails_while_not_serving(certs):
    server, port = start_mtls_server(certs, health_pb2.HealthCheckResponse.NOT_SERVING)
    try:
        result = run_probe(certs, port)
    finally:
        server.stop(None)
    assert result.returncode == 1


def test_probe_fails_when_nothing_listens(certs):
    server, port = start_mtls_server(certs, health_pb2.HealthCheckResponse.SERVING)
    server.stop(None)
    result = run_probe(certs, port)
    assert result.returncode == 1 and "UNAVAILABLE" in result.stderr
