"""Bad input gets a clear status and message, one case a row, and the server keeps serving."""
from __future__ import annotations

import grpc
import pytest

from specdec.v1 import orchestrator_pb2 as pb
from tests.e2e.helpers import api, request

pytestmark = pytest.mark.e2e
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def _req(**kw):
    r = pb.GenerateRequest(prompt=kw.pop("prompt", "def f():"), max_new_tokens=kw.pop("max_new_tokens", 8))
    for k, v in kw.items():
        if isinstance(v, list):
            getattr(r, k).extend(v)
        elif isinstance(v, dict):
            getattr(r, k).update(v)
        else:
            setattr(r, k, v)
    return r


CASES = [
    ("empty prompt", _req(prompt=""), INVALID, "prompt is empty"),
    ("prompt and ids", _req(prompt_token_ids=[1, 2]), INVALID, "not both"),
    ("over-long prompt", _req(prompt="x" * 250_000), INVALID, "characters"),
    ("prompt beyond context", _req(prompt="a = 1\n" * 3000), INVALID, "context"),
    ("token id out of range", _req(prompt="", prompt_token_ids=[1, 10**6]), INVALID, "prompt_token_ids"),
    ("negative token id", _req(prompt="", prompt_token_ids=[-3]), INVALID, "prompt_token_ids"),
    ("max_new_tokens 0", _req(max_new_tokens=0), INVALID, "max_new_tokens"),
    ("max_new_tokens negative", _req(max_new_tokens=-5), INVALID, "max_new_tokens"),
    ("max_new_tokens beyond limit", _req(max_new_tokens=10**6), INVALID, "max_new_tokens"),
    ("negative temperature", _req(temperature=-0.5), INVALID, "temperature"),
    ("NaN temperature", _req(temperature=float("nan")), INVALID, "temperature"),
    ("infinite temperature", _req(temperature=float("inf")), INVALID, "temperature"),
    ("top_p zero", _req(top_p=0.0), INVALID, "top_p"),
    ("top_p above one", _req(top_p=1.5), INVALID, "top_p"),
    ("NaN top_p", _req(top_p=float("nan")), INVALID, "top_p"),
    ("negative min_p", _req(min_p=-0.1), INVALID, "min_p"),
    ("min_p above one", _req(min_p=1.5), INVALID, "min_p"),
    ("NaN min_p", _req(min_p=float("nan")), INVALID, "min_p"),
    ("stop token out of range", _req(stop_token_ids=[5, 10**6]), INVALID, "stop_token_ids"),
    ("negative stop token", _req(stop_token_ids=[-1]), INVALID, "stop_token_ids"),
    ("too many stop tokens", _req(stop_token_ids=list(range(17))), INVALID, "stop_token_ids"),
    ("biased token out of range", _req(logit_bias={10**6: 1.0}), INVALID, "logit_bias token ids"),
    ("bias beyond 100", _req(logit_bias={5: 101.0}), INVALID, "logit_bias values"),
    ("NaN bias", _req(logit_bias={5: float("nan")}), INVALID, "logit_bias values"),
    ("too many biased tokens", _req(logit_bias={t: 1.0 for t in range(301)}), INVALID, "at most 300"),
    ("min_tokens past max_new_tokens", _req(min_tokens=9), INVALID, "min_tokens"),
    ("negative min_tokens", _req(min_tokens=-1), INVALID, "min_tokens"),
    ("negative top_k", _req(top_k=-1), INVALID, "top_k"),
    ("gamma negative", _req(num_speculative_tokens=-1), INVALID, "num_speculative_tokens"),
    ("gamma too large", _req(num_speculative_tokens=99), INVALID, "num_speculative_tokens"),
    ("malformed session id", _req(session_id="bad id with spaces"), INVALID, "session_id"),
    ("unknown session", _req(session_id="0123456789abcdef"), grpc.StatusCode.NOT_FOUND, "does not exist"),
    ("too many stop strings", _req(stop=["x"] * 40), INVALID, "stop strings"),
    ("lookup without drafts", _req(prompt_lookup=True, num_speculative_tokens=0), INVALID, "prompt_lookup asks"),
    ("lookup with a sampled seed", _req(prompt_lookup=True, seed=4, temperature=0.8), INVALID,
     "prompt_lookup cannot go with a seed"),
]


@pytest.mark.parametrize("name,req,code,words", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("method", ["Generate", "GenerateStream"])
def test_bad_request_is_refused_clearly(local_stack, name, req, code, words, method):
    stub = api(local_stack.orchestrator_address)
    with pytest.raises(grpc.RpcError) as err:
        if method == "Generate":
            stub.Generate(req, timeout=30)
        else:
            list(stub.GenerateStream(req, timeout=30))
    assert err.value.code() == code, err.value.details()
    assert words in err.value.details()


def test_invalid_utf8_is_invalid_argument(local_stack):
    channel = grpc.insecure_channel(local_stack.orchestrator_address)
    raw = channel.unary_unary("/specdec.v1.Orchestrator/Generate")
    payload = b"\x0a\x03\xff\xfe\xfd\x18\x08"  # prompt = invalid UTF-8 bytes, max_new_tokens = 8
    with pytest.raises(grpc.RpcError) as err:
        raw(payload, timeout=30)
    assert err.value.code() == INVALID
    assert "UTF-8" in err.value.details()


def test_oversized_message_is_resource_exhausted(local_stack):
    stub = api(local_stack.orchestrator_address)
    with pytest.raises(grpc.RpcError) as err:
        stub.Generate(_req(prompt="y" * (20 * 2**20)), timeout=30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_server_keeps_serving_after_bad_input(local_stack):
    r = api(local_stack.orchestrator_address).Generate(request("def ok():\n", 4, 0.0), timeout=60)
    assert len(r.token_ids) == 4


@pytest.mark.parametrize("value", [1.0, -0.1, float("nan")])
def test_a_draft_refuses_a_bad_stop_threshold_and_keeps_serving(local_stack, tokenizer, value):
    from specdec.internal.v1 import replica_pb2 as rpb
    from specdec.internal.v1 import replica_pb2_grpc as rpb_grpc

    draft = next(r for r in local_stack.replicas if r.kind == "draft" and r.proc.poll() is None)
    prompt = tokenizer("def f(x):\n    return ")["input_ids"]
    with grpc.insecure_channel(draft.address) as channel:
        stub = rpb_grpc.DraftStub(channel)

        def propose(stop_below):
            cache = rpb.CacheRef(session_id="stop-check", epoch=1, start=0, tokens=prompt)
            return stub.Propose(rpb.ProposeRequest(cache=cache, num_tokens=3, stop_below=stop_below,
                                                   sampling=rpb.SamplingParams(temperature=0.0, top_p=1.0)), timeout=30)
        with pytest.raises(grpc.RpcError) as err:
            propose(value)
        assert err.value.code() == INVALID and "stop_below must lie in [0, 1)" in err.value.details()
        assert 1 <= len(propose(0.5).draft_tokens) <= 3  # the next call is served
        stub.Release(rpb.ReleaseRequest(session_id="stop-check"), timeout=10)
