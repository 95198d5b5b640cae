"""A retried or duplicated internal call never advances a KV cache twice.

Calls go straight to the replicas' internal services, as the orchestrator makes them:
every call names (session, epoch, start), and a target refuses any call whose start is
not exactly the length it holds; a draft, whose cache runs ahead by design, rolls back
to start and redrafts the same tokens from the same seed.
"""
from __future__ import annotations

import uuid

import grpc
import pytest

from specdec.internal.v1 import replica_pb2 as rpb
from specdec.internal.v1 import replica_pb2_grpc as rpb_grpc
from tests.e2e.helpers import load_report

pytestmark = pytest.mark.e2e
GREEDY = rpb.SamplingParams(temperature=0.0, top_p=1.0)
REFUSED = grpc.StatusCode.FAILED_PRECONDITION


def replica(stack, kind: str):
    return next(r for r in stack.replicas if r.kind == kind and r.proc.poll() is None)


def ref(sid, epoch, start, tokens, resync=False) -> rpb.CacheRef:
    return rpb.CacheRef(session_id=sid, epoch=epoch, start=start, tokens=tokens, resync=resync)


def refused(call, request) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call(request, timeout=30)
    assert err.value.code() == REFUSED, err.value.details()
    return err.value


@pytest.fixture
def pair(local_stack, tokenizer):
    """Stubs of the stack's draft and target, a fresh session id and a prompt; the
    session is released on both replicas afterwards."""
    draft, target = replica(local_stack, "draft"), replica(local_stack, "target")
    channels = [grpc.insecure_channel(draft.address), grpc.insecure_channel(target.address)]
    sid = "idem-" + uuid.uuid4().hex
    prompt = tokenizer("def checksum(data):\n    total = 0\n")["input_ids"]
    yield rpb_grpc.DraftStub(channels[0]), rpb_grpc.TargetStub(channels[1]), draft.address, target.address, sid, prompt
    for stub in (rpb_grpc.DraftStub(channels[0]), rpb_grpc.TargetStub(channels[1])):
        stub.Release(rpb.ReleaseRequest(session_id=sid), timeout=10)
    for ch in channels:
        ch.close()


def test_a_duplicated_verify_is_refused_and_does_not_advance_the_cache(pair):
    draft, target, _, target_address, sid, prompt = pair
    n = len(prompt)
    first = target.Verify(rpb.VerifyRequest(cache=ref(sid, 1, 0, prompt), sampling=GREEDY), timeout=30)
    assert (first.accepted, first.cache_length) == (0, n)
    assert (first.batch_size, first.batch_tokens) == (1, n)  # the prefill's rows, alone in its forward
    before = load_report(target_address, "target")

    refused(target.Verify, rpb.VerifyRequest(cache=ref(sid, 1, 0, prompt), sampling=GREEDY))
    after = load_report(target_address, "target")
    assert (after.sessions, after.prefill_tokens, after.forward_passes) == \
        (before.sessions, before.prefill_tokens, before.forward_passes)

    # a full round, as the orchestrator makes it: propose from the draft, verify the draft
    prop = draft.Propose(rpb.ProposeRequest(cache=ref(sid, 1, 0, prompt + [first.next_token]), num_tokens=3,
                                            sampling=GREEDY), timeout=30)
    round_ = rpb.VerifyRequest(cache=ref(sid, 1, n, [first.next_token]), draft_tokens=prop.draft_tokens,
                               distributions=prop.distributions, sampling=GREEDY)
    verdict = target.Verify(round_, timeout=30)
    assert verdict.cache_length == n + 1 + verdict.accepted  # the cache did not move in between
    assert verdict.batch_tokens == 1 + len(prop.draft_tokens)  # the pending token and the draft
    assert not verdict.keep_chances  # greedy: the kept length tells the policy everything
    err = refused(target.Verify, round_)  # the same round again
    assert "duplicated" in err.details()
    assert load_report(target_address, "target").forward_passes == after.forward_passes + 1


