"""Errors the engines raise; each maps to one gRPC status in the servers' shells."""
from __future__ import annotations


class SpecDecError(Exception):
    """Base: the message is meant for a person."""


class InvalidRequest(SpecDecError):
    """Malformed or out-of-range arguments (INVALID_ARGUMENT)."""


class SessionNotFound(SpecDecError):
    """The session id is unknown (NOT_FOUND)."""


class CacheMismatch(SpecDecError):
    """The call expects a cache state this replica does not hold: stale, duplicated or
    retried call, or an evicted session (FAILED_PRECONDITION). The caller re-syncs."""


class RequestSuperseded(SpecDecError):
    """A retry of a request cut short whose session has since gone on to another request:
    its answer cannot grow any more (FAILED_PRECONDITION)."""


class PreconditionFailed(SpecDecError):
    """The system is not in the state the request needs, and sending it again as it is
    will not help (FAILED_PRECONDITION): a replica from before a feature the request uses,
    mid-upgrade; a retry's stored log-probabilities expired."""


class Overloaded(SpecDecError):
    """Capacity is exhausted (RESOURCE_EXHAUSTED)."""


class SessionBusy(SpecDecError):
    """Another call holds the session, or took it over from this one after this call's
    lease lapsed (ABORTED: a conflict between calls, to be retried once the other ends)."""


class Unavailable(SpecDecError):
    """A dependency (a pool, Redis) cannot be reached (UNAVAILABLE)."""


class DeadlineExceeded(SpecDecError):
    """The client's deadline passed before the work was done (DEADLINE_EXCEEDED)."""


def value_or_raise(result):
    """An engine's result for one job: the value, or its refusal raised. Raised here, not in
    the caller, and unbound as it leaves: a caller that held the refusal in a local while
    raising it made a reference cycle (the error's traceback holds the caller's frame, and
    the frame the error) that kept the frame's request and job (a verification's draft
    distributions) alive until the cyclic collector ran."""
    if isinstance(result, Exception):
        try:
            raise result
        finally:
            del result
    return result
