"""python -m localstack {run,demo,loadtest,soak}: the local stack on the bundled models."""
from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time

from localstack.stack import LocalStack


def _stack(args) -> LocalStack:
    kw = {}
    if args.draft_model:
        kw["draft_model"] = args.draft_model
    if args.target_model:
        kw["target_model"] = args.target_model
    return LocalStack(quiet=not getattr(args, "verbose", False), **kw)


def cmd_run(args) -> int:
    stack = _stack(args)
    stack.quiet = False
    stack.redis_port = args.redis_port
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:  # a process that fails to start stops the others too
        stack.start_redis()
        for _ in range(args.targets):
            stack.start_replica("target", port=args.target_port if args.targets == 1 else 0, wait=False)
        for _ in range(args.drafts):
            stack.start_replica("draft", port=args.draft_port if args.drafts == 1 else 0, wait=False)
        stack.start_orchestrator(port=args.port, wait=False,
                                 extra=["--metrics-port", str(args.metrics_port)] if args.metrics_port else [])
        stack.wait_all(args.drafts, args.targets)
        print(f"\nready: orchestrator on 127.0.0.1:{args.port}, Redis on {stack.redis_url}; "
              f"try: .venv/bin/python -m orchestrator.client 'def parse(' --max-new-tokens 64\nCtrl-C stops.",
              flush=True)
        while not stop:
            dead = [r for r in stack.replicas + stack.orchestrators if r.proc.poll() is not None]
            if dead:
                print(f"{dead[0].kind} on port {dead[0].port} exited; stopping", file=sys.stderr)
                return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    except (RuntimeError, TimeoutError) as exc:  # a process that did not come up: its log is above
        print(f"the stack did not start: {exc}", file=sys.stderr)
        return 1
    finally:
        print("stopping the stack", flush=True)
        stack.stop()
    return 0


def cmd_demo(args) -> int:
    from localstack.demo import run_demo

    with _stack(args) as stack:
        print("starting Redis, a draft replica, a target replica and the orchestrator ...", flush=True)
        stack.start()
        return run_demo(stack.orchestrator_address, args.max_new_tokens)


def cmd_loadtest(args) -> int:
    from deploy.loadtest.loadgen import run_load

    with _stack(args) as stack:
        stack.start()
        summary = run_load(target=stack.orchestrator_address, concurrency=args.concurrency,
                           duration=args.duration, max_new_tokens=args.max_new_tokens, stream=True)
        return 0 if not summary.get("errors") else 1


def cmd_soak(args) -> int:
    from localstack.soak import parse_variant, passed, soak, stack_env

    try:
        variants = [parse_variant(text) for text in args.target_args or ()]
    except ValueError as exc:
        raise SystemExit(f"python -m localstack soak: error: --target-args {exc}")
    if variants and args.chaos is not None:
        raise SystemExit("python -m localstack soak: error: --target-args and --chaos do not go together "
                         "(a replica started in a stopped one's place would not know its variant)")
    if args.chaos is not None and args.chaos <= 0:
        raise SystemExit(f"python -m localstack soak: error: --chaos must be a number of seconds above 0, got {args.chaos}")
    if args.chaos_orchestrators and args.chaos is None:
        raise SystemExit("python -m localstack soak: error: --chaos-orchestrators needs --chaos SECONDS")
    with _stack(args) as stack:
        pool = 2 if args.chaos else 1  # a replica stopped leaves the other of its pool
        stack.extra_env.update(stack_env(args.chaos_signal, args.chaos_orchestrators, bool(variants)))
        stack.start(drafts=pool, targets=pool, orchestrators=2 if args.chaos_orchestrators else 1,
                    target_variants=variants, metrics=True)
        report = asyncio.run(soak(stack, args.streams, args.minutes * 60, args.max_new_tokens,
                                  chaos=args.chaos, chaos_signal=args.chaos_signal,
                                  chaos_orchestrators=args.chaos_orchestrators))
        return 0 if passed(report) else 1


