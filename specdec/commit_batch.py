"""Round commits of many sessions in one Redis round trip.

Under load the sessions of one target batch get their answers in the same event-loop turn,
and each then commits its round: one script call apiece, each its own send, its own wake-up
of Redis and its own trip through redis-py's command packing. Here the commits submitted in
one turn leave together on the next, as one write of pre-packed RESP on one pooled
connection, and their replies are read in order. Against a local redis-server, 16 commits
a turn cost the client 32-34 µs of CPU each this way, 42-43 µs through a redis-py pipeline
and 64-76 µs as a script call each, and Redis 13-15 µs against 21-29 µs
(`python -m benchmarks.commit_probe`; benchmarks/HISTORY.md, "Round commits in one round
trip"). A lone commit waits one loop turn, a few µs.

Every commit is absolute (SETRANGE at an offset, the whole cursor), so a batch, or part of
one, may be sent again: a broken connection, a timeout or an error reply is retried with
backoff for up to `retry_seconds`, and a Redis that forgot the script (NOSCRIPT, after a
restart) gets it loaded again. Each waiter gets its own outcome.
"""
from __future__ import annotations

import asyncio
import hashlib
from typing import Sequence

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, RedisError, ResponseError

from specdec import metrics
from specdec.errors import Unavailable
from specdec.retry import RetryWindow

_Pending = tuple[bytes, asyncio.Future]  # (one packed command, its waiter)


def pack_command(args: Sequence) -> bytes:
    """One command in RESP, as a client sends it: an array of bulk strings. Ints and str
    arguments are sent as their decimal or UTF-8 text, as redis-py would."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


class CommitBatcher:
    """Sends the script calls submitted in one loop turn as one write on the next."""

    def __init__(self, client: aioredis.Redis, script_source: str, retry_seconds: float) -> None:
        self.redis = client
        self.script_source = script_source
        self.sha = hashlib.sha1(script_source.encode()).hexdigest()  # the name Redis knows a script by
        self.retry_seconds = retry_seconds
        self._pending: list[_Pending] = []
        self._next: asyncio.Task | None = None  # the sender that will take the pending commits
        self._senders: set[asyncio.Task] = set()  # every sender still running (tasks need a reference)
        self.round_trips = 0  # writes that carried commits (retries included)

    async def submit(self, keys: Sequence[str], args: Sequence):
        """Run the script once for these keys and arguments, beside whatever else is
        submitted in this turn; → the script's reply, or Unavailable once it could not land
        within retry_seconds."""
        command = pack_command(["EVALSHA", self.sha, len(keys), *keys, *args])
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._pending.append((command, waiter))
        if self._next is None or self._next.done():  # done: cancelled before it ran (a loop's end)
            self._next = task = loop.create_task(self._send_next_turn())
            self._senders.add(task)
            task.add_done_callback(self._senders.discard)
        return await waiter

    async def _send_next_turn(self) -> None:
        """A task runs its first step on the loop's next turn: by then every commit of this
        turn is queued. Nothing here raises to the task's awaiter (it has none): every
        waiter gets its outcome, a bug's exception included."""
        self._next = None
        batch, self._pending = self._pending, []
        metrics.REDIS_COMMIT_BATCH.observe(len(batch))
        try:
            await self._land(batch)
        except BaseException as exc:
            stopping = isinstance(exc, asyncio.CancelledError)
            for _, waiter in batch:
                if not waiter.done():
                    waiter.set_exception(Unavailable("the orchestrator stopped before the round's commit landed")
                                         if stopping else Unavailable(f"the round's commit failed: {exc!r}"))
            if stopping:
                raise

    async def _land(self, batch: list[_Pending]) -> None:
        window = RetryWindow(self.retry_seconds)
        todo = [(command, waiter) for command, waiter in batch if not waiter.done()]
        while todo:
            try:
                replies = await self._round_trip([command for command, _ in todo])
            except RedisError as exc:
                replies = [exc] * len(todo)
            for (_, waiter), reply in zip(todo, replies):
                if not isinstance(reply, Exception) and not waiter.done():
                    waiter.set_result(reply)
            failed = [(item, reply) for item, reply in zip(todo, replies) if isinstance(reply, Exception)]
            if not failed:
                return
            todo, error = [item for item, _ in failed], failed[-1][1]
            if window.spent():
                for _, waiter in todo:
                    if not waiter.done():
                        waiter.set_exception(Unavailable(f"Redis is unavailable: {error}"))
                return
            if any(isinstance(reply, NoScriptError) for _, reply in failed):
                try:
                    await self.redis.script_load(self.script_source)  # Redis restarted: it forgot the script
                    continue
                except RedisError:
                    pass
            await window.wait()

    async def _round_trip(self, commands: list[bytes]) -> list:
        """One write of all the commands on one pooled connection, then their replies in
        order (an error reply as its exception, in its place)."""
        pool = self.redis.connection_pool
        conn = await pool.get_connection()
        try:
            self.round_trips += 1
            await conn.send_packed_command(b"".join(commands))
            replies = []
            for _ in commands:
                try:
                    replies.append(await conn.read_response())
                except ResponseError as exc:  # a reply like any other: the stream stays in step
                    replies.append(exc)
            return replies
        except BaseException:
            await conn.disconnect()  # broken mid-exchange: its stream may be out of step
            raise
        finally:
            await pool.release(conn)
