"""Round streams against the real replicas of a local stack: a stream answers like the
unary calls, round after round on one stream, and any refusal ends it with the unary
call's status while the replica keeps serving."""
from __future__ import annotations

import asyncio
import signal
import uuid

import grpc
import pytest
import redis.asyncio as aioredis

from orchestrator.pools import PoolClients
from orchestrator.round_stream import CALL_MODES, SessionLinks
from specdec import rounds
from specdec.internal.v1 import replica_pb2 as rpb
from specdec.registry import Registry

pytestmark = pytest.mark.e2e
GREEDY = rpb.SamplingParams(temperature=0.0, top_p=1.0)
T1 = rpb.SamplingParams(temperature=1.0, top_p=1.0, seed=11)


def replica(stack, kind: str):
    return next(r for r in stack.replicas if r.kind == kind and r.proc.poll() is None)


def ref(sid, start, tokens, resync=False) -> rpb.CacheRef:
    return rpb.CacheRef(session_id=sid, epoch=1, start=start, tokens=tokens, resync=resync)


async def decode(links: SessionLinks, draft: str, target: str, prompt: list[int], rounds_: int,
                 params: rpb.SamplingParams) -> list[tuple]:
    """Speculative rounds as the orchestrator makes them (γ = 3), through `links`:
    → per round (draft tokens, accepted, next token, target cache length)."""
    sid = "stream-" + uuid.uuid4().hex
    first = await links.verify(target, rpb.VerifyRequest(cache=ref(sid, 0, prompt), sampling=params), 30)
    committed, out = prompt + [first.next_token], []
    cur = rounds.Cursor(draft_len=0, target_len=first.cache_length)
    for _ in range(rounds_):
        d = rounds.draft_ref(sid, 1, committed, cur)
        prop = await links.propose(draft, rpb.ProposeRequest(
            cache=ref(sid, d.start, d.tokens), num_tokens=3, sampling=params), 30)
        assert prop.HasField("distributions") == (params.temperature > 0)  # greedy sends none
        t = rounds.target_ref(sid, 1, committed, cur)
        verdict = await links.verify(target, rpb.VerifyRequest(
            cache=ref(sid, t.start, t.tokens), draft_tokens=prop.draft_tokens,
            distributions=prop.distributions, sampling=params), 30)
        new = rounds.new_tokens(list(prop.draft_tokens), verdict.accepted, verdict.next_token)
        out.append((list(prop.draft_tokens), verdict.accepted, verdict.next_token, verdict.cache_length))
        cur = rounds.advance(cur, len(committed), 3, verdict.accepted, verdict.cache_length, len(new))
        committed += new
    return out


def links_for(stack, mode: str = "stream") -> tuple[SessionLinks, PoolClients]:
    """Frames: the pools read the replicas' frame ports from the stack's registry."""
    registry = Registry(aioredis.from_url(stack.redis_url)) if mode == "frames" else None
    pools = PoolClients(registry=registry, frames=mode == "frames")
    return SessionLinks(pools, mode), pools


@pytest.mark.parametrize("params", [GREEDY, T1], ids=["greedy", "t1"])
def test_every_call_mode_answers_round_after_round_alike(local_stack, tokenizer, params):
    draft, target = replica(local_stack, "draft").address, replica(local_stack, "target").address
    prompt = tokenizer("def parse(line):\n    parts = ")["input_ids"]

    async def both():
        results = {}
        for mode in CALL_MODES:
            links, pools = links_for(local_stack, mode)
            results[mode] = await decode(links, draft, target, prompt, 8, params)
            if mode == "stream":
                assert links.opened == 2  # one stream to each replica for all 17 calls
            if mode in ("mux", "frames"):  # the process's shared streams, one per replica
                shared = [pools.mux(k, a) for k, a in (("draft", draft), ("target", target))]
                assert [(s.opened, s.transport) for s in shared] == [(1, "grpc" if mode == "mux" else "frames")] * 2
            await links.close()
            await pools.close()
            if pools.registry is not None:
                await pools.registry.redis.aclose()
        return results

    results = asyncio.run(both())
    assert results["stream"] == results["unary"] == results["mux"] == results["frames"]
    assert sum(n for _, n, _, _ in results["stream"]) > 0  # the rounds did accept draft tokens


