"""Property: whatever a client sends, the orchestrator answers with a status that names
the client's mistake (never INTERNAL or UNKNOWN), serves every valid request, leaks no
session, and keeps serving."""
from __future__ import annotations

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.gamma_policy import MAX_GAMMA
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc as pb_grpc
from tests.e2e.helpers import load_report, request, session_keys

pytestmark = pytest.mark.e2e
MAX_NEW_TOKENS = 6  # the fuzzed orchestrator's limit, so that valid requests stay quick
SERVER_FAULTS = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
METHODS = ["Generate", "GenerateStream", "EndSession"]

int32 = st.integers(-2**31, 2**31 - 1)
small_or_any = lambda lo, hi: st.one_of(st.integers(lo, hi), int32)  # noqa: E731
floats = st.floats(width=32)  # NaN, ±inf, subnormals, huge and tiny values included
session_ids = st.one_of(st.just(""), st.text(max_size=140), st.from_regex(r"[A-Za-z0-9_.:-]{1,128}", fullmatch=True))
# a few ids drawn again and again: retries, with the same fields or others
request_ids = st.one_of(st.just(""), st.text(max_size=140), st.sampled_from(["r1", "r2", "r3"]))


@st.composite
def any_request(draw) -> pb.GenerateRequest:
    """Every field drawn at random, in or out of range, set or not."""
    r = pb.GenerateRequest(max_new_tokens=draw(small_or_any(-2, MAX_NEW_TOKENS + 2)), top_k=draw(small_or_any(-2, 50)),
                           session_id=draw(session_ids), keep_session=draw(st.booleans()),
                           request_id=draw(request_ids), logprobs=draw(st.booleans()),
                           top_logprobs=draw(small_or_any(-2, 25)), prompt_logprobs=draw(st.booleans()),
                           processed_logprobs=draw(st.booleans()))
    if draw(st.booleans()):
        r.prompt = draw(st.text(max_size=200))
    if draw(st.booleans()):
        r.prompt_token_ids.extend(draw(st.lists(small_or_any(-5, 5000), max_size=40)))
    if draw(st.booleans()):
        r.temperature = draw(floats)
    if draw(st.booleans()):
        r.top_p = draw(floats)
    if draw(st.booleans()):
        r.min_p = draw(floats)
    if draw(st.booleans()):
        r.repetition_penalty = draw(floats)
    if draw(st.booleans()):
        r.presence_penalty, r.frequency_penalty = draw(floats), draw(floats)
    r.logit_bias.update(draw(st.dictionaries(small_or_any(-5, 5000), floats, max_size=5)))
    r.min_tokens = draw(small_or_any(-2, MAX_NEW_TOKENS + 2))
    if draw(st.booleans()):
        r.seed = draw(st.integers(0, 2**64 - 1))
    if draw(st.booleans()):
        r.num_speculative_tokens = draw(small_or_any(-2, MAX_GAMMA + 2))
    r.stop.extend(draw(st.lists(st.text(max_size=300), max_size=20)))
    r.stop_token_ids.extend(draw(st.lists(small_or_any(-5, 5000), max_size=20)))
    r.ignore_eos = draw(st.booleans())
    return r


@st.composite
def valid_request(draw) -> pb.GenerateRequest:
    r = pb.GenerateRequest(prompt="# " + draw(st.text(max_size=60)), max_new_tokens=draw(st.integers(1, MAX_NEW_TOKENS)),
                           top_k=draw(st.integers(0, 100)), seed=draw(st.integers(0, 2**64 - 1)))
    # vanishing temperatures too: they must sample greedily, not divide logits into NaN
    r.temperature = draw(st.one_of(st.just(0.0), st.floats(0.05, 2.0), st.floats(0.0, 2.0**-20, width=32)))
    if draw(st.booleans()):
        r.top_p = draw(st.floats(0.05, 1.0))
    if draw(st.booleans()):
        r.min_p = draw(st.floats(0.0, 1.0, width=32))
    if draw(st.booleans()):
        r.repetition_penalty = draw(st.floats(0.5, 3.0, width=32))
        r.presence_penalty = draw(st.floats(-2.0, 2.0, width=32))
        r.frequency_penalty = draw(st.floats(-2.0, 2.0, width=32))
    r.logit_bias.update(draw(st.dictionaries(st.integers(0, 4000), st.floats(-100, 100, width=32), max_size=4)))
    r.min_tokens = draw(st.integers(0, r.max_new_tokens))
    if draw(st.booleans()):
        r.num_speculative_tokens = draw(st.integers(0, MAX_GAMMA))
    r.stop_token_ids.extend(draw(st.lists(st.integers(0, 300), max_size=3)))
    r.ignore_eos = draw(st.booleans())
    if draw(st.booleans()):
        r.logprobs, r.top_logprobs = True, draw(st.integers(0, 20))
    r.prompt_logprobs = draw(st.booleans())
    r.processed_logprobs = (r.logprobs or r.prompt_logprobs) and draw(st.booleans())
    r.stop.extend(draw(st.lists(st.text(min_size=1, max_size=8), max_size=3)))
    return r


cases = st.one_of(
    st.tuples(st.just("valid"), st.sampled_from(METHODS[:2]), valid_request()),
    st.tuples(st.just("any"), st.sampled_from(METHODS), any_request()),
    st.tuples(st.just("raw"), st.sampled_from(METHODS), st.binary(max_size=300)),
)


