"""Command-line client: prompt in, streamed text out, stats at the end.

    python -m orchestrator.client "def fibonacci(n):" --max-new-tokens 64
"""
from __future__ import annotations

import argparse
import sys

import grpc

from specdec.grpc_server import channel_credentials
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc as pb_grpc


def build_request(args: argparse.Namespace) -> pb.GenerateRequest:
    req = pb.GenerateRequest(prompt=args.prompt, max_new_tokens=args.max_new_tokens, top_k=args.top_k,
                             stop=args.stop or [], session_id=args.session_id or "", keep_session=args.keep_session)
    req.temperature = args.temperature
    if args.top_p is not None:
        req.top_p = args.top_p
    if args.seed is not None:
        req.seed = args.seed
    if args.gamma is not None:
        req.num_speculative_tokens = args.gamma
    return req


def format_stats(s: pb.GenerationStats) -> str:
    t = s.times
    return (f"[{s.generated_tokens} tokens in {t.total_ms:.0f} ms = {1000 * s.generated_tokens / max(t.total_ms, 1e-9):.1f} tok/s, "
            f"first after {t.first_token_ms:.0f} ms; "
            f"rounds {s.rounds}, mean γ {s.mean_gamma:.2f}, acceptance {s.acceptance_rate:.2f}, "
            f"{s.tokens_per_target_pass:.2f} tokens/target pass; draft {t.draft_ms:.0f} ms, verify {t.verify_ms:.0f} ms, "
            f"network {t.network_ms:.0f} ms, redis {t.redis_ms:.0f} ms; seed {s.seed}]")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m orchestrator.client", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("prompt", help="prompt text ('-' reads standard input)")
    ap.add_argument("--address", default="127.0.0.1:50051")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--gamma", type=int, help="speculation length; unset = adaptive, 0 = target only")
    ap.add_argument("--stop", action="append", help="stop string (repeatable)")
    ap.add_argument("--session-id", help="continue this session")
    ap.add_argument("--keep-session", action="store_true", help="keep the session for a later call")
    ap.add_argument("--ca-file", help="CA certificate: connect with TLS")
    ap.add_argument("--token", help="bearer token for the API")
    ap.add_argument("--timeout", type=float, default=120.0)
    args = ap.parse_args(argv)
    if args.prompt == "-":
        args.prompt = sys.stdin.read()
    creds = channel_credentials(args.ca_file)
    channel = grpc.secure_channel(args.address, creds) if creds else grpc.insecure_channel(args.address)
    stub = pb_grpc.OrchestratorStub(channel)
    metadata = [("authorization", f"Bearer {args.token}")] if args.token else None
    try:
        for chunk in stub.GenerateStream(build_request(args), timeout=args.timeout, metadata=metadata):
            if chunk.text:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
            if chunk.HasField("stats"):
                print(f"\n{format_stats(chunk.stats)}\nsession {chunk.session_id}, finish "
                      f"{pb.FinishReason.Name(chunk.finish_reason)}", file=sys.stderr)
    except grpc.RpcError as exc:
        print(f"\nerror: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
