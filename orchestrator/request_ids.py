"""Request ids: a retried call continues its first attempt instead of starting again.

A client that lost a call part-way (a cut stream, a deadline, an orchestrator that died)
cannot tell how much of it the server did. Without an id, a retry that names a kept session
appends its prompt a second time after the partial answer, and a retry of a new session
samples a second, different answer. With `request_id`, the session's handle records, in the
same write that appends the prompt, which request it was, where its answer starts and a
fingerprint of the request; a retry carrying the same id finds that record, appends
nothing, and answers with what the earlier attempts committed followed by the rest. A call
that never names a session gets a session id derived from its request id, so that its
retry finds it too, and a second attempt running at the same time is refused (the session's
lease) rather than served twice.

Pure functions over the handle's records: no Redis, no gRPC.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

from specdec.rounds import Ends

MAX_KEPT = 16  # the records a session keeps: retries of older requests are refused
SESSION_PREFIX = "request-"


@dataclass(frozen=True)
class RequestMark:
    """One request on a session: its answer is committed[start:end] (end -1: still the
    session's last request, whose answer runs to the end of the committed tokens)."""
    request_id: str
    fingerprint: str
    start: int
    end: int = -1

    def to_list(self) -> list:
        return [self.request_id, self.fingerprint, self.start, self.end]

    @classmethod
    def from_list(cls, item: list) -> RequestMark:
        rid, fp, start, end = item
        return cls(str(rid), str(fp), int(start), int(end))


def session_for(request_id: str) -> str:
    """The session id of a request that names none: the same for every attempt of it."""
    return SESSION_PREFIX + hashlib.sha256(request_id.encode()).hexdigest()[:40]


def fingerprint(request_bytes: bytes) -> str:
    """What makes two calls the same request: the serialized request without its id."""
    return hashlib.sha256(request_bytes).hexdigest()[:32]


def find(marks: list[RequestMark], request_id: str) -> RequestMark | None:
    return next((m for m in reversed(marks) if m.request_id == request_id), None)


def record(marks: list[RequestMark], request_id: str, fp: str, before: int, start: int) -> list[RequestMark]:
    """The records after a new request's prompt was appended (the committed tokens were
    `before` long, and its answer starts at `start`): the previous last request's answer
    ends where this prompt began, whether or not the new request has an id ("": none,
    nothing recorded of it)."""
    out = list(marks)
    if out and out[-1].end < 0:
        last = out[-1]
        out[-1] = RequestMark(last.request_id, last.fingerprint, last.start, before)
    if request_id:
        out.append(RequestMark(request_id, fp, start))
    return out[-MAX_KEPT:]


def answer(committed: list[int], mark: RequestMark) -> list[int]:
    """The tokens this request's attempts have committed so far."""
    return committed[mark.start:] if mark.end < 0 else committed[mark.start:mark.end]


def finished(tokens: list[int], max_new_tokens: int, ends: Ends, committed_len: int,
             max_len: int) -> str | None:
    """The finish reason of an answer committed so far, judged by its tokens alone (stop
    strings are the text's to judge), or None where it has more to generate."""
    reason = ends.reason(tokens[-1]) if tokens else None
    if reason is not None:
        return reason
    if len(tokens) >= max_new_tokens:
        return "length"
    if committed_len >= max_len:
        return "context"
    return None
