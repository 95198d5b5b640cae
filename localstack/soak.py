"""Soak: N concurrent streaming clients against a local stack for a while.

Each client loops, one request at a time, until the time is up (or the request budget is
spent), through a mix of what users send (`KINDS`): greedy and seeded sampled requests
with the adaptive γ, a fixed γ and target-only, stop strings, long prompts (fed to the
replicas in chunks), two-turn conversations ended with EndSession, and streams the client
cancels after their first chunk.

The report counts requests and errors by status code, gives latency percentiles of whole
requests and of the first chunk, and each process's resident memory (VmRSS, sampled every
few seconds): at the start, its peak in the first minute and in the last, at the end, and
its trend after the first minute (`memory_summary`): after warm-up the memory should stay
flat; for each replica the same of its memory less its KV caches (`kv_cache_mib`, from its
/metrics: the caches come and go with the sessions, and are bounded by its session limit);
and each replica's engine work from its /metrics (`engine_shares`). It also checks
what must hold however busy the stack is:
- the same greedy request gives the same tokens every time, whichever γ it ran with (a
  mismatch fails the soak); so does a seeded request that does not reproduce its tokens
  where every replica of the run was batch-invariant (their kernels say so in the
  registry), and elsewhere it is reported: batch company may round a product's last bits
  otherwise and move a sample that lies that close to a boundary (README: "Randomness is
  counter-based");
- once the clients stop, no session is left over: no handle in Redis, no cache on a
  replica, beyond what was there before (cancelled and ended sessions included).

With `chaos`, a replica is stopped every `chaos` seconds (SIGKILL, or SIGTERM for a
graceful drain), the draft and the target pool in turn, and a new one started in its
place: with two replicas a pool, the clients must see none of it (no error, the same
tokens), since a session moves to another replica and rebuilds its cache there. With
`chaos_orchestrators` as well, the stack's two orchestrators take their turn too, stopped
with the same signal (SIGTERM: a rolling update of their Deployment; SIGKILL: a crash, an
OOM kill): the clients send each call to one of the orchestrators running, the next in
turn, and a call refused by one that is shutting down to another, as a load balancer and a
retry policy would. Every request but the cancelled streams carries a request id, so a
call cut by an orchestrator's death is sent again with it (`Front.resume`): it continues
where the dead one stopped, and its whole answer must begin with the tokens the client had
already received. A conversation's turns and its EndSession go to whichever orchestrator
is next, so they also show that the orchestrators hold no session state.

With target variants (`--target-args`, `parse_variant`), the target pool is one replica per
variant, each started with its own flags and environment, and the report gives each one's
share of the engine's work beside its memory: settings compared side by side under one
load rather than by turns (how `--heap-trim-seconds` and the allocator's settings were
measured).
"""
from __future__ import annotations

import asyncio
import random
import re
import shlex
import signal
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import redis

from specdec.internal.v1 import replica_pb2, replica_pb2_grpc
from specdec.registry import PREFIX as REPLICA_PREFIX
from specdec.registry import ReplicaInfo
from specdec.session_store import PREFIX
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc as pb_grpc

from localstack.stack import Variant, scrape_metrics

PROMPTS = ["def parse_args(argv):\n", "class LRUCache:\n    def __init__(self, capacity):\n",
           "import json\n\ndef load_config(path):\n", "def binary_search(items, target):\n",
           "for line in open(path):\n", "async def fetch(session, url):\n"]
LONG_PROMPT = "total = add(total, item)  # sum of the values seen so far\n" * 48  # about 1,000 tokens
# what one request of each kind asks (`request_for`); the clients take them in turn
KINDS = ("greedy", "seeded", "stop", "long", "fixed_gamma", "conversation", "cancelled", "target_only")
SEEDS = 3  # seeded requests reuse this many seeds per prompt, so that each repeats
WARMUP_SECONDS = 60.0
MEMORY_SAMPLE_SECONDS = 5.0  # between two readings of each process's resident memory
TREND_SECONDS = 240.0  # of readings after the warm-up, at least, for a trend (`memory_summary`)
SETTLE_SECONDS = 15.0  # how long the leftover check waits for releases still on their way
CHAOS_SIGNALS = {"kill": (signal.SIGKILL,), "term": (signal.SIGTERM,), "both": (signal.SIGKILL, signal.SIGTERM)}
REDIRECTS = 3  # times a call refused by an orchestrator shutting down is sent to another
ENDPOINTS_LAG_S = 0.5  # how long calls still go to an orchestrator after its SIGTERM
# with orchestrators killed: their lease on the sessions they ran (--session-lease), and how
# long a client goes on sending a cut call again with its request id
KILLED_LEASE_S = 2.0
RESUME_WINDOW_S = 30.0
HELD_RETRY_S = 0.2  # between EndSessions refused while a call still holds the session


ENV_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


