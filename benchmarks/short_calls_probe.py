"""How the adaptive γ policy treats many short answers: `python -m benchmarks.short_calls_probe`.

Starts a local stack (Redis, one draft and one target replica, and an orchestrator with the
given flags) and sends batches of unseeded short calls (`--tokens` each, temperature
`--temperature`) from `--callers` threads, one concurrency per batch. After each batch it
prints from the orchestrator's /metrics how many rounds chose each γ and how many first
rounds pre-drafted the second, and from the answers how many calls drafted at all. A short
answer has a few rounds, so what keeps the policy's estimates current under it is the
process's probes, not a session's own (orchestrator/gamma_policy.py, `ZERO_PROBE_EVERY`).
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import sys
import time

from localstack.stack import LocalStack, free_port, scrape_metrics


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.short_calls_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--callers", default="16,16,16,16,16,16,16,16,4,4",
                    help="concurrent callers of each batch, comma-separated (default: eight batches of 16, two of 4)")
    ap.add_argument("--calls", type=int, default=600, help="calls per batch (default 600)")
    ap.add_argument("--tokens", type=int, default=3, help="max_new_tokens of each call (default 3)")
    ap.add_argument("--temperature", type=float, default=1.0, help="of each call (default 1)")
    ap.add_argument("--prompt", default="def main(", help="of each call")
    ap.add_argument("--orchestrator-args", default="--load-governor off",
                    help="flags of the orchestrator (default: '--load-governor off', so that the γ policy alone decides)")
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        args.concurrency = [int(c) for c in args.callers.split(",")]
    except ValueError:
        ap.error(f"--callers must be comma-separated integers, got {args.callers!r}")
    if not args.concurrency or min(args.concurrency) < 1 or args.calls < 1 or args.tokens < 1:
        ap.error("--callers, --calls and --tokens must be 1 or more")
    return args


def _gamma_counts(now: dict, before: dict) -> dict[str, int]:
    """Rounds by γ chosen between two scrapes (the histogram's buckets are cumulative)."""
    cumulative = {k.split('le="')[1][:-2]: v - before.get(k, 0.0) for k, v in now.items()
                  if k.startswith("specdec_gamma_bucket")}
    out, below = {}, 0.0
    for le, count in sorted(cumulative.items(), key=lambda kv: float(kv[0])):
        if count > below:
            out[le.replace(".0", "").replace("+Inf", ">16")] = int(count - below)
        below = count
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import grpc

    from specdec.v1 import orchestrator_pb2 as pb
    from specdec.v1 import orchestrator_pb2_grpc as pb_grpc

    port = free_port()
    first = 'specdec_overlap_total{outcome="first"}'
    with LocalStack().start() as stack:
        orch = stack.start_orchestrator(extra=[*args.orchestrator_args.split(), "--metrics-port", str(port)])
        stack.wait_registered(1, 1)
        stub = pb_grpc.OrchestratorStub(grpc.insecure_channel(orch.address))
        req = pb.GenerateRequest(prompt=args.prompt, max_new_tokens=args.tokens, ignore_eos=True)
        req.temperature = args.temperature

        def call(_: int) -> int:
            got = stub.Generate(req, timeout=120)
            return got.stats.drafted_tokens

        before = scrape_metrics(port)
        for batch, callers in enumerate(args.concurrency):
            t0 = time.perf_counter()
            with cf.ThreadPoolExecutor(callers) as pool:
                drafted = list(pool.map(call, range(args.calls)))
            seconds = time.perf_counter() - t0
            now = scrape_metrics(port)
            print(f"batch {batch}: {callers} callers, {args.calls} calls in {seconds:.1f} s; "
                  f"{sum(1 for d in drafted if d)} drafted, first rounds pre-drafted "
                  f"{int(now.get(first, 0) - before.get(first, 0))}; rounds by γ {_gamma_counts(now, before)}",
                  flush=True)
            before = now


if __name__ == "__main__":
    sys.exit(main())
