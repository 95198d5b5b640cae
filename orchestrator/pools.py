"""Clients of the draft and target pools: routing, reused channels, failure marking.

A new session goes to the least-loaded live replica of each pool (load from the
registry, plus the sessions this process placed since the last heartbeat), or, among those
nearly as little loaded, to the one its prompt's first tokens hash to (so that prompts that
begin alike find their prefix held there; `--prefix-affinity off` routes by load alone),
and sticks there. A replica whose calls fail is
avoided at once, before its registry entry expires, unless every replica of its pool is
avoided.
"""
from __future__ import annotations

import asyncio
import hashlib
import struct
import time

import grpc

from orchestrator.frame_stream import FrameStream
from orchestrator.mux_link import MuxLink
from specdec.errors import Unavailable
from specdec.frames import client_ssl_context
from specdec.grpc_server import channel_credentials, channel_options
from specdec.internal.v1 import replica_pb2, replica_pb2_grpc
from specdec.registry import Registry, ReplicaInfo

REPLICA_DOWN = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
CACHE_LOST = {grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND}
# new sessions whose prompts begin alike go where that beginning is held (the replicas'
# prefix reuse, specdec/sessions.py) unless that replica is this much fuller, as a share of
# its capacity, than the least loaded one: load decides first, the prefix among near equals
AFFINITY_SLACK = 0.1
AFFINITY_TOKENS = 16  # the replicas' MIN_SHARED: shorter prompts are not reused, so not steered


def prefix_affinity(prompt_ids: list[int]) -> bytes:
    """A new session's routing key: its first AFFINITY_TOKENS token ids, or b"" where the
    prompt is too short for the replicas to reuse."""
    if len(prompt_ids) <= AFFINITY_TOKENS:
        return b""
    return struct.pack(f"<{AFFINITY_TOKENS}q", *prompt_ids[:AFFINITY_TOKENS])


# per pool: the multiplexed RPC, the messages of its calls and of its answers
MUX_RPCS = {"draft": ("ProposeMux", replica_pb2.ProposeCall, replica_pb2.ProposeCalls, replica_pb2.ProposeAnswers),
            "target": ("VerifyMux", replica_pb2.VerifyCall, replica_pb2.VerifyCalls, replica_pb2.VerifyAnswers)}


