"""A Release and its session's calls on a real target replica: a call still queued behind
a running batch when its session is released fails with FAILED_PRECONDITION instead of
making the session anew once it runs (and holding its cache until the idle expiry)."""
from __future__ import annotations

import asyncio
import signal

import grpc
import pytest

pytestmark = pytest.mark.e2e


def test_a_release_fails_its_sessions_call_queued_behind_a_running_batch(local_stack, tokenizer):
    from specdec.internal.v1 import replica_pb2 as rpb
    from specdec.internal.v1 import replica_pb2_grpc as rpb_grpc

    greedy = rpb.SamplingParams(temperature=0.0, top_p=1.0)
    long_prompt = tokenizer("total = add(total, item)\n" * 240)["input_ids"][:1900]  # a prefill of ~0.5 s here
    short_prompt = tokenizer("def main(argv):\n    return 0\n" * 3)["input_ids"]

    def verify(stub, sid: str, prompt: list[int]):
        cache = rpb.CacheRef(session_id=sid, epoch=1, start=0, tokens=prompt)
        return stub.Verify(rpb.VerifyRequest(cache=cache, sampling=greedy), timeout=60)

    async def main(address: str):
        async with grpc.aio.insecure_channel(address) as channel:
            stub = rpb_grpc.TargetStub(channel)
            await verify(stub, "warm", short_prompt)
            await stub.Release(rpb.ReleaseRequest(session_id="warm"), timeout=10)
            slow = asyncio.ensure_future(verify(stub, "slow", long_prompt))
            await asyncio.sleep(0.05)  # the long prefill runs
            queued = asyncio.ensure_future(verify(stub, "queued", short_prompt))
            await asyncio.sleep(0.05)  # and the short call waits behind it
            released = await stub.Release(rpb.ReleaseRequest(session_id="queued"), timeout=10)
            results = await asyncio.gather(slow, queued, return_exceptions=True)
            load = await stub.Load(rpb.LoadRequest(), timeout=10)
            return released.released, results, load.sessions

    rep = local_stack.start_replica("target")
    try:
        released, (slow, queued), sessions = asyncio.run(main(rep.address))
    finally:
        local_stack.replicas.remove(rep)
        local_stack.kill(rep, signal.SIGTERM)
    assert not isinstance(slow, Exception) and slow.cache_length >= 1899
    assert isinstance(queued, grpc.aio.AioRpcError), queued
    assert queued.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "released while this call waited its turn" in queued.details()
    assert released is False and sessions == 1  # "slow" only: "queued" was never made
