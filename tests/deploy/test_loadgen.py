"""The load generator and reflection-only calls.

Every call goes to the real local stack (fixture local_stack, tests/conftest.py): Redis, a
draft and a target replica with the bundled models, and the orchestrator, on loopback. For
the token test a second orchestrator process (--api-token-file) joins the stack for the
duration of this module. Only the pure checks of loadgen's helpers and of the ghz configs
run without a server.

Calls are kept tiny (a few tokens, a few calls) so the file stays quick on a small machine.
Greedy decoding with a fixed gamma is deterministic, so one direct call (fixture
`reference`) tells how many tokens, rounds and drafted/accepted tokens each load call
must report.
"""
from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from google.protobuf import json_format

from deploy.loadtest import loadgen
from deploy.loadtest.reflection import aio_callable, reflect_method
from specdec.v1 import orchestrator_pb2, orchestrator_pb2_grpc

TOKEN = "test-token"
PROMPT = "The quick brown fox"  # loadgen's default prompt
MAX_NEW = 8  # the most tokens any call below asks for
GAMMA = 2


@pytest.fixture(scope="module")
def secured_spawn(local_stack, tmp_path_factory):
    """A second orchestrator that requires the bearer token TOKEN (--api-token-file), started
    without waiting: its start-up (seconds of imports) overlaps the tests that run before the
    token test. Stopped (SIGTERM) and dropped from the shared stack when the module ends."""
    token_file = tmp_path_factory.mktemp("auth") / "api-token"
    token_file.write_text(TOKEN + "\n")
    rep = local_stack.start_orchestrator(wait=False, extra=["--api-token-file", str(token_file)])
    try:
        yield rep, token_file
    finally:
        local_stack.kill(rep, sig=signal.SIGTERM)
        local_stack.orchestrators.remove(rep)


@pytest.fixture(scope="module")
def target(local_stack, secured_spawn) -> str:
    """The stack's orchestrator (requesting secured_spawn here only starts the second one early)."""
    return local_stack.orchestrator_address


@pytest.fixture(scope="module")
def secured(local_stack, secured_spawn):
    rep, token_file = secured_spawn
    local_stack.wait_serving(rep)
    return rep, token_file


@pytest.fixture(scope="module")
def reference(target) -> orchestrator_pb2.GenerateResponse:
    """One direct greedy call with a fixed gamma: what every identical load call reports."""
    data = loadgen.request_data(PROMPT, MAX_NEW, 0.0, gamma=GAMMA)
    request = json_format.ParseDict(data, orchestrator_pb2.GenerateRequest())
    with grpc.insecure_channel(target) as channel:
        reply = orchestrator_pb2_grpc.OrchestratorStub(channel).Generate(request, timeout=60)
    assert reply.stats.rounds > 0 and reply.stats.generated_tokens == len(reply.token_ids) > 0
    return reply


@pytest.fixture(scope="module")
def tokens_for(reference):
    """Greedy tokens a call asking for n (<= MAX_NEW) new tokens gets: a prefix of the reference."""
    def tokens(n: int) -> int:
        assert n <= MAX_NEW
        return min(n, len(reference.token_ids))
    return tokens


@pytest.mark.e2e
def test_every_call_is_counted_and_summarised(target, tokens_for):
    s = loadgen.run_load(target=target, concurrency=3, total=6, max_new_tokens=4, temperature=0.0)
    assert s["count"] == 6 and s["status_codes"] == {"OK": 6} and s["error_count"] == 0, s["errors"]
    assert s["tokens"] == 6 * tokens_for(4)
    assert set(s["latency_percentiles_ms"]) == {"p10", "p25", "p50", "p75", "p90", "p95", "p99"}
    assert 0 < s["fastest_ms"] <= s["latency_percentiles_ms"]["p50"] <= s["slowest_ms"]
    assert sum(b["count"] for b in s["histogram"]) == 6
    assert s["rps"] > 0 and s["tokens_per_s"] > 0
    assert "first_message_percentiles_ms" not in s  # unary calls have no first message


