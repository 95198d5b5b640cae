"""Command-line client: prompt in, streamed text out, stats at the end.

    python -m orchestrator.client "def fibonacci(n):" --max-new-tokens 64
    python -m orchestrator.client "class Stack:" --keep-session      # prints the session id
    python -m orchestrator.client "    def push(self, x):" --session-id ID
    python -m orchestrator.client --end-session ID                    # release its caches
    echo "def main(" | python -m orchestrator.client - --json         # one JSON object, for scripts

    python -m orchestrator.client "def main(" --retries 5             # rides out an orchestrator's death

The text goes to standard output, the stats and the session to standard error. A call that
fails prints its gRPC status and message and exits 1; Ctrl-C cancels the call and exits 130.
With --retries, a call that failed UNAVAILABLE, CANCELLED or ABORTED (its orchestrator gone
or stopping, or its session still held by the attempt that was cut) is sent again with the
same request id, which continues the answer: the text already shown is not shown again.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
import uuid

import grpc
from google.protobuf import json_format

from specdec.grpc_server import channel_credentials
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc as pb_grpc


def build_request(args: argparse.Namespace) -> pb.GenerateRequest:
    req = pb.GenerateRequest(prompt=args.prompt, max_new_tokens=args.max_new_tokens, top_k=args.top_k,
                             stop=args.stop or [], session_id=args.session_id or "", keep_session=args.keep_session,
                             request_id=args.request_id or "",
                             logprobs=args.logprobs or (bool(args.top_logprobs) or args.processed_logprobs)
                             and not args.prompt_logprobs,
                             top_logprobs=args.top_logprobs, prompt_logprobs=args.prompt_logprobs,
                             min_p=args.min_p, stop_token_ids=args.stop_token_id or [], ignore_eos=args.ignore_eos,
                             processed_logprobs=args.processed_logprobs, presence_penalty=args.presence_penalty,
                             frequency_penalty=args.frequency_penalty, min_tokens=args.min_tokens,
                             logit_bias=dict(args.logit_bias or []))
    req.temperature = args.temperature
    if args.top_p is not None:
        req.top_p = args.top_p
    if args.repetition_penalty is not None:
        req.repetition_penalty = args.repetition_penalty
    if args.seed is not None:
        req.seed = args.seed
    if args.gamma is not None:
        req.num_speculative_tokens = args.gamma
    if args.prompt_lookup is not None:
        req.prompt_lookup = args.prompt_lookup == "on"
    for role, content in args.message or []:
        req.messages.add(role=role, content=content)
    return req


def token_bias(text: str) -> tuple[int, float]:
    """ID=BIAS, as --logit-bias takes it."""
    token, sep, bias = text.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS (say 50256=-100), got {text!r}") from None


def chat_message(text: str) -> tuple[str, str]:
    """ROLE:TEXT, as --message takes it: the role up to the first colon, the text after it."""
    role, sep, content = text.partition(":")
    if not sep or not role.strip():
        raise argparse.ArgumentTypeError(f"expected ROLE:TEXT (say user:Hello), got {text!r}")
    return role.strip(), content


def format_stats(s: pb.GenerationStats) -> str:
    t = s.times
    lookup = (f"{s.lookup_drafted_tokens} of {s.drafted_tokens} drafted by prompt lookup, "
              if s.lookup_drafted_tokens else "")
    return (f"[{s.generated_tokens} tokens in {t.total_ms:.0f} ms = {1000 * s.generated_tokens / max(t.total_ms, 1e-9):.1f} tok/s, "
            f"first after {t.first_token_ms:.0f} ms; "
            f"rounds {s.rounds}, mean γ {s.mean_gamma:.2f}, acceptance {s.acceptance_rate:.2f}, {lookup}"
            f"{s.tokens_per_target_pass:.2f} tokens/target pass; draft {t.draft_ms:.0f} ms, verify {t.verify_ms:.0f} ms, "
            f"network {t.network_ms:.0f} ms, redis {t.redis_ms:.0f} ms; seed {s.seed}]")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m orchestrator.client", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompt", nargs="?", help="prompt text ('-' reads standard input); with --session-id it "
                    "continues the session and may be empty")
    ap.add_argument("--message", type=chat_message, action="append", metavar="ROLE:TEXT",
                    help="a turn of a conversation, in place of the prompt (repeatable, in order, e.g. "
                         "--message 'system:Answer briefly.' --message 'user:What is 2 + 2?'): rendered by the "
                         "model's chat template, with the opening of the assistant's turn after the last")
    ap.add_argument("--address", default="127.0.0.1:50051", help="the orchestrator, host:port (default %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="default %(default)s")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-k", type=int, default=0, help="keep the k likeliest tokens; 0 = all (default)")
    ap.add_argument("--top-p", type=float, help="keep the likeliest tokens up to this mass, in (0, 1]; unset = all")
    ap.add_argument("--min-p", type=float, default=0.0, help="keep the tokens at least this fraction as likely "
                    "as the likeliest, in [0, 1]; 0 = all (default)")
    ap.add_argument("--repetition-penalty", type=float, help="divide the logits of tokens already in the context "
                    "by this (multiply where negative), in (0, 10]; unset = 1, off")
    ap.add_argument("--presence-penalty", type=float, default=0.0, help="lower the logits of tokens already in the "
                    "answer by this, in [-2, 2] (default 0)")
    ap.add_argument("--frequency-penalty", type=float, default=0.0, help="lower them by this per occurrence, in "
                    "[-2, 2] (default 0)")
    ap.add_argument("--logit-bias", type=token_bias, action="append", metavar="ID=BIAS",
                    help="add BIAS, in [-100, 100], to token ID's logit (repeatable; -100 all but bans it)")
    ap.add_argument("--min-tokens", type=int, default=0, help="EOS and stop tokens cannot end the answer before "
                    "this many tokens (default 0)")
    ap.add_argument("--seed", type=int, help="the sampling seed: the same request and seed give the same "
                    "tokens; unset = a random one, printed with the stats")
    ap.add_argument("--gamma", type=int, help="speculation length; unset = adaptive, 0 = target only")
    ap.add_argument("--prompt-lookup", choices=("on", "off"),
                    help="on: rounds may draft by prompt lookup, a sampled request's too (pays where the answer "
                         "repeats its context); off: never; unset = the server's --prompt-lookup")
    ap.add_argument("--stop", action="append", help="stop before this string (repeatable)")
    ap.add_argument("--stop-token-id", type=int, action="append", metavar="ID",
                    help="also end the answer after this token id (repeatable; kept in the answer, as EOS is)")
    ap.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sequence token (to generate "
                    "exactly --max-new-tokens, as a load test may want)")
    ap.add_argument("--session-id", help="continue this session (kept by an earlier call)")
    ap.add_argument("--keep-session", action="store_true", help="keep the session for a later call")
    ap.add_argument("--request-id", help="makes a retry safe: the same command with the same id continues (or "
                                         "repeats) the answer of an earlier attempt instead of starting again")
    ap.add_argument("--retries", type=int, default=0,
                    help="send a call that failed UNAVAILABLE, CANCELLED or ABORTED again, up to this many times, "
                         "with its request id (a new one unless --request-id gives it): the answer goes on where "
                         "the failed attempt stopped (default 0)")
    ap.add_argument("--logprobs", action="store_true", help="ask for each new token's log-probability under the "
                    "target (in the --json response; streamed, their sum and perplexity follow the stats)")
    ap.add_argument("--prompt-logprobs", action="store_true", help="ask for the prompt tokens' log-probabilities "
                    "too (each given what comes before it)")
    ap.add_argument("--processed-logprobs", action="store_true", help="log-probabilities of the law the tokens "
                    "are drawn from (after bias, min-tokens, penalties, temperature, top-k, top-p, min-p), not the raw one (implies --logprobs "
                    "unless --prompt-logprobs)")
    ap.add_argument("--top-logprobs", type=int, default=0, metavar="K",
                    help="with them, the K (0..20) most likely tokens at each position (implies --logprobs "
                         "unless --prompt-logprobs is given)")
    ap.add_argument("--end-session", metavar="ID", help="end this kept session, releasing its caches, and exit "
                    "(no prompt)")
    ap.add_argument("--json", action="store_true", help="print the whole response as one JSON object when it "
                    "is done, instead of streaming the text")
    ap.add_argument("--ca-file", help="CA certificate: connect with TLS")
    ap.add_argument("--token", default=os.environ.get("SPECDEC_API_TOKEN"),
                    help="bearer token for the API (default: $SPECDEC_API_TOKEN, which keeps it out of the "
                    "shell's history)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds for the whole call (default %(default)s)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.end_session is not None and args.prompt is not None:
        ap.error("--end-session takes no prompt")
    if args.message and (args.prompt is not None or args.end_session is not None or args.session_id):
        ap.error("--message takes no prompt, --end-session or --session-id: the messages are the whole conversation")
    if args.end_session is None and args.prompt is None and not args.message:
        ap.error("give a prompt ('-' reads standard input), --message ROLE:TEXT, or --end-session ID")
    if not 0 <= args.top_logprobs <= 20:
        ap.error(f"--top-logprobs must lie in 0..20, got {args.top_logprobs}")
    if args.retries < 0:
        ap.error(f"--retries must be 0 or more, got {args.retries}")
    if not 0 < args.timeout < float("inf"):
        ap.error(f"--timeout must be a finite number of seconds above 0, got {args.timeout}")
    if args.prompt == "-":
        args.prompt = sys.stdin.read()
    if args.retries and not args.request_id:
        args.request_id = uuid.uuid4().hex
    try:
        creds = channel_credentials(args.ca_file)
    except (ValueError, OSError) as exc:  # no such file, or no PEM certificate in it
        ap.error(f"--ca-file: {exc}")
    channel = grpc.secure_channel(args.address, creds) if creds else grpc.insecure_channel(args.address)
    stub = pb_grpc.OrchestratorStub(channel)
    metadata = [("authorization", f"Bearer {args.token}")] if args.token else None
    try:
        if args.end_session is not None:
            stub.EndSession(pb.EndSessionRequest(session_id=args.end_session), timeout=args.timeout, metadata=metadata)
            print(f"session {args.end_session} ended", file=sys.stderr)
        elif args.json:
            reply = retrying(lambda _: stub.Generate(build_request(args), timeout=args.timeout, metadata=metadata),
                             args.retries)
            print(json.dumps(json_format.MessageToDict(reply, preserving_proto_field_name=True), ensure_ascii=False))
        else:
            shown = Shown()
            retrying(lambda _: stream(stub, build_request(args), args.timeout, metadata, shown), args.retries)
    except grpc.RpcError as exc:
        print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the call is cancelled as its iterator goes away
        print("\ncancelled", file=sys.stderr)
        return 130
    finally:
        channel.close()
    return 0


RETRIED = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED}
MAX_WAIT_S = 30.0  # the longest pause before a retry


def retrying(call, retries: int):
    """call(attempt) until it returns, sending it again after a failure in RETRIED up to
    `retries` times: after a backoff, or, where the session is still held by the attempt
    that was cut, once the server says it is free."""
    for attempt in range(retries + 1):
        try:
            return call(attempt)
        except grpc.RpcError as exc:
            if attempt == retries or exc.code() not in RETRIED:
                raise
            free = re.search(r"free within (\d+) s", exc.details() or "")
            wait = float(free.group(1)) + 0.2 if free else 0.5 * 2 ** attempt
            print(f"\n[{exc.code().name}: {exc.details()}; sending it again in {min(wait, MAX_WAIT_S):.1f} s]",
                  file=sys.stderr)
            time.sleep(min(wait, MAX_WAIT_S))


class Shown:
    """The text already written, over every attempt of a call: a retry's answer begins
    with what the cut attempt committed, and only what lies past it is written."""

    def __init__(self) -> None:
        self.chars = 0

    def write(self, answer_so_far: str) -> None:
        if len(answer_so_far) > self.chars:
            sys.stdout.write(answer_so_far[self.chars:])
            sys.stdout.flush()
            self.chars = len(answer_so_far)


def format_logprobs(logprobs: list[float], what: str = "logprobs") -> str:
    total = sum(logprobs)
    mean = total / len(logprobs) if logprobs else 0.0
    return f"{what} of {len(logprobs)} tokens: sum {total:.3f}, mean {mean:.3f}, perplexity {math.exp(-mean):.3f}"


def stream(stub, req: pb.GenerateRequest, timeout: float, metadata, shown: Shown) -> None:
    answer, logprobs = "", []
    for chunk in stub.GenerateStream(req, timeout=timeout, metadata=metadata):
        if chunk.text:
            answer += chunk.text
            shown.write(answer)
        logprobs.extend(item.logprob for item in chunk.logprobs)
        if chunk.HasField("stats"):
            print(f"\n{format_stats(chunk.stats)}\nsession {chunk.session_id}, finish "
                  f"{pb.FinishReason.Name(chunk.finish_reason)}", file=sys.stderr)
            if req.prompt_logprobs:
                print(format_logprobs([item.logprob for item in chunk.prompt_logprobs], "prompt logprobs"),
                      file=sys.stderr)
            if req.logprobs:
                print(format_logprobs(logprobs), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
