"""One log line per finished public call (`--access-log on`, the default): what an operator
greps for when a user reports a slow or failed request, and what a log collector indexes.

The line names the method, the gRPC status, the call's wall time and the peer, then what the
request asked (its session and request id) and, where it finished, what it did: the tokens of
the prompt and of the answer, the finish reason, the replicas that served it, and the
speculation's rounds, mean γ and acceptance. Under `--log-format json` the same facts are
fields of the record's JSON object (specdec.config.JsonLogFormatter), not only its message.
The logger ("specdec.access") takes its level from the flag alone, so `--log-level WARNING`
quiets the server's other INFO lines and keeps the access lines."""
from __future__ import annotations

import logging
import time

import grpc

from orchestrator.loop_state import Outcome

log = logging.getLogger("specdec.access")


def configure(on: bool) -> None:
    """`--access-log on|off`."""
    log.setLevel(logging.INFO if on else logging.CRITICAL + 1)


def record(method: str, code: grpc.StatusCode, started: float, request, out: Outcome | None,
           peer: str | None, error: str = "") -> None:
    """A call that ended with `code` after starting at `started` (time.perf_counter());
    `request` the message as received (a request that did not parse has no fields to read),
    `out` the generation where it finished."""
    if not log.isEnabledFor(logging.INFO):
        return
    fields = {"method": method, "code": code.name, "ms": round((time.perf_counter() - started) * 1000, 1),
              "peer": peer or "-"}
    session, request_id = getattr(request, "session_id", ""), getattr(request, "request_id", "")
    if out is not None:
        fields.update(_outcome(out))
    elif session:
        fields["session"] = session
    if request_id:
        fields["request_id"] = request_id
    if error:
        fields["error"] = error
    log.info(" ".join(f"{key}={_text(value)}" for key, value in fields.items()), extra={"fields": fields})


def _outcome(out: Outcome) -> dict:
    s = out.stats
    return {"session": out.session_id, "prompt_tokens": out.prompt_tokens, "tokens": len(out.tokens),
            "finish": out.finish_reason, "draft": out.draft_replica or "-", "target": out.target_replica or "-",
            "rounds": s.rounds, "mean_gamma": round(s.gamma_sum / s.rounds, 2) if s.rounds else 0.0,
            "acceptance": round(s.accepted / s.drafted, 3) if s.drafted else 0.0}


def _text(value) -> str:
    """A value as logfmt writes it: quoted where it holds a space, a quote or an equals sign."""
    text = str(value)
    if not text or any(c in text for c in ' "='):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return text