class PoolClients:
    def __init__(self, registry: Registry, draft_pool: str = "draft", target_pool: str = "target",
                 tls_ca_file: str | None = None, tls_cert_file: str | None = None, tls_key_file: str | None = None,
                 avoid_seconds: float = 10.0, registry_cache_seconds: float = 0.5,
                 tls_server_name: str | None = None, frames: bool = False, prefix_affinity: bool = True) -> None:
        self.registry = registry
        self.prefix_affinity = prefix_affinity  # False: new sessions go by load alone
        self.pools = {"draft": draft_pool, "target": target_pool}
        self.creds = channel_credentials(tls_ca_file, tls_cert_file, tls_key_file)
        self.options = channel_options(tls_server_name if self.creds else None)
        # frames: the shared streams go over a replica's frame link where it has one
        # (specdec.frames), else over gRPC as before
        self.frames = frames
        self.ssl_context = client_ssl_context(tls_ca_file, tls_cert_file, tls_key_file) if frames else None
        self.tls_server_name = tls_server_name
        self._frame_ports: dict[str, int] = {}  # from the registry: 0 = the replica has none
        self._vocab: dict[str, int] = {}  # from the registry: 0 = the replica did not say
        self.avoid_seconds = avoid_seconds
        self.cache_seconds = registry_cache_seconds
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[tuple[str, str], object] = {}  # built once per channel: not per call
        self._mux: dict[tuple[str, str], MuxLink] = {}  # one shared stream per replica
        self._down: dict[str, float] = {}
        self._placed: dict[str, int] = {}
        self._live_cache: dict[str, tuple[float, list[ReplicaInfo]]] = {}

    def channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = (grpc.aio.secure_channel(address, self.creds, options=self.options) if self.creds
                  else grpc.aio.insecure_channel(address, options=self.options))
            self._channels[address] = ch
        return ch

    def _stub(self, kind: str, address: str):
        stub = self._stubs.get((kind, address))
        if stub is None:
            cls = replica_pb2_grpc.DraftStub if kind == "draft" else replica_pb2_grpc.TargetStub
            stub = self._stubs[(kind, address)] = cls(self.channel(address))
        return stub

    def draft(self, address: str) -> replica_pb2_grpc.DraftStub:
        return self._stub("draft", address)

    def target(self, address: str) -> replica_pb2_grpc.TargetStub:
        return self._stub("target", address)

    def mux(self, kind: str, address: str) -> MuxLink:
        """This process's one multiplexed stream to the replica, for every generation."""
        link = self._mux.get((kind, address))
        if link is None:
            method, call_cls, calls_cls, answers_cls = MUX_RPCS[kind]
            name = f"{kind} replica {address}"
            port = self._frame_ports.get(address, 0) if self.frames else 0
            transport = "frames" if port > 0 else "grpc"
            if port > 0:
                host = address.rsplit(":", 1)[0].strip("[]")
                opener = lambda: FrameStream(host, port, method, answers_cls, name,  # noqa: E731
                                             self.ssl_context, self.tls_server_name)
            else:
                # the stub is looked up at each opening: a replica marked down gets a new channel
                opener = lambda: getattr(self._stub(kind, address), method)()  # noqa: E731
            link = self._mux[(kind, address)] = MuxLink(opener, name, kind, call_cls, calls_cls, transport)
        return link

    async def shared_link(self, kind: str, address: str) -> MuxLink:
        """`mux`, having first read the pool's registry entries where the replica's frame
        port is not known yet (a session placed by another orchestrator)."""
        if self.frames and address not in self._frame_ports and (kind, address) not in self._mux:
            await self.live(kind)
        return self.mux(kind, address)

    def mark_down(self, address: str) -> None:
        """A replica a call failed on: avoided for `avoid_seconds` by new placements, and its
        channel and links dropped so that the next call to it, if any, connects afresh."""
        self._down[address] = time.monotonic() + self.avoid_seconds
        ch = self._channels.pop(address, None)
        self._stubs.pop(("draft", address), None)
        self._stubs.pop(("target", address), None)
        loop = asyncio.get_running_loop()
        for kind in ("draft", "target"):
            link = self._mux.pop((kind, address), None)
            if link is not None:  # like the channel: calls in flight get a second to finish
                loop.call_later(1.0, link.close)
        if ch is not None:
            # closed lazily: calls still in flight on it finish or fail on their own
            loop.create_task(ch.close(grace=1.0))

    def is_down(self, address: str) -> bool:
        until = self._down.get(address)
        return until is not None and until > time.monotonic()

    async def live(self, kind: str) -> list[ReplicaInfo]:
        """The live replicas of a pool, those marked down left out; the registry is read at
        most once every `cache_seconds`, not once a call."""
        now = time.monotonic()
        cached = self._live_cache.get(kind)
        if cached and now - cached[0] < self.cache_seconds:
            replicas = cached[1]
        else:
            replicas = await self.registry.live(self.pools[kind])
            self._live_cache[kind] = (now, replicas)
            self._placed = {}
            self._frame_ports.update((r.address, r.frame_port) for r in replicas)
            self._vocab.update((r.address, r.vocab_size) for r in replicas)
        # with every registered replica marked down, all of them rather than none: one failed
        # call marks its replica down for avoid_seconds, and a failure may say more about the
        # call than the replica (its deadline, one session's state); a whole pool avoided would
        # fail every new session at once until the marks expire, while a replica that is really
        # gone leaves the registry by itself (it deregisters, or its entry expires)
        return [r for r in replicas if not self.is_down(r.address)] or replicas

    def vocab_size(self, address: str) -> int:
        """The vocabulary a replica registered (its logits' width), 0 where unknown: what a
        draft law the orchestrator writes itself (prompt lookup's point masses) must span."""
        return self._vocab.get(address, 0)

    async def pick(self, kind: str, exclude: set[str] = frozenset(), affinity: bytes = b"") -> str | None:
        """Least-loaded live replica of the pool, or None if the pool is empty. With an
        `affinity` (`prefix_affinity` of a new session's prompt), the replica that rendezvous
        hashing ranks first for it among those within AFFINITY_SLACK of the least loaded:
        sessions whose prompts begin alike meet where that beginning is held, and a replica
        that comes or goes moves only the prompts it ranked first for."""
        candidates = [r for r in await self.live(kind) if r.address not in exclude]
        if not candidates:
            return None

        def load(r: ReplicaInfo) -> float:
            return (r.sessions + self._placed.get(r.address, 0)) / max(1, r.capacity)
        if affinity and self.prefix_affinity:
            least = min(load(r) for r in candidates)
            near = [r for r in candidates if load(r) <= least + AFFINITY_SLACK]
            best = max(near, key=lambda r: hashlib.blake2b(affinity + r.address.encode(), digest_size=8).digest())
        else:
            best = min(candidates, key=load)
        self._placed[best.address] = self._placed.get(best.address, 0) + 1
        return best.address

    async def require(self, kind: str, exclude: set[str] = frozenset(), affinity: bytes = b"") -> str:
        """`pick`, or Unavailable saying so; `exclude`: the replicas the call has found down."""
        address = await self.pick(kind, exclude, affinity)
        if address is None:
            beyond = f" beyond the {len(exclude)} that failed this call" if exclude else ""
            raise Unavailable(f"no live {kind} replica is registered in pool {self.pools[kind]!r}{beyond}; "
                              f"start one (python -m {kind}_service) or wait for the pool to recover")
        return address

    async def close(self) -> None:
        for link in self._mux.values():
            link.close()
        self._mux.clear()
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
        self._stubs.clear()