def _count(least: int):
    """An argparse type: a whole number of replicas, at least `least`."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = least - 1
        if n < least:
            raise argparse.ArgumentTypeError(f"expected a whole number >= {least}, got {text!r}")
        return n
    return parse


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m localstack", description=__doc__)
    ap.add_argument("--draft-model", help="draft model directory (default: bundled)")
    ap.add_argument("--target-model", help="target model directory (default: bundled)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="Redis, one draft, one target and the orchestrator in the foreground")
    run.add_argument("--port", type=int, default=50051, help="the orchestrator's public gRPC port (default 50051)")
    run.add_argument("--draft-port", type=int, default=50061,
                     help="the draft replica's port (default 50061; with --drafts above 1 each takes a free port)")
    run.add_argument("--target-port", type=int, default=50071,
                     help="the target replica's port (default 50071; with --targets above 1 each takes a free port)")
    run.add_argument("--redis-port", type=int, default=6379, help="the stack's own redis-server (default 6379)")
    run.add_argument("--metrics-port", type=int, default=9100,
                     help="the orchestrator's Prometheus port (default 9100; 0: none)")
    run.add_argument("--drafts", type=_count(0), default=1,
                     help="draft replicas (default 1; 0: target-only rounds and prompt lookup's drafts)")
    run.add_argument("--targets", type=_count(1), default=1, help="target replicas (default 1)")
    demo = sub.add_parser("demo", help="stream a few completions with stats and the speedup over target-only")
    demo.add_argument("--max-new-tokens", type=int, default=96, help="new tokens a completion asks for (default 96)")
    lt = sub.add_parser("loadtest", help="the Python load generator against a fresh local stack")
    lt.add_argument("--concurrency", type=int, default=4, help="calls in flight at once (default 4)")
    lt.add_argument("--duration", type=float, default=20.0, help="seconds of load (default 20)")
    lt.add_argument("--max-new-tokens", type=int, default=32, help="new tokens a call asks for (default 32)")
    so = sub.add_parser("soak", help="N concurrent clients for M minutes through a mix of requests; errors, "
                        "latency, memory, repeated outputs, sessions left over (exits 1 on any fault)")
    so.add_argument("--streams", type=int, default=8, help="concurrent clients, one request at a time each (default 8)")
    so.add_argument("--minutes", type=float, default=10.0, help="how long the clients keep sending (default 10)")
    so.add_argument("--max-new-tokens", type=int, default=64, help="new tokens a request asks for (default 64)")
    so.add_argument("--chaos", type=float, metavar="SECONDS",
                    help="stop a replica every SECONDS (the pools in turn) and start another in its place; "
                    "the stack then has two replicas a pool")
    so.add_argument("--chaos-signal", choices=("kill", "term", "both"), default="kill",
                    help="how a replica is stopped: kill = SIGKILL (a crash), term = SIGTERM (a graceful drain), "
                    "both = the two by turns")
    so.add_argument("--chaos-orchestrators", action="store_true",
                    help="with --chaos: run two orchestrators and stop one in turn with the pools, with "
                    "--chaos-signal (term: a rolling update; kill: a crash, their session lease then 2 s; both); the "
                    "clients send each call to the next orchestrator running, a call refused by one shutting down "
                    "to another, as a load balancer would, and a call cut by one killed again with its request id")
    so.add_argument("--target-args", action="append", metavar="'[NAME=VALUE ...] [FLAGS ...]'",
                    help="one target replica with these environment variables and flags (as a shell reads "
                    "them; '' for the defaults); repeat it for a pool of variants compared side by side under "
                    "the one load, each one's memory and share of the work in the report, e.g. "
                    "--target-args '' --target-args '--heap-trim-seconds 0' --target-args 'MALLOC_ARENA_MAX=2'")
    for p in (demo, lt, so):  # run always shows them
        p.add_argument("--verbose", action="store_true", help="show the servers' logs")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return {"run": cmd_run, "demo": cmd_demo, "loadtest": cmd_loadtest, "soak": cmd_soak}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
