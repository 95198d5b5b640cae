"""Bytes on the wire per round, from the exact protobuf messages of the internal API.

The orchestrator does not report its wire bytes in the public stats, so they are measured
here in-process: `MeteredDraft` and `MeteredTarget` wrap the engines that the in-process
loop drives and build, for every call, the ProposeRequest/ProposeResponse and
VerifyRequest/VerifyResponse that the orchestrator and the services would exchange for it
(same CacheRef, same wire encoding of the draft distributions). A seeded request takes
the same rounds in-process and through the stack, so the sizes carry over; session ids
are 32-character hex strings as the orchestrator's. What is counted: the serialized
messages (`ByteSize()`); not counted: HTTP/2 frames and headers, TCP/IP.

Per round the sizes split into a part that grows with γ (draft token ids and the
distributions, which travel twice: draft → orchestrator → target) and the rest, so that
bytes at another γ are estimated as fixed + γ · per-token (`WireModel`).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from specdec.internal.v1 import replica_pb2
from draft_service.server import distributions_pb
from target_service.server import verdict_to_pb
from specdec.wire_pb import ref_to_pb


def _params_pb(p) -> replica_pb2.SamplingParams:
    return replica_pb2.SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=p.seed)


@dataclass
class RoundBytes:
    gamma: int
    total: int  # all four messages of the round
    per_gamma: int  # the γ-dependent part: draft ids (×2), distributions (×2), keep chances
    verify_fixed: int  # VerifyRequest without draft + VerifyResponse: a γ = 0 round


@dataclass
class WireLog:
    rounds: list[RoundBytes] = field(default_factory=list)
    _pending: tuple | None = None  # (ProposeRequest+Response bytes, draft ids, distributions pb)


class MeteredDraft:
    """A DraftEngine that records the size of each Propose call's messages."""

    def __init__(self, engine, log: WireLog) -> None:
        self.engine, self.runner, self.log = engine, engine.runner, log

    def propose(self, jobs):
        results = self.engine.propose(jobs)
        job, res = jobs[0], results[0]
        if not isinstance(res, Exception):
            dists = distributions_pb(res.q)
            req = replica_pb2.ProposeRequest(cache=ref_to_pb(job.ref), num_tokens=job.gamma, sampling=_params_pb(job.params))
            resp = replica_pb2.ProposeResponse(draft_tokens=res.tokens, distributions=dists, cache_length=res.cache_length,
                                               compute_ms=res.compute_ms, batch_size=res.batch_size)
            self.log._pending = (req.ByteSize() + resp.ByteSize(), list(res.tokens), dists)
        return results

    def release(self, session_id: str) -> bool:
        return self.engine.release(session_id)


class MeteredTarget:
    """A TargetEngine that records each round's bytes (with the pending proposal's)."""

    def __init__(self, engine, log: WireLog) -> None:
        self.engine, self.runner, self.log = engine, engine.runner, log

    def verify(self, jobs):
        results = self.engine.verify(jobs)
        job, res = jobs[0], results[0]
        if isinstance(res, Exception):
            return results
        propose_bytes, ids, dists = self.log._pending if job.draft_tokens else (0, [], None)
        self.log._pending = None
        resp = verdict_to_pb(res)
        chances = resp.ByteSize() - verdict_to_pb(replace(res, keep_chances=None)).ByteSize()
        bare = replica_pb2.VerifyRequest(cache=ref_to_pb(job.ref), sampling=_params_pb(job.params))
        full = replica_pb2.VerifyRequest(cache=ref_to_pb(job.ref), sampling=_params_pb(job.params),
                                         draft_tokens=ids, distributions=dists)
        gamma = len(job.draft_tokens)
        per_gamma = 2 * (full.ByteSize() - bare.ByteSize()) + chances  # ids + distributions, both hops; keep chances
        self.log.rounds.append(RoundBytes(gamma, propose_bytes + full.ByteSize() + resp.ByteSize(), per_gamma,
                                          bare.ByteSize() + resp.ByteSize() - chances))
        return results

    def release(self, session_id: str) -> bool:
        return self.engine.release(session_id)


@dataclass
class WireModel:
    """bytes(γ) ≈ fixed + γ · per_token for γ > 0; bytes(0) = verify_fixed."""
    fixed: float
    per_token: float
    verify_fixed: float
    measured_gamma: float  # mean γ of the rounds it was fitted on
    measured: float  # mean bytes per round measured

    @classmethod
    def fit(cls, log: WireLog) -> "WireModel | None":
        spec = [r for r in log.rounds if r.gamma > 0]
        if not spec:
            return None
        n = len(spec)
        drafted = sum(r.gamma for r in spec)
        return cls(fixed=sum(r.total - r.per_gamma for r in spec) / n,
                   per_token=sum(r.per_gamma for r in spec) / drafted,
                   verify_fixed=sum(r.verify_fixed for r in log.rounds) / len(log.rounds),
                   measured_gamma=drafted / n, measured=sum(r.total for r in spec) / n)

    def bytes_per_round(self, gamma: float) -> float:
        return self.fixed + gamma * self.per_token if gamma > 0 else self.verify_fixed