def test_a_refused_call_ends_the_stream_with_its_status_and_the_next_call_reopens(local_stack, tokenizer):
    target = replica(local_stack, "target").address
    prompt = tokenizer("import os\n")["input_ids"]
    sid = "stream-refused-" + uuid.uuid4().hex

    async def run():
        links, pools = links_for(local_stack)
        try:
            ok = await links.verify(target, rpb.VerifyRequest(cache=ref(sid, 0, prompt), sampling=GREEDY), 30)
            with pytest.raises(grpc.aio.AioRpcError) as dup:  # the same call again: refused, cache unmoved
                await links.verify(target, rpb.VerifyRequest(cache=ref(sid, 0, prompt), sampling=GREEDY), 30)
            assert dup.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "duplicated" in dup.value.details()
            bad = rpb.VerifyRequest(cache=ref(sid, ok.cache_length, [ok.next_token]), draft_tokens=[10**6],
                                    distributions=rpb.DraftDistributions(vocab_size=4096), sampling=GREEDY)
            with pytest.raises(grpc.aio.AioRpcError) as invalid:
                await links.verify(target, bad, 30)
            assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # the replica still serves the session, on a fresh stream, from where it was
            nxt = await links.verify(target, rpb.VerifyRequest(
                cache=ref(sid, ok.cache_length, [ok.next_token]), sampling=GREEDY), 30)
            assert nxt.cache_length == ok.cache_length + 1
            assert links.opened == 3
        finally:
            await links.close()
            await pools.close()

    asyncio.run(run())


def test_a_call_past_its_timeout_is_deadline_exceeded_and_drops_the_stream(local_stack, tokenizer):
    target = replica(local_stack, "target").address
    prompt = tokenizer("class Config:\n" * 20)["input_ids"]  # a prefill that cannot finish in 1 µs

    async def run():
        links, pools = links_for(local_stack)
        try:
            sid = "stream-timeout-" + uuid.uuid4().hex
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await links.verify(target, rpb.VerifyRequest(cache=ref(sid, 0, prompt), sampling=GREEDY), 1e-6)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "did not answer" in err.value.details()
            again = await links.verify(target, rpb.VerifyRequest(
                cache=ref(sid, 0, prompt, resync=True), sampling=GREEDY), 30)
            assert again.cache_length == len(prompt)
            assert links.opened == 2
        finally:
            await links.close()
            await pools.close()

    asyncio.run(run())


def test_frames_mode_goes_over_grpc_to_a_replica_without_a_frame_link(local_stack, tokenizer):
    """A replica started with --frame-port -1 (or one of a version before the frame link)
    registers no frame port, and an orchestrator in frames mode calls it over gRPC."""
    rep = local_stack.start_replica("target", extra=["--frame-port", "-1"])
    prompt = tokenizer("def tail(xs):\n")["input_ids"]

    async def run():
        links, pools = links_for(local_stack, "frames")
        try:
            sid = "no-frames-" + uuid.uuid4().hex
            await pools.live("target")
            first = await links.verify(rep.address, rpb.VerifyRequest(cache=ref(sid, 0, prompt), sampling=GREEDY), 30)
            assert first.cache_length == len(prompt)
            assert pools.mux("target", rep.address).transport == "grpc"
            others = [r for r in await pools.live("target") if r.address != rep.address]
            assert others and all(r.frame_port > 0 for r in others)  # the stack's own target has one
        finally:
            await links.close()
            await pools.close()
            await pools.registry.redis.aclose()

    try:
        asyncio.run(run())
    finally:
        local_stack.kill(rep, signal.SIGTERM)  # deregisters on the way out
        local_stack.replicas.remove(rep)  # the shared stack's later users walk its replicas