@pytest.mark.e2e
def test_speculation_stats_are_averaged_per_round(target, reference):
    # sequential, so that nothing but the request decides the rounds
    s = loadgen.run_load(target=target, concurrency=1, total=4, max_new_tokens=MAX_NEW, temperature=0.0,
                         gamma=GAMMA)
    assert s["status_codes"] == {"OK": 4}
    ref, sp = reference.stats, s["speculation"]
    assert s["tokens"] == 4 * ref.generated_tokens
    assert sp["rounds"] == 4 * ref.rounds
    assert sp["mean_gamma"] == pytest.approx(ref.mean_gamma) and 0 < sp["mean_gamma"] <= GAMMA
    assert sp["acceptance_rate"] == pytest.approx(ref.accepted_tokens / ref.drafted_tokens)
    assert sp["tokens_per_round"] == pytest.approx(ref.generated_tokens / ref.rounds)
    assert sp["tokens_per_target_pass"] == pytest.approx(ref.generated_tokens / ref.target_forward_passes)
    assert 1.0 <= sp["tokens_per_round"] <= GAMMA + 1  # a round yields 1 .. gamma + 1 tokens
    assert sp["draft_ms_per_round"] > 0 and sp["verify_ms_per_round"] > 0 and sp["network_ms_per_round"] >= 0
    assert "Speculation (per round, all calls):" in loadgen.format_summary(s)


@pytest.mark.e2e
def test_stream_reports_first_message_latency(target, tokens_for):
    s = loadgen.run_load(target=target, concurrency=2, total=4, stream=True, max_new_tokens=6, temperature=0.0)
    assert s["name"] == "specdec.v1.Orchestrator/GenerateStream"
    assert s["status_codes"] == {"OK": 4}
    assert s["tokens"] == 4 * tokens_for(6)
    first, whole = s["first_message_percentiles_ms"], s["latency_percentiles_ms"]
    # each call's first chunk comes no later than its end, so every percentile is no later either
    assert all(0 < first[p] <= whole[p] for p in whole)
    assert s["speculation"]["rounds"] > 0  # the last chunk carries the stats
    assert "First message (stream) distribution:" in loadgen.format_summary(s)


@pytest.mark.e2e
def test_errors_are_counted_not_raised(target):
    # far beyond the server's max_new_tokens limit (--max-new-tokens, default 1024): INVALID_ARGUMENT
    s = loadgen.run_load(target=target, concurrency=2, total=4, max_new_tokens=1_000_000)
    assert s["count"] == 4 and s["status_codes"] == {"INVALID_ARGUMENT": 4} and s["error_count"] == 4
    [(message, n)] = s["errors"].items()
    assert n == 4 and "max_new_tokens must lie in 1.." in message and "got 1000000" in message
    assert s["tokens"] == 0 and "speculation" not in s
    assert "Error distribution:" in loadgen.format_summary(s)
    # a stream refused by the server is counted the same way
    s = loadgen.run_load(target=target, total=2, stream=True, max_new_tokens=4, temperature=-1.0)
    assert s["status_codes"] == {"INVALID_ARGUMENT": 2}
    [message] = s["errors"]
    assert "temperature must be a finite number >= 0" in message
    assert "first_message_percentiles_ms" not in s


@pytest.mark.e2e
def test_duration_bounds_the_run(target):
    duration = 1.0
    s = loadgen.run_load(target=target, concurrency=1, duration=duration, max_new_tokens=4, temperature=0.0)
    assert s["count"] > 0 and s["error_count"] == 0, s["errors"]
    # no call starts after the window; the one in flight at its end still finishes
    assert s["total_s"] < duration + s["slowest_ms"] / 1000 + 0.5


@pytest.mark.e2e
def test_rps_limits_the_rate(target):
    rps, total = 2.5, 4
    s = loadgen.run_load(target=target, concurrency=4, total=total, rps=rps, max_new_tokens=4, temperature=0.0)
    assert s["count"] == total and s["error_count"] == 0, s["errors"]
    # the calls start 0.4 s apart however many workers are free: the last starts at 1.2 s
    assert s["total_s"] >= (total - 1) / rps + s["fastest_ms"] / 1000 - 0.01


@pytest.mark.e2e
def test_token_is_sent_as_bearer(secured, tokens_for, capsys):
    rep, token_file = secured
    refused = loadgen.run_load(target=rep.address, total=2, max_new_tokens=4, temperature=0.0)
    assert refused["status_codes"] == {"UNAUTHENTICATED": 2}
    [message] = refused["errors"]
    assert "bearer token" in message
    wrong = loadgen.run_load(target=rep.address, total=2, max_new_tokens=4, temperature=0.0, token="wrong")
    assert wrong["status_codes"] == {"UNAUTHENTICATED": 2}
    accepted = loadgen.run_load(target=rep.address, total=2, max_new_tokens=4, temperature=0.0, token=TOKEN)
    assert accepted["status_codes"] == {"OK": 2} and accepted["error_count"] == 0
    assert accepted["tokens"] == 2 * tokens_for(4)
    capsys.readouterr()
    # the CLI reads the token from a file
    assert loadgen.main(["--target", rep.address, "-n", "2", "--max-new-tokens", "4", "--temperature", "0",
                         "--token-file", str(token_file)]) == 0
    assert "[OK]\t2 responses" in capsys.readouterr().out


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


