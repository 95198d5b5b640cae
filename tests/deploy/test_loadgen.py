"""The load generator and reflection-only calls.

Most tests run against a small fake Orchestrator in this process (fast, no models);
the e2e ones run against the real local stack (fixture local_stack, tests/conftest.py).
"""
from __future__ import annotations

import json
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from google.protobuf import json_format
from grpc_reflection.v1alpha import reflection

from deploy.loadtest import loadgen
from deploy.loadtest.reflection import aio_callable, reflect_method
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc

TOKEN = "test-token"


class FakeOrchestrator(orchestrator_pb2_grpc.OrchestratorServicer):
    """Answers max_new_tokens tokens after `delay_s`; prompt "fail" is refused."""

    def __init__(self, delay_s: float = 0.01, token: str | None = None):
        self.delay_s, self.token = delay_s, token

    def _check(self, request, context):
        if self.token and dict(context.invocation_metadata()).get("authorization") != f"Bearer {self.token}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        if request.prompt == "fail":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt refused")
        time.sleep(self.delay_s)

    def _stats(self, n: int) -> orchestrator_pb2.GenerationStats:
        # n tokens in ceil(n / 2) rounds of gamma 2, one draft token accepted per round
        rounds = (n + 1) // 2
        return orchestrator_pb2.GenerationStats(
            generated_tokens=n, rounds=rounds, drafted_tokens=2 * rounds, accepted_tokens=rounds,
            target_forward_passes=rounds, acceptance_rate=0.5, mean_gamma=2.0,
            times=orchestrator_pb2.StageTimes(draft_ms=3.0 * rounds, verify_ms=5.0 * rounds, network_ms=rounds))

    def Generate(self, request, context):
        self._check(request, context)
        n = request.max_new_tokens
        return orchestrator_pb2.GenerateResponse(
            text="x" * n, token_ids=list(range(n)), finish_reason=orchestrator_pb2.FINISH_REASON_LENGTH,
            stats=self._stats(n))

    def GenerateStream(self, request, context):
        self._check(request, context)
        n = request.max_new_tokens
        for i in range(n - 1):
            yield orchestrator_pb2.GenerateStreamResponse(text="x", token_ids=[i])
        yield orchestrator_pb2.GenerateStreamResponse(
            text="x", token_ids=[n - 1], finish_reason=orchestrator_pb2.FINISH_REASON_LENGTH, stats=self._stats(n))


