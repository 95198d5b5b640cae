"""What a round's Redis commit costs: `python -m benchmarks.commit_probe`.

Every round of every session ends in one commit script call (specdec/session_store.py),
so Redis and the orchestrators pay per round, not per request. This starts a local
redis-server, creates `--sessions` handles and commits a round for each of them per turn,
as a target batch's sessions do under load, three ways by turns:

- batched: `SessionStore.commit`, the commits of one event-loop turn in one write
  (specdec/commit_batch.py), what the orchestrator does;
- pipeline: the same script calls through one redis-py pipeline a turn;
- separate: one call of the registered redis-py script per session, awaited together, as
  the orchestrator committed before the batching.

For each it prints the client's CPU, Redis's CPU and the wall time per commit: Redis's
figure sizes the Redis a deployment needs (commits per second = rounds per second over
all sessions), the client's what the orchestrators spend on it.
"""
from __future__ import annotations

import argparse
import asyncio
import time

import redis.asyncio as aioredis

from benchmarks.stack_probe import cpu_seconds
from localstack.stack import LocalStack
from specdec import event_loop
from specdec.rounds import Cursor
from specdec.session_store import COMMIT_SCRIPT, RoundCommit, SessionHandle, SessionStore

WAYS = ("batched", "pipeline", "separate")


class Committer:
    """One turn of commits, one round for every session, by each way."""

    def __init__(self, client: aioredis.Redis, store: SessionStore, handles: list[SessionHandle]) -> None:
        self.client, self.store, self.handles = client, store, handles
        self.script = client.register_script(COMMIT_SCRIPT)

    def _round(self) -> list[RoundCommit]:
        commits = []
        for handle in self.handles:
            handle.committed.append(7)
            handle.cursor = Cursor(handle.length - 1, handle.length - 1, False)
            commits.append(self.store.round_commit(handle, [7]))
        return commits

    async def batched(self) -> None:
        await asyncio.gather(*(self.store.commit(c) for c in self._round()))

    async def pipeline(self) -> None:
        async with self.client.pipeline(transaction=False) as pipe:
            for c in self._round():
                pipe.evalsha(self.script.sha, len(c.keys), *c.keys, *c.args)
            await pipe.execute()

    async def separate(self) -> None:
        await asyncio.gather(*(self.script(keys=c.keys, args=c.args) for c in self._round()))


async def probe(port: int, redis_pid: int, sessions: int, turns: int, rounds: int) -> list[str]:
    client = aioredis.Redis(port=port)
    store = SessionStore(client, ttl_seconds=600)
    handles = [SessionHandle(f"probe{i}", "draft:1", "target:1", 1, list(range(64)), Cursor(63, 63, False),
                             {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": i}) for i in range(sessions)]
    await client.script_load(COMMIT_SCRIPT)
    committer = Committer(client, store, handles)
    totals = {way: [0.0, 0.0, 0.0] for way in WAYS}
    for k in range(rounds):
        for way in (WAYS if k % 2 == 0 else WAYS[::-1]):
            for handle in handles:  # every way commits onto handles of the same length
                handle.committed[:] = list(range(64))
                await store.create(handle)
            run = getattr(committer, way)
            c0, r0, t0 = time.process_time(), cpu_seconds(redis_pid), time.perf_counter()
            for _ in range(turns):
                await run()
            n = turns * sessions
            for i, value in enumerate((time.process_time() - c0, cpu_seconds(redis_pid) - r0,
                                       time.perf_counter() - t0)):
                totals[way][i] += 1e6 * value / n / rounds
    await client.aclose()
    lines = [f"{sessions} sessions' commits a turn, {turns} turns × {rounds} rounds by turns, µs per commit:",
             "| way | client CPU | Redis CPU | wall |", "|---|---|---|---|"]
    lines += [f"| {way} | {c:.1f} | {r:.1f} | {w:.1f} |" for way, (c, r, w) in totals.items()]
    return lines


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.commit_probe", description=__doc__.split("\n\n")[1])
    ap.add_argument("--sessions", type=int, default=16, help="sessions committing in each turn (default 16)")
    ap.add_argument("--turns", type=int, default=300, help="turns per way and round (default 300)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over the three ways, order reversed "
                                                         "every round (default 3)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if min(args.sessions, args.turns, args.rounds) < 1:
        raise SystemExit("--sessions, --turns and --rounds must be at least 1")
    stack = LocalStack()
    try:
        stack.start_redis()
        lines = event_loop.run(probe(stack.redis_port, stack.redis_proc.pid, args.sessions, args.turns, args.rounds),
                               event_loop.resolve("auto"))
    finally:
        stack.stop()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