@pytest.mark.parametrize("flags, words", [
    (["--connections", "0"], "connections must be >= 1"),
    (["-t", "0s"], "timeout must be a finite duration above 0"),
])
def test_a_run_without_a_connection_or_a_deadline_is_refused(flags, words, capsys):
    """ghz reads a timeout of 0 as none; here every call would fail at once (or, read as
    none, could hold the run for ever), and 0 connections sent everything down one."""
    assert loadgen.main(["-n", "1", *flags]) == 2
    assert words in capsys.readouterr().err


@pytest.mark.e2e
def test_cli_prints_a_ghz_like_summary(target, capsys):
    assert loadgen.main(["--target", target, "-c", "2", "-n", "4", "--max-new-tokens", "4",
                         "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    for heading in ("Summary:", "Count:\t4", "Requests/sec:", "Latency distribution:", "99 % in",
                    "Speculation (per round, all calls):", "Status code distribution:", "[OK]\t4 responses"):
        assert heading in out


@pytest.mark.e2e
def test_cli_exits_1_when_calls_fail(target, capsys):
    assert loadgen.main(["--target", target, "-n", "2", "--max-new-tokens", "1000000"]) == 1
    assert "[INVALID_ARGUMENT]\t2 responses" in capsys.readouterr().out


@pytest.mark.e2e
def test_generate_through_reflection_alone(target, tokens_for):
    with grpc.insecure_channel(target) as channel:
        method = reflect_method(channel, "specdec.v1.Orchestrator/Generate")
    assert method.request_class is not orchestrator_pb2.GenerateRequest  # built from the server's descriptors
    assert not method.server_streaming
    s = loadgen.run_load(target=target, total=3, max_new_tokens=4, temperature=0.0, reflection=True)
    assert s["status_codes"] == {"OK": 3} and s["tokens"] == 3 * tokens_for(4)


@pytest.mark.e2e
def test_health_is_served_next_to_the_api(target):
    with grpc.insecure_channel(target) as channel:
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
    assert request.ignore_eos  # every call generates max_new_tokens: runs compare like with like
    assert loadgen.from_ghz_config(str(path))["ignore_eos"] is True


@pytest.mark.e2e
def test_cli_runs_a_ghz_config(target, tokens_for, capsys):
    config = GHZ_DIR / "generate-stream-c4.json"
    data = json.loads(config.read_text())["data"]
    assert data["prompt"] == PROMPT and data["temperature"] == 0.0  # so tokens_for applies
    # the config's call, concurrency and data; the flags cut its total and its tokens down
    assert loadgen.main(["--config", str(config), "--target", target, "-n", "4", "--max-new-tokens", "4",
                         "--format", "json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["name"] == "specdec.v1.Orchestrator/GenerateStream"
    assert summary["count"] == 4 and summary["status_codes"] == {"OK": 4}
    assert summary["tokens"] == 4 * tokens_for(4)
    assert "first_message_percentiles_ms" in summary


@pytest.mark.e2e
def test_loadgen_against_local_stack(local_stack, capsys):
    s = loadgen.run_load(target=local_stack.orchestrator_address, concurrency=2, total=8, duration=120,
                         max_new_tokens=8, temperature=0.0, timeout=60)  # prints its summary
    assert s["error_count"] == 0, s["errors"]
    assert s["count"] == 8 and s["status_codes"] == {"OK": 8}
    assert s["tokens"] > 0
    assert "Latency distribution:" in capsys.readouterr().out


@pytest.mark.e2e
def test_ignore_eos_makes_every_call_generate_max_new_tokens(local_stack, capsys):
    ends = 'if __name__ == "__main__":\n    unittest.main()\n'  # the target's greedy answer: EOS at once
    runs = {flag: loadgen.run_load(target=local_stack.orchestrator_address, total=3, max_new_tokens=6,
                                   temperature=0.0, prompt=ends, ignore_eos=flag, print_summary=False)
            for flag in (False, True)}
    assert runs[False]["tokens"] == 3 and runs[True]["tokens"] == 3 * 6
    assert loadgen.main(["--target", local_stack.orchestrator_address, "-n", "2", "--max-new-tokens", "5",
                         "--temperature", "0", "--prompt", ends, "--ignore-eos", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == 2 * 5


@pytest.mark.e2e
def test_generate_via_reflection_against_local_stack(local_stack):
    """What ghz does: descriptors fetched from the server, no generated stubs."""
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