def start_fake(servicer: FakeOrchestrator) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    service = orchestrator_pb2.DESCRIPTOR.services_by_name["Orchestrator"].full_name
    reflection.enable_server_reflection((service, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def fake():
    server, address = start_fake(FakeOrchestrator())
    yield address
    server.stop(None)


@pytest.fixture(scope="module")
def fake_with_token():
    server, address = start_fake(FakeOrchestrator(token=TOKEN))
    yield address
    server.stop(None)


def test_every_call_is_counted_and_summarised(fake):
    s = loadgen.run_load(target=fake, concurrency=3, total=12, max_new_tokens=5, temperature=0.0)
    assert s["count"] == 12 and s["status_codes"] == {"OK": 12} and s["error_count"] == 0
    assert s["tokens"] == 60
    assert set(s["latency_percentiles_ms"]) == {"p10", "p25", "p50", "p75", "p90", "p95", "p99"}
    assert s["fastest_ms"] <= s["latency_percentiles_ms"]["p50"] <= s["slowest_ms"]
    assert sum(b["count"] for b in s["histogram"]) == 12
    assert s["rps"] > 0


def test_speculation_stats_are_averaged_per_round(fake):
    s = loadgen.run_load(target=fake, concurrency=2, total=4, max_new_tokens=6)
    sp = s["speculation"]
    assert sp["rounds"] == 12 and sp["mean_gamma"] == 2.0 and sp["acceptance_rate"] == 0.5
    assert sp["tokens_per_round"] == 2.0 and sp["tokens_per_target_pass"] == 2.0
    assert (sp["draft_ms_per_round"], sp["verify_ms_per_round"], sp["network_ms_per_round"]) == (3.0, 5.0, 1.0)
    assert "Speculation (per round, all calls):" in loadgen.format_summary(s)


def test_stream_reports_first_message_latency(fake):
    s = loadgen.run_load(target=fake, concurrency=2, total=4, stream=True, max_new_tokens=6)
    assert s["status_codes"] == {"OK": 4}
    assert s["tokens"] == 24
    assert s["first_message_percentiles_ms"]["p50"] <= s["latency_percentiles_ms"]["p99"]


def test_errors_are_counted_not_raised(fake):
    s = loadgen.run_load(target=fake, concurrency=2, total=4, prompt="fail")
    assert s["status_codes"] == {"INVALID_ARGUMENT": 4}
    assert s["errors"] == {"prompt refused": 4} and s["error_count"] == 4


def test_duration_bounds_the_run(fake):
    s = loadgen.run_load(target=fake, concurrency=2, duration=0.5, max_new_tokens=1)
    assert s["count"] > 0 and s["error_count"] == 0
    assert s["total_s"] < 2.0


def test_rps_limits_the_rate(fake):
    s = loadgen.run_load(target=fake, concurrency=4, total=6, rps=10.0, max_new_tokens=1)
    assert s["count"] == 6
    assert s["total_s"] >= 0.45  # six calls at 10/s: the last starts at 0.5 s


def test_token_is_sent_as_bearer(fake_with_token):
    refused = loadgen.run_load(target=fake_with_token, total=2)
    assert refused["status_codes"] == {"UNAUTHENTICATED": 2}
    accepted = loadgen.run_load(target=fake_with_token, total=2, token=TOKEN)
    assert accepted["status_codes"] == {"OK": 2}


def test_non_loopback_target_is_refused():
    with pytest.raises(ValueError, match="loopback"):
        loadgen.run_load(target="192.0.2.1:50051", total=1)
    loadgen.check_loopback("[::1]:50051")
    loadgen.check_loopback("localhost:50051")


def test_every_run_is_bounded():
    with pytest.raises(ValueError):
        loadgen.Plan.bounded(total=loadgen.MAX_TOTAL + 1, duration_s=None, concurrency=1, rps=None)
    with pytest.raises(ValueError):
        loadgen.Plan.bounded(total=None, duration_s=loadgen.MAX_DURATION_S + 1, concurrency=1, rps=None)
    plan = loadgen.Plan.bounded(total=None, duration_s=None, concurrency=1, rps=None)
    assert plan.total == loadgen.DEFAULT_TOTAL and plan.duration_s == loadgen.MAX_DURATION_S


def test_cli_prints_a_ghz_like_summary(fake, capsys):
    assert loadgen.main(["--target", fake, "-c", "2", "-n", "4", "--max-new-tokens", "3"]) == 0
    out = capsys.readouterr().out
    for heading in ("Summary:", "Count:\t4", "Requests/sec:", "Latency distribution:", "99 % in",
                    "Status code distribution:", "[OK]\t4 responses"):
        assert heading in out


def test_generate_through_reflection_alone(fake):
    with grpc.insecure_channel(fake) as channel:
        method = reflect_method(channel, "specdec.v1.Orchestrator/Generate")
    assert method.request_class is not orchestrator_pb2.GenerateRequest  # built from the server's descriptors
    assert not method.server_streaming
    s = loadgen.run_load(target=fake, total=3, max_new_tokens=4, reflection=True)
    assert s["status_codes"] == {"OK": 3} and s["tokens"] == 12


def test_health_is_served_next_to_the_api(fake):
    with grpc.insecure_channel(fake) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


GHZ_DIR = Path(__file__).resolve().parents[2] / "deploy" / "loadtest" / "ghz"
GHZ_CONFIGS = sorted(GHZ_DIR.glob("*.json"))


def test_ghz_configs_cover_both_methods_at_three_concurrencies():
    seen = {(json.loads(p.read_text())["call"], json.loads(p.read_text())["concurrency"]) for p in GHZ_CONFIGS}
    for method in ("Generate", "GenerateStream"):
        for c in (1, 4, 16):
            assert (f"specdec.v1.Orchestrator/{method}", c) in seen


@pytest.mark.parametrize("path", GHZ_CONFIGS, ids=lambda p: p.name)
def test_ghz_config_is_valid_for_reflection(path):
    cfg = json.loads(path.read_text())
    assert "proto" not in cfg and "protoset" not in cfg  # types come from server reflection
    assert cfg["host"] == "127.0.0.1:50051" and cfg["insecure"] is True
    assert cfg["total"] > 0 and loadgen.parse_duration(cfg["max-duration"]) > 0  # bounded
    service, _, method = cfg["call"].partition("/")
    assert method in orchestrator_pb2.DESCRIPTOR.services_by_name["Orchestrator"].methods_by_name
    # ghz decodes data with protojson, which (like json_format) rejects unknown field names
    request = json_format.ParseDict(cfg["data"], orchestrator_pb2.GenerateRequest())
    assert request.prompt and request.max_new_tokens > 0 and request.HasField("temperature")


def test_cli_runs_a_ghz_config(fake, capsys):
    config = str(GHZ_DIR / "generate-stream-c4.json")
    assert loadgen.main(["--config", config, "--target", fake, "-n", "8", "--format", "json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["name"] == "specdec.v1.Orchestrator/GenerateStream"
    assert summary["count"] == 8 and summary["tokens"] == 8 * 32


# ---- against the real stack ----

@pytest.mark.e2e
def test_loadgen_against_local_stack(local_stack, capsys):
    s = loadgen.run_load(target=local_stack.orchestrator_address, concurrency=2, total=8, duration=120,
                         max_new_tokens=8, temperature=0.0, timeout=60)  # prints its summary
    assert s["error_count"] == 0, s["errors"]
    assert s["count"] == 8 and s["status_codes"] == {"OK": 8}
    assert s["tokens"] > 0
    assert "Latency distribution:" in capsys.readouterr().out


@pytest.mark.e2e
def test_generate_via_reflection_against_local_stack(local_stack):
    """What ghz does: descriptors fetched from the server, no generated stubs."""
    import asyncio

    address = local_stack.orchestrator_address
    with grpc.insecure_channel(address) as channel:
        method = reflect_method(channel, "specdec.v1.Orchestrator/Generate")
    request = json_format.ParseDict({"prompt": "Hello", "max_new_tokens": 4, "temperature": 0}, method.request_class())

    async def call():
        async with grpc.aio.insecure_channel(address) as channel:
            return await aio_callable(channel, method)(request, timeout=60)

    reply = asyncio.run(call())
    assert reply.DESCRIPTOR.full_name == "specdec.v1.GenerateResponse"
    assert len(reply.token_ids) <= 4 and reply.finish_reason != 0  # FINISH_REASON_UNSPECIFIED
    assert reply.stats.target_forward_passes >= 1