def test_a_stale_epoch_is_refused_and_resync_recovers(pair):
    _, target, _, _, sid, prompt = pair
    n = len(prompt)
    first = target.Verify(rpb.VerifyRequest(cache=ref(sid, 2, 0, prompt), sampling=GREEDY), timeout=30)
    second = target.Verify(rpb.VerifyRequest(cache=ref(sid, 2, n, [first.next_token]), sampling=GREEDY), timeout=30)
    assert second.cache_length == n + 1

    stale = refused(target.Verify, rpb.VerifyRequest(cache=ref(sid, 1, n + 1, [second.next_token]), sampling=GREEDY))
    assert "stale" in stale.details()
    unknown = refused(target.Verify, rpb.VerifyRequest(cache=ref(sid, 3, n + 1, [second.next_token]), sampling=GREEDY))
    assert "rebuild from start 0" in unknown.details()
    behind = refused(target.Verify, rpb.VerifyRequest(cache=ref(sid, 2, n, [first.next_token]), sampling=GREEDY))
    assert "holds" in behind.details()

    # resync: the caller names what it knows is committed; the replica rolls back to it
    again = target.Verify(rpb.VerifyRequest(cache=ref(sid, 2, n, [first.next_token], resync=True),
                                            sampling=GREEDY), timeout=30)
    assert again.resynced and again.cache_length == n + 1 and again.next_token == second.next_token
    rebuilt = target.Verify(rpb.VerifyRequest(cache=ref(sid, 2, 0, prompt, resync=True), sampling=GREEDY), timeout=30)
    assert rebuilt.cache_length == n and rebuilt.next_token == first.next_token
    going = target.Verify(rpb.VerifyRequest(cache=ref(sid, 2, n, [first.next_token]), sampling=GREEDY), timeout=30)
    assert going.next_token == second.next_token


def test_a_retried_propose_returns_the_same_draft(pair):
    draft, _, draft_address, _, sid, prompt = pair
    n = len(prompt)
    sampled = rpb.SamplingParams(temperature=1.0, top_p=1.0, seed=7)
    request = rpb.ProposeRequest(cache=ref(sid, 1, 0, prompt), num_tokens=4, sampling=sampled)
    a = draft.Propose(request, timeout=30)
    b = draft.Propose(request, timeout=30)  # a retry: rolled back to start, same seed, same draft
    assert list(a.draft_tokens) == list(b.draft_tokens)
    assert a.distributions == b.distributions and a.cache_length == b.cache_length == n + 3
    assert load_report(draft_address, "draft").sessions >= 1

    # after a partial acceptance the next call starts inside what the draft holds
    nxt = rpb.ProposeRequest(cache=ref(sid, 1, n + 2, [a.draft_tokens[2]]), num_tokens=2, sampling=sampled)
    c, d = draft.Propose(nxt, timeout=30), draft.Propose(nxt, timeout=30)
    assert list(c.draft_tokens) == list(d.draft_tokens) and c.cache_length == n + 4

    assert "stale" in refused(draft.Propose, rpb.ProposeRequest(cache=ref(sid, 0, n, [1]), num_tokens=2,
                                                                sampling=sampled)).details()
    refused(draft.Propose, rpb.ProposeRequest(cache=ref(sid, 1, n + 50, [1]), num_tokens=2, sampling=sampled))


def test_a_sampled_verdict_carries_a_keep_chance_per_draft_position(pair):
    """What the orchestrator's γ policy learns from (orchestrator/gamma_policy.py): for each
    of the γ positions, the rule's chance that a prefix that long is kept."""
    draft, target, _, _, sid, prompt = pair
    sampled = rpb.SamplingParams(temperature=1.0, top_p=1.0, seed=11)
    first = target.Verify(rpb.VerifyRequest(cache=ref(sid, 1, 0, prompt), sampling=sampled), timeout=30)
    n = len(prompt)
    prop = draft.Propose(rpb.ProposeRequest(cache=ref(sid, 1, 0, prompt + [first.next_token]), num_tokens=4,
                                            sampling=sampled), timeout=30)
    verdict = target.Verify(rpb.VerifyRequest(cache=ref(sid, 1, n, [first.next_token]), draft_tokens=prop.draft_tokens,
                                              distributions=prop.distributions, sampling=sampled), timeout=30)
    chances = list(verdict.keep_chances)
    assert len(chances) == len(prop.draft_tokens) == 4 and all(0.0 <= c <= 1.0 for c in chances)
    assert not first.keep_chances  # no draft, nothing to keep
