"""The distributed systems through the public gRPC API: (d) fixed γ, (e) the adaptive
policy (num_speculative_tokens unset), (f) target only (num_speculative_tokens = 0).

A grpc.aio client keeps c streams busy: c workers take requests from one queue, each
sends GenerateStream with prompt_token_ids (the same ids as in-process) and, for a fixed
γ ((d), (f)), the request's seed, and reads the chunks. (e) sends none: with a seed at
temperature 1 the orchestrator would use its deterministic γ policy, which cannot react
to load, and (e) is the load-adaptive system. The orchestrator emits one chunk per round holding that
round's new tokens (accepted + 1), so a fixed-γ run also yields each round's accepted
count, hence α; the final chunk's GenerationStats give rounds, drafted/accepted tokens,
target passes and the stage times (draft, verify, network = RPC wall time minus the
replicas' reported compute — under load it includes queueing in the replicas' batchers —
and Redis).
"""
from __future__ import annotations

import asyncio
import time

import grpc

from benchmarks.runs import MODES, Request, RunResult, tried_tokens
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc as pb_grpc

STAGES = ("draft", "verify", "network", "redis")


def _request(r: Request, mode: str, max_new: int, gamma: int | None) -> pb.GenerateRequest:
    p = MODES[mode]
    req = pb.GenerateRequest(prompt_token_ids=list(r.prompt_ids), max_new_tokens=max_new, top_k=p.top_k)
    req.temperature = p.temperature
    req.top_p = p.top_p
    if gamma is not None:  # fixed γ: seeded, so that (d) must reproduce (c) token for token
        req.num_speculative_tokens = gamma
        req.seed = r.seed
    # (e) sends no seed, as a client that does not ask for reproducibility: a seeded request
    # at t > 0 gets the deterministic policy, which by design ignores load (gamma_policy)
    return req


class StackClient:
    """One channel to the orchestrator, shared by every run (create inside the event loop)."""

    def __init__(self, address: str, timeout: float = 600.0) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = pb_grpc.OrchestratorStub(self.channel)
        self.timeout = timeout

    async def close(self) -> None:
        await self.channel.close()

    async def one(self, req: pb.GenerateRequest) -> tuple[list[list[int]], pb.GenerationStats, float, float | None]:
        """→ (tokens per round, stats, ms, ms until the first token arrived; None if none did)."""
        t0 = time.perf_counter()
        per_round, stats, first = [], None, None
        async for chunk in self.stub.GenerateStream(req, timeout=self.timeout):
            if chunk.token_ids:
                if first is None:
                    first = (time.perf_counter() - t0) * 1000
                per_round.append(list(chunk.token_ids))
            if chunk.HasField("stats"):
                stats = chunk.stats
        return per_round, stats, (time.perf_counter() - t0) * 1000, first

    async def warm_up(self, requests: list[Request], max_new: int, seconds: float) -> None:
        """Traffic for `seconds` before anything is measured (at least one request of each
        kind): servers that sat idle while the in-process systems ran come back slow for a
        while on this kind of machine (measured: the first distributed runs after a minute
        of idleness were 10–25 % slower than the same runs made straight after others), and
        the adaptive policy's cost model starts from its measurements."""
        t0, i = time.perf_counter(), 0
        while i == 0 or time.perf_counter() - t0 < seconds:
            r = requests[i % len(requests)]
            for mode in MODES:
                for gamma in (None, 0, 4):
                    await self.one(_request(r, mode, max_new, gamma))
            i += 1

    async def warm_up_loaded(self, requests: list[Request], mode: str, concurrency: int, max_new: int,
                             seconds: float) -> None:
        """Adaptive traffic on `concurrency` streams for `seconds`: what the orchestrator
        learns per load (the γ policy's forward curve at these batch sizes, the load
        governor's measured rates with speculation on and off; about 4 s at 16 streams) is
        then learnt before this load is measured, as in a server that has run for a while."""
        if seconds <= 0 or concurrency < 2:
            return
        t0 = time.perf_counter()

        async def worker(k: int) -> None:
            i = k
            while time.perf_counter() - t0 < seconds:
                await self.one(_request(requests[i % len(requests)], mode, max_new, None))
                i += concurrency

        await asyncio.gather(*(worker(k) for k in range(concurrency)))

    async def run(self, system: str, requests: list[Request], mode: str, concurrency: int, max_new: int,
                  gamma: int | None, fields: pb.GenerateRequest | None = None) -> RunResult:
        """The requests, `concurrency` at a time; `fields` (say logprobs) merged into each."""
        res = RunResult(system, mode, concurrency, gamma, stage_ms=dict.fromkeys(STAGES, 0.0),
                        tried=0 if gamma else None)
        done: dict[int, tuple] = {}
        queue: asyncio.Queue = asyncio.Queue()
        for r in requests:
            queue.put_nowait(r)

        async def worker() -> None:
            while not queue.empty():
                r = queue.get_nowait()
                req = _request(r, mode, max_new, gamma)
                if fields is not None:
                    req.MergeFrom(fields)
                done[r.index] = await self.one(req)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        res.wall_s = time.perf_counter() - t0
        for r in requests:
            per_round, s, ms, first = done[r.index]
            res.add_request([t for rnd in per_round for t in rnd], ms, first)
            res.rounds += s.rounds
            res.drafted += s.drafted_tokens
            res.looked_up += s.lookup_drafted_tokens
            res.accepted += s.accepted_tokens
            res.target_passes += s.target_forward_passes
            res.overlap_hits += s.overlap_hits
            for stage in STAGES:
                res.stage_ms[stage] += getattr(s.times, f"{stage}_ms")
            if gamma:  # each chunk is one round: accepted = its tokens − 1 (EOS may cut the last)
                res.tried += tried_tokens([len(rnd) - 1 for rnd in per_round], gamma, max_new)
        if gamma is None:
            res.gamma = res.drafted / res.rounds if res.rounds else 0.0
        return res