@pytest.fixture(scope="module")
def fuzzed(local_stack):
    """An orchestrator on the shared stack with a small max_new_tokens, and a ledger of
    what the fuzzing created: the sessions it asked to keep."""
    orch = local_stack.start_orchestrator(extra=["--max-new-tokens", str(MAX_NEW_TOKENS)])
    channel = grpc.insecure_channel(orch.address)
    state = {"stack": local_stack, "orch": orch, "channel": channel, "stub": pb_grpc.OrchestratorStub(channel),
             "kept": set(), "calls": {"OK": 0}, "keys_before": session_keys(local_stack),
             "held_before": {r.address: load_report(r.address, r.kind).sessions for r in local_stack.replicas}}
    yield state
    channel.close()
    local_stack.kill(orch, sig=15)
    local_stack.orchestrators.remove(orch)


def call(state, method: str, payload) -> tuple[grpc.StatusCode, str, list]:
    """→ (status, details, responses as bytes)."""
    path = f"/specdec.v1.Orchestrator/{method}"
    data = payload if isinstance(payload, bytes) else payload.SerializeToString()
    if method == "EndSession" and not isinstance(payload, bytes):
        data = pb.EndSessionRequest(session_id=payload.session_id).SerializeToString()
    try:
        if method == "GenerateStream":
            out = list(state["channel"].unary_stream(path)(data, timeout=60))
        else:
            out = [state["channel"].unary_unary(path)(data, timeout=60)]
        return grpc.StatusCode.OK, "", out
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or "", []


def wants_kept(payload) -> bool:
    """Kept sessions, and a request id's session, kept (without caches) for its retries."""
    try:
        req = payload if not isinstance(payload, bytes) else pb.GenerateRequest.FromString(payload)
    except Exception:
        return False
    return req.keep_session or bool(req.request_id)


def check_one(state, case) -> None:
    kind, method, payload = case
    code, details, out = call(state, method, payload)
    assert code not in SERVER_FAULTS, f"{method} answered {code.name}: {details}"
    if code != grpc.StatusCode.OK:
        assert details, f"{code.name} without a message"
    if kind == "valid":
        assert code == grpc.StatusCode.OK, f"a valid request failed: {code.name}: {details}"
    if code == grpc.StatusCode.OK and method != "EndSession":
        last = (pb.GenerateStreamResponse if method == "GenerateStream" else pb.GenerateResponse).FromString(out[-1])
        assert 0 < last.stats.generated_tokens <= MAX_NEW_TOKENS
        if method == "Generate" and kind == "valid":  # one log-probability per token where asked, else none
            assert len(last.logprobs) == (len(last.token_ids) if payload.logprobs else 0)
            assert all(len(item.top) == payload.top_logprobs for item in last.logprobs)
            assert len(last.prompt_logprobs) == (last.stats.prompt_tokens - 1 if payload.prompt_logprobs else 0)
            assert not set(payload.stop_token_ids) & set(last.token_ids[:-1]), "the answer went on past a stop token"
            if last.finish_reason == pb.FINISH_REASON_EOS:  # EOS cannot come before min_tokens
                assert len(last.token_ids) > payload.min_tokens, "the answer ended before min_tokens"
        if wants_kept(payload):
            state["kept"].add(last.session_id)
    state["calls"][code.name] = state["calls"].get(code.name, 0) + 1


def test_random_requests_never_crash_the_server_or_leak_a_session(fuzzed):
    @settings(max_examples=400, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(case=cases)
    def property_holds(case):
        check_one(fuzzed, case)

    property_holds()

    stack, stub = fuzzed["stack"], fuzzed["stub"]
    assert fuzzed["calls"]["OK"] > 50, f"too few successful calls to mean anything: {fuzzed['calls']}"
    leaked = session_keys(stack) - fuzzed["keys_before"] - fuzzed["kept"]
    assert not leaked, f"ephemeral session handles left in Redis: {sorted(leaked)[:5]}"
    for sid in fuzzed["kept"]:
        stub.EndSession(pb.EndSessionRequest(session_id=sid), timeout=30)
    assert session_keys(stack) <= fuzzed["keys_before"]
    held = {r.address: load_report(r.address, r.kind).sessions for r in stack.replicas}
    # no more than before: an earlier test's cut answer, parked for its retry window, may be
    # released meanwhile (CI, 2026-12-06: 0 held against 2 before, on both replicas)
    assert all(n <= fuzzed["held_before"][address] for address, n in held.items()), \
        f"replicas still hold sessions of finished calls: {held} against {fuzzed['held_before']}"
    assert fuzzed["orch"].proc.poll() is None
    assert len(stub.Generate(request("def ok():\n", 4, 0.0), timeout=60).token_ids) == 4


@pytest.mark.parametrize("temperature", [1e-45, 1e-38, 1e-12])
@pytest.mark.parametrize("gamma", [0, 3])
def test_a_vanishing_temperature_samples_greedily(fuzzed, temperature, gamma):
    stub = fuzzed["stub"]
    greedy = stub.Generate(request("def main():\n", MAX_NEW_TOKENS, 0.0, gamma=gamma), timeout=60)
    tiny = stub.Generate(request("def main():\n", MAX_NEW_TOKENS, temperature, gamma=gamma, seed=3), timeout=60)
    assert list(tiny.token_ids) == list(greedy.token_ids)