def parse_variant(text: str) -> Variant:
    """'[NAME=VALUE ...] [FLAGS ...]', read as a shell reads a command's words: the leading
    NAME=VALUE words go to the replica's environment (`MALLOC_ARENA_MAX=2`,
    `LD_PRELOAD=...`), the rest are its flags; '' is the defaults. ValueError for words
    a shell could not read, naming the text (the caller names its flag)."""
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise ValueError(f"{text!r}: {exc}") from None
    label = " ".join(shlex.quote(w) for w in words) or "defaults"
    env = {}
    while words and ENV_WORD.match(words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return Variant(env, words, label)


def replica_metrics(stack) -> Iterator[tuple[object, dict[str, float]]]:
    """(replica, its Prometheus samples) of each live replica with a /metrics port that answers."""
    for rep in stack.replicas:
        if not rep.metrics_port or rep.proc.poll() is not None:
            continue
        try:
            samples = scrape_metrics(rep.metrics_port)
        except OSError:
            continue
        yield rep, samples


def engine_shares(stack) -> dict[str, dict[str, float]]:
    """Of each replica with a /metrics port: its engine batches and seconds, and its share
    of the seconds of those replicas of its pool (how evenly the load fell between the
    variants whose memory a report compares)."""
    out = {}
    for rep, m in replica_metrics(stack):
        pool = f'{{pool="{rep.kind}"}}'
        out[process_name(rep)] = {"kind": rep.kind, "batches": m.get(f"specdec_engine_seconds_count{pool}", 0.0),
                                  "seconds": m.get(f"specdec_engine_seconds_sum{pool}", 0.0),
                                  "trims": m.get(f"specdec_replica_heap_trim_seconds_count{pool}", 0.0)}
    for kind in {e["kind"] for e in out.values()}:
        total = sum(e["seconds"] for e in out.values() if e["kind"] == kind)
        for e in out.values():
            if e["kind"] == kind:
                e["share"] = e["seconds"] / total if total else 0.0
    return out


def chaos_plan(sigs: tuple[int, ...], orchestrators: bool) -> list[tuple[str, int]]:
    """The order of the churn's stops, repeated: the pools (and the orchestrators) in turn,
    and with two signals each kind meets both. An orchestrator stop comes every other time
    then, killed and drained by turns, as it is where the two differ most for the clients
    (a call sent again with its request id, or refused and sent elsewhere): a short run of
    four stops sees both of them and both signals on the pools."""
    kill, term = signal.SIGKILL, signal.SIGTERM
    if len(sigs) == 1:
        return [(kind, sigs[0]) for kind in ("target", "draft") + (("orchestrator",) if orchestrators else ())]
    if orchestrators:
        return [("target", kill), ("orchestrator", term), ("draft", term), ("orchestrator", kill),
                ("target", term), ("orchestrator", term), ("draft", kill), ("orchestrator", kill)]
    return [("target", kill), ("draft", term), ("target", term), ("draft", kill)]


def stack_env(chaos_signal: str, chaos_orchestrators: bool, variants: bool = False) -> dict[str, str]:
    """The servers' environment for the soak: where orchestrators are killed, a short
    lease, so that the sessions a dead one held are free for their retries within
    KILLED_LEASE_S rather than the default 30 s; with target variants, routing by load
    alone, so that each variant meets every kind of request alike (prefix affinity sends
    every long prompt, which begins alike, to one of them)."""
    env = {}
    if chaos_orchestrators and signal.SIGKILL in CHAOS_SIGNALS[chaos_signal]:
        env["SPECDEC_SESSION_LEASE"] = str(KILLED_LEASE_S)
    if variants:
        env["SPECDEC_PREFIX_AFFINITY"] = "off"
    return env


def resident_mib(pid: int) -> float | None:
    """VmRSS of a process in MiB, None if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def memory_summary(samples: list[tuple[float, float | None]], warmup: float = WARMUP_SECONDS) -> dict:
    """One process's resident memory over a soak from its (seconds since the start, MiB)
    readings (None once it is gone): the first, the peaks of the first and of the last
    `warmup` seconds, the last, and the least-squares slope in MiB a minute of the readings
    after the first `warmup` seconds (None over less than `TREND_SECONDS` of them: over a
    minute or two the swing below moves it by tens of MiB a minute). Why peaks and a
    slope: a server's resident memory here moves by tens of MiB between readings 15 s apart
    as the allocator takes and gives back its arenas (a target replica over a 12-minute soak,
    2026-12-07, read 675-837 MiB by turns, with no trend), so two single readings, after the first minute
    and at the end, read that swing as growth or shrinkage; a leak is a steady rise, which
    the slope shows and the swing averages out of."""
    live = [(t, m) for t, m in samples if m is not None]
    if not live:
        return {"start": None, "first_minute_peak": None, "last_minute_peak": None, "end": None,
                "mib_per_minute": None}
    end_t = live[-1][0]
    first = [m for t, m in live if t <= warmup]
    after = [(t, m) for t, m in live if t > warmup]
    last = [m for t, m in after if t >= end_t - warmup]
    slope = None
    if len(after) >= 3 and after[-1][0] - after[0][0] >= TREND_SECONDS:
        mt = sum(t for t, _ in after) / len(after)
        mm = sum(m for _, m in after) / len(after)
        var = sum((t - mt) ** 2 for t, _ in after)
        slope = 60.0 * sum((t - mt) * (m - mm) for t, m in after) / var
    return {"start": samples[0][1], "first_minute_peak": max(first) if first else None,
            "last_minute_peak": max(last) if last else None, "end": samples[-1][1], "mib_per_minute": slope}


def kv_cache_mib(stack) -> dict[str, float]:
    """Of each live replica with a /metrics port: the MiB its KV caches hold (live sessions
    and released prefix donors, as of its last heartbeat). A replica's resident memory
    holds them too, and they come and go with the sessions (a long prompt's cache alone is
    tens of MiB on the target), so its memory less them is what tells a leak."""
    out = {}
    for rep, m in replica_metrics(stack):
        held = m.get(f'specdec_replica_cache_bytes{{pool="{rep.kind}"}}')
        if held is not None:
            out[process_name(rep)] = held / 2**20
    return out


def less_kv(rss: list[tuple[float, float | None]], kv: list[tuple[float, float]]) -> list[tuple[float, float | None]]:
    """Resident readings less the KV caches read with them (None where either is missing)."""
    held = dict(kv)
    return [(t, m - held[t] if m is not None and t in held else None) for t, m in rss]


def process_name(rep) -> str:
    return f"{rep.kind}@{rep.port}" + (f" [{rep.label}]" if rep.label else "")


def processes(stack) -> dict[str, int]:
    procs = {process_name(r): r.proc.pid for r in stack.replicas + stack.orchestrators}
    if stack.redis_proc is not None:
        procs[f"redis@{stack.redis_port}"] = stack.redis_proc.pid
    return procs


class MemoryWatch:
    """The stack's processes' resident memory, and each replica's KV caches, read every
    MEMORY_SAMPLE_SECONDS over the run: growth the caches do not explain is a leak."""

    def __init__(self, stack, t_start: float) -> None:
        self.stack, self.t_start = stack, t_start
        self.procs = processes(stack)  # those at the start: a restarted one is a new process
        self.rss: dict[str, list[tuple[float, float | None]]] = {name: [] for name in self.procs}
        self.kv: dict[str, list[tuple[float, float]]] = {}

    async def read(self) -> None:
        t = time.monotonic() - self.t_start
        for name, pid in self.procs.items():
            self.rss[name].append((t, resident_mib(pid)))
        for name, mib in (await asyncio.to_thread(kv_cache_mib, self.stack)).items():
            self.kv.setdefault(name, []).append((t, mib))

    async def sample(self) -> None:
        """Reads until cancelled."""
        while True:
            await asyncio.sleep(MEMORY_SAMPLE_SECONDS)
            await self.read()

    def summary(self) -> dict[str, dict]:
        """Each process's `memory_summary`; a replica's also of its memory less its caches."""
        memory = {name: memory_summary(samples) for name, samples in self.rss.items()}
        for name, kv in self.kv.items():
            if name in memory:
                memory[name]["kv_mean"] = sum(m for _, m in kv) / len(kv)
                memory[name]["less_kv"] = memory_summary(less_kv(self.rss[name], kv))
        return memory


def percentiles(values: list[float]) -> dict[str, float | None]:
    ordered = sorted(values)

    def rank(q: float) -> float | None:  # nearest rank
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None

    return {"p50": rank(0.50), "p90": rank(0.90), "p99": rank(0.99)}


def request_for(i: int, max_new_tokens: int) -> tuple[str, pb.GenerateRequest]:
    """→ (the kind, the request) of the i-th request; a conversation's first turn."""
    kind = KINDS[i % len(KINDS)]
    prompt = PROMPTS[(i // len(KINDS)) % len(PROMPTS)]
    req = pb.GenerateRequest(prompt=prompt, max_new_tokens=max_new_tokens, temperature=0.0)
    if kind != "cancelled":  # a client that gives up on a stream does not retry it
        req.request_id = uuid.uuid4().hex
    if kind in ("greedy", "seeded", "long"):  # every other one: their repeats' must match too
        req.logprobs = (i // len(KINDS)) % 2 == 0
    if kind in ("greedy", "seeded", "long", "fixed_gamma", "target_only") and (i // len(KINDS)) % 4 >= 2:
        req.repetition_penalty, req.presence_penalty = 1.2, 0.4  # every other pair of rounds penalised
    if kind == "seeded":
        req.temperature, req.seed = 0.8, i % SEEDS
    elif kind == "stop":
        req.stop.append("\n\n")
    elif kind == "long":
        req.prompt = LONG_PROMPT + prompt
    elif kind == "fixed_gamma":
        req.num_speculative_tokens = 4
    elif kind == "conversation":
        req.keep_session = True
    elif kind == "target_only":
        req.num_speculative_tokens = 0
    return kind, req


def consistency_key(req: pb.GenerateRequest) -> tuple | None:
    """Requests with equal keys must give equal tokens: greedy ones (whatever their γ) and
    seeded sampled ones. None: no such promise (a conversation's turns, a cancelled stream)."""
    if req.session_id or req.keep_session:
        return None
    seed = req.seed if req.temperature > 0 else None
    if req.temperature > 0 and not req.HasField("seed"):
        return None
    return (req.prompt, req.max_new_tokens, req.temperature, seed, tuple(req.stop), req.repetition_penalty,
            req.presence_penalty)


class Front:
    """The clients' way in: a channel to each orchestrator of the stack, each call sent to
    the next one serving. `redirect` says which failures a retry policy would hide:
    UNAVAILABLE before the call did anything, from an orchestrator shutting down (its
    refusal, or no connection once it is gone)."""

    def __init__(self, stack) -> None:
        # the orchestrators serving, as a Service's endpoints list its ready pods: one that
        # is still starting is not in it (its port refuses connections, and a gRPC channel
        # that found it so fails its calls at once for a backoff of up to minutes)
        self.serving = [r.address for r in stack.orchestrators]
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.drained: set[str] = set()  # orchestrators the churn stopped or is stopping
        self.turn = 0
        self.redirected = 0  # calls sent again, to another orchestrator
        self.resumed = 0  # calls sent again with their request id after they had started

    def stopping(self, address: str) -> None:
        """The churn has signalled it: its failures from now on are its stop's (a call cut as
        its server stops fails CANCELLED), whether or not the clients still reach it."""
        self.drained.add(address)

    def drain(self, address: str) -> None:
        """The endpoints' update has spread: clients no longer reach it (`stopping` came first)."""
        self.serving.remove(address)

    def stub(self) -> tuple[str, pb_grpc.OrchestratorStub]:
        address = self.serving[self.turn % len(self.serving)]
        self.turn += 1
        if address not in self.channels:
            self.channels[address] = grpc.aio.insecure_channel(address)
        return address, pb_grpc.OrchestratorStub(self.channels[address])

    def redirect(self, address: str, exc: grpc.aio.AioRpcError, attempt: int, fresh: bool = False) -> bool:
        """Whether a call that failed so, before any answer, goes to another orchestrator
        (counted), which it does at most REDIRECTS times: refused by one shutting down, or
        finding it gone; or, `fresh` (a new session and no request id: nothing to continue),
        cut by its death, whose session another orchestrator releases (orchestrator/reaper.py)."""
        details = exc.details() or ""
        if attempt >= REDIRECTS or exc.code() != grpc.StatusCode.UNAVAILABLE or not (
                "shutting down" in details or "failed to connect" in details or address in self.drained or fresh):
            return False
        self.redirected += 1
        return True

    def resume(self, address: str, exc: grpc.aio.AioRpcError, req: pb.GenerateRequest, since: float) -> bool:
        """Whether a call carrying a request id that failed so is sent again (counted): cut
        by its orchestrator's death (UNAVAILABLE, or CANCELLED as the connection dropped),
        or refused while the cut attempt's lease still held its session (ABORTED, "in
        use"), for up to RESUME_WINDOW_S since it was first sent."""
        details = exc.details() or ""
        cut = exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        held = exc.code() == grpc.StatusCode.ABORTED and "in use by another call" in details
        if not req.request_id or not (cut or held) or time.perf_counter() - since > RESUME_WINDOW_S:
            return False
        self.resumed += 1
        return True

    async def close(self) -> None:
        for channel in self.channels.values():
            await channel.close()


class Tally:
    """What the clients saw, shared by all of them (one event loop)."""

    def __init__(self) -> None:
        self.latency: list[float] = []
        self.first_chunk: list[float] = []
        self.errors: Counter = Counter()
        self.first_error: dict[str, str] = {}  # by status: the first one's message, to say what failed
        self.kinds: Counter = Counter()
        self.tokens = 0
        self.cancelled = 0
        self.continued = 0  # answers that went on from tokens a cut attempt had committed
        self.expected: dict[tuple, tuple[list[int], str]] = {}  # key → (tokens, how it ran) of its first answer
        self.compared: Counter = Counter()  # repeats compared with their first answer, by kind
        self.differed: dict[str, list[str]] = {"greedy": [], "seeded": []}
        self.logprobs: dict[tuple, tuple] = {}  # key → (tokens, log-probabilities) of its first answer with them
        self.logprobs_compared = 0

    def fail(self, what: str, exc: grpc.aio.AioRpcError | str) -> None:
        self.errors[what] += 1
        self.first_error.setdefault(what, exc if isinstance(exc, str) else exc.details())

    def check(self, req: pb.GenerateRequest, tokens: list[int], stats: pb.GenerationStats | None,
              session: str | None = None, logprobs: list[float] | None = None) -> None:
        key = consistency_key(req)
        if req.logprobs:
            self.check_logprobs(key, tokens, logprobs or [])
        if key is None:
            return
        kind = "greedy" if req.temperature == 0 else "seeded"
        ran = how_it_ran(stats, session)
        if key not in self.expected:
            self.expected[key] = (tokens, ran)
            return
        want, want_ran = self.expected[key]
        self.compared[kind] += 1
        if tokens != want:
            at = next((i for i, (a, b) in enumerate(zip(tokens, want)) if a != b), min(len(tokens), len(want)))
            gamma = req.num_speculative_tokens if req.HasField("num_speculative_tokens") else "adaptive"
            self.differed[kind].append(
                f"{kind}, γ {gamma}, a prompt of {len(req.prompt)} characters: tokens differ from token {at} "
                f"of {len(want)}; this request: {ran}; the first: {want_ran}")


    def check_logprobs(self, key: tuple | None, tokens: list[int], logprobs: list[float]) -> None:
        """One log-probability per token, those of a retried answer's resumed tokens too; and
        a repeat's the same as the first's (to 1e-4: the target's rows, whatever its company)."""
        if len(logprobs) != len(tokens):
            self.fail("LOGPROBS_MISSING", f"{len(logprobs)} log-probabilities for {len(tokens)} tokens")
            return
        if key is None:
            return
        first_tokens, first = self.logprobs.setdefault(key, (tokens, logprobs))
        if first is logprobs or first_tokens != tokens:  # other tokens: reported by `check`
            return
        self.logprobs_compared += 1
        worst = max((abs(a - b) for a, b in zip(first, logprobs)), default=0.0)
        if worst > 1e-4:
            self.fail("LOGPROBS_DIFFER", f"a repeat's log-probabilities differ from the first's by {worst:.2e}")


def how_it_ran(stats: pb.GenerationStats | None, session: str | None = None) -> str:
    """Its rounds, drafted tokens, failovers and replicas, and its session id: what the
    servers' logs name it by."""
    if stats is None:
        return "no stats"
    return (f"{stats.rounds} rounds, {stats.drafted_tokens} drafted, {stats.replica_failovers} failovers, "
            f"draft {stats.draft_replica or '-'}, target {stats.target_replica}"
            + (f", session {session}" if session else ""))


async def stream_once(front: Front, req: pb.GenerateRequest, tally: Tally, timeout: float,
                      cancel_after_first: bool = False) -> str | None:
    """One GenerateStream (sent again where `Front` says so); → its session id (None when
    it failed or was cancelled). A call continued with its request id must answer with the
    tokens its cut attempts had streamed, then the rest."""
    t0 = time.perf_counter()
    first, seen, attempt = None, [], 0  # seen: the most tokens a cut attempt streamed
    while True:
        address, stub = front.stub()
        tokens, logprobs, session, last = [], [], None, None
        call = stub.GenerateStream(req, timeout=timeout)
        try:
            async for chunk in call:
                session, last = chunk.session_id or session, chunk
                if first is None and chunk.token_ids:
                    first = time.perf_counter() - t0
                    if cancel_after_first:
                        call.cancel()
                        tally.cancelled += 1
                        return None
                tokens.extend(chunk.token_ids)
                logprobs.extend(item.logprob for item in chunk.logprobs)
            break
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as exc:
            seen = max(seen, tokens, key=len)
            if last is None and front.redirect(address, exc, attempt, fresh=not (req.request_id or req.session_id)):
                attempt += 1
                continue
            if front.resume(address, exc, req, t0):
                await asyncio.sleep(0.2 if exc.code() == grpc.StatusCode.ABORTED else 0)
                continue
            tally.fail(exc.code().name, exc)
            return None
    if tokens[:len(seen)] != seen:
        tally.fail("RESUMED_OTHERWISE", f"a call continued with its request id answered {tokens[:len(seen)]} "
                                        f"where its cut attempt had streamed {seen}")
        return None
    tally.latency.append(time.perf_counter() - t0)
    tally.continued += last is not None and last.stats.resumed_tokens > 0
    if first is not None:
        tally.first_chunk.append(first)
    tally.tokens += len(tokens)
    tally.check(req, tokens, last.stats if last is not None else None, session, logprobs)
    return session


async def end_session(front: Front, session: str, tally: Tally, timeout: float) -> None:
    """EndSession, sent again where its orchestrator stopped under it, or while a call still
    holds the session (ABORTED, "in use": the answer says to retry once it ends, which for a
    call cut by its orchestrator's death is within that orchestrator's lease), for up to
    RESUME_WINDOW_S; a session found gone by such a retry was ended by the attempt that was
    cut."""
    retried, attempt, since = False, 0, time.perf_counter()
    while True:
        address, stub = front.stub()
        try:
            await stub.EndSession(pb.EndSessionRequest(session_id=session), timeout=timeout)
            return
        except grpc.aio.AioRpcError as exc:
            if retried and exc.code() == grpc.StatusCode.NOT_FOUND:
                return
            if attempt < REDIRECTS and (front.redirect(address, exc, attempt) or
                                        exc.code() == grpc.StatusCode.CANCELLED and address in front.drained):
                retried, attempt = True, attempt + 1
                continue
            held = exc.code() == grpc.StatusCode.ABORTED and "in use by another call" in (exc.details() or "")
            if held and time.perf_counter() - since <= RESUME_WINDOW_S:
                retried = True
                await asyncio.sleep(HELD_RETRY_S)
                continue
            tally.fail(f"EndSession {exc.code().name}", exc)
            return


async def one_request(front: Front, i: int, max_new_tokens: int, tally: Tally, timeout: float) -> None:
    kind, req = request_for(i, max_new_tokens)
    tally.kinds[kind] += 1
    session = await stream_once(front, req, tally, timeout, cancel_after_first=kind == "cancelled")
    if kind != "conversation" or session is None:
        return
    follow = pb.GenerateRequest(prompt="\n# and then\n", max_new_tokens=max_new_tokens, temperature=0.0,
                                session_id=session, request_id=uuid.uuid4().hex)
    await stream_once(front, follow, tally, timeout)
    await end_session(front, session, tally, timeout)


async def sessions_held(stack) -> dict[str, int]:
    """Session handles in Redis and caches on each replica, now. A request id's whole
    answer on a session not kept stays in Redis for the orchestrators' --retry-window,
    with no replica and no cache: not counted."""
    client = redis.Redis(port=stack.redis_port, password=stack.redis_password)
    try:
        held = {"redis": sum(1 for key in client.scan_iter(PREFIX + "*")
                             if key.count(b":") == 2 and client.hget(key, "target"))}
    finally:
        client.close()
    for rep in stack.replicas:
        if rep.proc.poll() is not None:
            continue
        async with grpc.aio.insecure_channel(rep.address) as channel:
            stub = (replica_pb2_grpc.DraftStub if rep.kind == "draft" else replica_pb2_grpc.TargetStub)(channel)
            try:
                held[f"{rep.kind}@{rep.port}"] = (await stub.Load(replica_pb2.LoadRequest(), timeout=10)).sessions
            except grpc.aio.AioRpcError:
                if rep.proc.poll() is None:  # a replica that runs must answer
                    raise
    return held


def replica_kernels(stack) -> dict[str, str]:
    """Each running replica's kernels as its registry entry reports them ("...;
    batch-invariant" where a session's bits do not depend on its batch company)."""
    client = redis.Redis(port=stack.redis_port, password=stack.redis_password)
    try:
        kernels = {}
        for rep in stack.replicas:
            entry = client.get(f"{REPLICA_PREFIX}{rep.kind}:{rep.address}")
            if entry is not None and rep.proc.poll() is None:
                kernels[f"{rep.kind}@{rep.port}"] = ReplicaInfo.from_json(entry).kernels
        return kernels
    finally:
        client.close()


async def leftovers(stack, before: dict[str, int]) -> dict[str, int]:
    """Sessions held beyond `before` once the releases still on their way have landed."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        now = await sessions_held(stack)
        extra = {name: n - before.get(name, 0) for name, n in now.items() if n > before.get(name, 0)}
        if not extra or time.monotonic() > deadline:
            return extra
        await asyncio.sleep(0.5)


async def churn(stack, every: float, sigs: tuple[int, ...], stop: asyncio.Event, restarts: list[str],
                kernels: dict[str, str], front: Front | None = None) -> None:
    """Every `every` seconds until `stop` is set, stop a replica of the draft and the target
    pool in turn (and, given the clients' `front`, one of the orchestrators) with one of
    `sigs`, as `chaos_plan` orders them,
    and start a new one in its place, waiting until it serves and, for a replica, has
    registered, and note its kernels in `kernels`. A restart under way when `stop` is set is
    finished, not cut short, so that the stack's lists of servers are whole when the soak
    takes its count."""
    client = redis.Redis(port=stack.redis_port, password=stack.redis_password)
    rng = random.Random(0)
    plan = chaos_plan(sigs, front is not None)
    try:
        while True:
            try:
                await asyncio.wait_for(stop.wait(), timeout=every)
                return
            except asyncio.TimeoutError:
                pass
            kind, sig = plan[len(restarts) % len(plan)]
            if kind == "orchestrator":
                victim = rng.choice([r for r in stack.orchestrators if r.proc.poll() is None])
                front.stopping(victim.address)
                victim.proc.send_signal(sig)
                # calls still reach it for a moment, as they reach a pod until the endpoints'
                # update has spread: it refuses them (or, killed, fails to connect), and the
                # clients send them elsewhere
                await asyncio.sleep(ENDPOINTS_LAG_S)
                front.drain(victim.address)
                await asyncio.to_thread(victim.proc.wait, 30)
                stack.orchestrators.remove(victim)
                fresh = stack.start_orchestrator(wait=False)  # started here, on the loop's thread: leashed
                await asyncio.to_thread(stack.wait_serving, fresh)
                front.serving.append(fresh.address)
                restarts.append(f"orchestrator@{victim.port} ({signal.Signals(sig).name}, exit {victim.proc.returncode}) → "
                                f"orchestrator@{fresh.port}")
                continue
            victim = rng.choice([r for r in stack.replicas if r.kind == kind and r.proc.poll() is None])
            await asyncio.to_thread(stack.kill, victim, sig)
            stack.replicas.remove(victim)
            fresh = stack.start_replica(kind, wait=False)
            await asyncio.to_thread(stack.wait_serving, fresh)
            while not client.exists(f"{REPLICA_PREFIX}{kind}:{fresh.address}"):
                await asyncio.sleep(0.1)
            restarts.append(f"{kind}@{victim.port} ({signal.Signals(sig).name}) → {kind}@{fresh.port}")
            kernels.update(replica_kernels(stack))
    finally:
        client.close()


async def soak(stack, streams: int, seconds: float, max_new_tokens: int,
               max_requests: int | None = None, chaos: float | None = None, chaos_signal: str = "kill",
               chaos_orchestrators: bool = False, min_stops: int = 0) -> dict:
    """Run the soak against `stack` (a started LocalStack, nothing else using it; two
    orchestrators where `chaos_orchestrators`); print and return the report. With chaos, the
    clients go on past `seconds` (for twice as long again at most) until the churn has stopped
    `min_stops` servers: a slow machine's restarts take longer, and a short run that a test
    makes must still see its stops."""
    before = await sessions_held(stack)
    tally, issued = Tally(), 0
    t_start = time.monotonic()
    t_end = t_start + seconds
    watch = MemoryWatch(stack, t_start)
    await watch.read()
    timeout = max(30.0, 2 * seconds)

    def going_on() -> bool:
        now = time.monotonic()
        if max_requests is not None and issued >= max_requests:
            return False
        return now < t_end or (bool(chaos) and len(restarts) < min_stops and now < t_end + 2 * seconds)

    async def client(front: Front) -> None:
        nonlocal issued
        while going_on():
            i, issued = issued, issued + 1  # the clients take the kinds in turn between them
            await one_request(front, i, max_new_tokens, tally, timeout)

    front = Front(stack)
    restarts: list[str] = []
    sampler = asyncio.create_task(watch.sample())
    try:
        kernels = replica_kernels(stack)  # and every replica started in the run
        stop_chaos = asyncio.Event()
        chaos_task = (asyncio.create_task(churn(stack, chaos, CHAOS_SIGNALS[chaos_signal], stop_chaos, restarts,
                                                kernels, front if chaos_orchestrators else None))
                      if chaos else None)
        await asyncio.gather(*(client(front) for _ in range(streams)))
        if chaos_task is not None:
            stop_chaos.set()
            await chaos_task  # a restart under way finishes first
    finally:
        sampler.cancel()
        await front.close()
    elapsed = time.monotonic() - t_start
    await watch.read()
    memory = watch.summary()
    engines = engine_shares(stack)
    left = await leftovers(stack, before)

    report = {
        "streams": streams, "seconds": round(elapsed, 1), "max_new_tokens": max_new_tokens,
        "requests": len(tally.latency) + sum(tally.errors.values()) + tally.cancelled, "ok": len(tally.latency),
        "cancelled": tally.cancelled, "kinds": dict(tally.kinds),
        "errors": sum(tally.errors.values()), "errors_by_code": dict(tally.errors),
        "first_errors": tally.first_error, "tokens": tally.tokens,
        "compared": dict(tally.compared), "differed": tally.differed, "leftovers": left,
        "restarts": restarts, "chaos_signal": chaos_signal if chaos else None, "redirected": front.redirected,
        "resumed": front.resumed, "continued": tally.continued, "logprobs_compared": tally.logprobs_compared,
        "batch_invariant": bool(kernels) and all("batch-invariant" in k for k in kernels.values()),
        "kernels": kernels,
        "latency_s": {"request": percentiles(tally.latency), "first_chunk": percentiles(tally.first_chunk)},
        "memory_mib": memory, "engines": engines,
    }
    print(format_report(report), flush=True)
    return report


def passed(report: dict) -> bool:
    """No error, no greedy repeat with other tokens, no session left over, and where every
    replica of the run was batch-invariant, no seeded repeat with other tokens either.
    Elsewhere a seeded repeat that differs is reported with how each ran, not failed: its
    company may round a product's last bits otherwise and move a sample that lies that
    close to a boundary (README: "Randomness is counter-based")."""
    seeded_must_match = report.get("batch_invariant", False)
    return (report["errors"] == 0 and not report["differed"]["greedy"] and not report["leftovers"]
            and not (seeded_must_match and report["differed"]["seeded"]))


def format_report(r: dict) -> str:
    def sec(v):
        return "    -" if v is None else f"{v:6.3f}"

    def mib(v):
        return "      -" if v is None else f"{v:7.1f}"

    lines = [f"soak: {r['streams']} streams for {r['seconds']:.0f} s, max_new_tokens {r['max_new_tokens']}",
             f"requests  {r['requests']} ({r['requests'] / max(r['seconds'], 1e-9):.2f}/s), "
             f"ok {r['ok']}, cancelled by the client {r['cancelled']}, errors {r['errors']}"
             + (f" {r['errors_by_code']}" if r["errors"] else ""),
             *(f"          the first {code}: {message}" for code, message in r["first_errors"].items()),
             "by kind   " + ", ".join(f"{k} {n}" for k, n in r["kinds"].items()),
             f"tokens    {r['tokens']} ({r['tokens'] / max(r['seconds'], 1e-9):.1f}/s)",
             f"repeats   greedy: {len(r['differed']['greedy'])} of {r['compared'].get('greedy', 0)} with other "
             f"tokens; seeded: {len(r['differed']['seeded'])} of {r['compared'].get('seeded', 0)} "
             + ("(every replica batch-invariant: they must match)" if r.get("batch_invariant") else
                "(not every replica batch-invariant: a seeded sample may move with its batch company)"),
             *(f"          {m}" for kind in ("greedy", "seeded") for m in r["differed"][kind][:5]),
             f"logprobs  {r.get('logprobs_compared', 0)} repeats' compared with their first answer's "
             "(a mismatch, or fewer than the tokens, is an error)",
             *([f"chaos     {len(r['restarts'])} servers stopped with "
                + ("SIGKILL and SIGTERM by turns" if r["chaos_signal"] == "both" else f"SIG{r['chaos_signal'].upper()}")
                + (" (orchestrators too)" if any(x.startswith("orchestrator") for x in r["restarts"]) else "")
                + " and replaced: " + ", ".join(r["restarts"])]
               if r["chaos_signal"] else []),
             *(["kernels   not batch-invariant: " + ", ".join(f"{name} {k}" for name, k in r["kernels"].items()
                                                          if "batch-invariant" not in k)]
               if r.get("kernels") and not r.get("batch_invariant") else []),
             *([f"redirected {r['redirected']} calls refused by an orchestrator shutting down or gone, sent to "
                f"another"] if r.get("redirected") else []),
             *([f"resumed   {r['resumed']} times a call cut by its orchestrator's death (or refused while the cut "
                f"attempt held its session) was sent again with its request id; {r['continued']} answers went on "
                f"from tokens a cut attempt committed"] if r.get("resumed") else []),
             "left over " + (", ".join(f"{name} {n}" for name, n in r["leftovers"].items())
                             if r["leftovers"] else "no session handle or cache beyond those there before"),
             "",
             "latency (s)      p50     p90     p99"]
    for name, key in (("request", "request"), ("first chunk", "first_chunk")):
        p = r["latency_s"][key]
        lines.append(f"{name:<14} {sec(p['p50'])}  {sec(p['p90'])}  {sec(p['p99'])}")
    width = max([22, *(len(name) for name in r["memory_mib"])])

    def memory_row(name: str, m: dict) -> str:
        trend = ("      - (too short a run)" if m["mib_per_minute"] is None
                 else f"{m['mib_per_minute']:+7.2f} MiB a minute")
        return (f"{name:<{width}} {mib(m['start'])}  {mib(m['first_minute_peak']):>17}  "
                f"{mib(m['last_minute_peak']):>18}  {mib(m['end'])}  {trend:<26}")

    columns = "   start  1st minute's peak  last minute's peak      end  trend after the 1st minute"
    lines += ["", f"{'resident memory (MiB)':<{width}}{columns}"]
    lines += [memory_row(name, m).rstrip() for name, m in r["memory_mib"].items()]
    less = {name: m for name, m in r["memory_mib"].items() if "less_kv" in m}
    if less:
        lines += ["", f"{'less its KV caches':<{width}}{columns}  KV caches' mean"]
        lines += [f"{memory_row(name, m['less_kv'])}  {m['kv_mean']:15.1f}" for name, m in less.items()]
    if r.get("engines"):
        lines += ["", f"{'engine work':<{width}}  batches  seconds  share of its pool's  heap trims"]
        for name, e in r["engines"].items():
            lines.append(f"{name:<{width}} {e['batches']:8.0f} {e['seconds']:8.1f} {e['share']:20.1%} "
                         f"{e['trims']:11.0f}")
    return "\n".join(lines)
