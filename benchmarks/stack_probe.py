"""How the replicas batch under the bench's load: `python -m benchmarks.stack_probe`.

A quicker, narrower companion of `make bench` for tuning the replicas' batching: one
local stack (Redis, one draft and one target replica with /metrics on, one orchestrator),
and for each configuration (mode:streams) the runs of (f) target-only and (e) adaptive γ
with overlap (or those of --systems, (d) fixed γ = 4 among them), side by side, each with
its mean γ, tokens per round, share of rounds pre-drafted and share of drafted tokens
looked up (prompt lookup), and the replicas' view scraped from Prometheus around the run:
mean sessions per batch, the share of the wall time the engine computed (busy) and the
share it held batches for company (held), and the orchestrator's pre-drafts per round with
the share of them used (from its /metrics). Each run also gives the CPU time of each
process per round (session-round under load: user + system time from /proc, Linux only),
which is steadier than tokens/s on a shared machine whose speed drifts: the cost a change
saves shows there even when the drift swamps the throughput.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import time

from benchmarks.remote import StackClient
from benchmarks.runs import MODES, make_requests
from localstack.stack import LocalStack, free_port, scrape_metrics
from specdec.models import BUNDLED_DRAFT, BUNDLED_TARGET, load_tokenizer

SCRAPED = {f"specdec_{m}_{part}" for m in ("engine_seconds", "batch_size", "batch_hold_seconds")
           for part in ("sum", "count")}


def scrape(port: int) -> dict[str, float]:
    """The batching samples of one replica, summed over their labels."""
    out: dict[str, float] = {}
    for sample, value in scrape_metrics(port).items():
        name = sample.partition("{")[0]
        if name in SCRAPED:
            out[name] = out.get(name, 0.0) + value
    return out


def pool_view(before: dict[str, float], after: dict[str, float], wall: float) -> str:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    batches = d.get("specdec_batch_size_count", 0.0)
    if not batches:
        return "idle"
    return (f"batch {d.get('specdec_batch_size_sum', 0.0) / batches:.1f} "
            f"busy {d.get('specdec_engine_seconds_sum', 0.0) / wall:.2f} "
            f"held {d.get('specdec_batch_hold_seconds_sum', 0.0) / wall:.2f}")


def overlap_counts(port: int | None) -> tuple[float, float]:
    """The orchestrator's pre-draft attempts and hits so far ((0, 0) without its /metrics)."""
    if not port:
        return 0.0, 0.0
    samples = scrape_metrics(port)
    return (samples.get('specdec_overlap_total{outcome="attempt"}', 0.0),
            samples.get('specdec_overlap_total{outcome="hit"}', 0.0))


def mux_counts(port: int | None) -> dict[str, float]:
    """The orchestrator's messages and calls on its multiplexed streams, per pool."""
    if not port:
        return {}
    return {k: v for k, v in scrape_metrics(port).items() if k.startswith(("specdec_mux_messages", "specdec_mux_calls"))}


def mux_view(before: dict[str, float], after: dict[str, float]) -> str:
    """Calls per message on each pool's multiplexed stream ("" when none was used)."""
    parts = []
    for pool in ("draft", "target"):
        d = {kind: after.get(f'specdec_mux_{kind}_total{{pool="{pool}"}}', 0.0)
             - before.get(f'specdec_mux_{kind}_total{{pool="{pool}"}}', 0.0) for kind in ("messages", "calls")}
        if d["messages"]:
            parts.append(f"{pool} {d['calls'] / d['messages']:.2f}")
    return f" | calls/message: {', '.join(parts)}" if parts else ""


def overlap_view(before: tuple[float, float], after: tuple[float, float], rounds: int) -> str:
    """Pre-drafts per round and the share of them used: what a pre-draft costs against what it pays."""
    attempts, hits = after[0] - before[0], after[1] - before[1]
    if not rounds or not attempts:
        return "pre-drafts: none"
    return f"pre-drafts: {attempts / rounds:.2f}/round, {hits / attempts:.2f} used"


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process so far (None off Linux or once it is gone)."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_view(before: dict[str, float | None], after: dict[str, float | None], rounds: int) -> str:
    parts = [f"{name} {1000 * (after[name] - before[name]) / rounds:.2f}" for name in before
             if before[name] is not None and after[name] is not None]
    return f"cpu ms/round: {', '.join(parts)}" if parts and rounds else "cpu: n/a"


def parse_configs(text: str) -> list[tuple[str, int]]:
    configs = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        mode, _, streams = part.partition(":")
        if mode not in MODES or not streams.isdigit() or int(streams) < 1:
            raise SystemExit(f"--configs: {part!r} is not mode:streams with mode in {', '.join(MODES)}")
        configs.append((mode, int(streams)))
    if not configs:
        raise SystemExit("--configs names no configuration")
    return configs


STACK_GAMMA = {"d": 4, "e": None, "f": 0}  # the γ of each distributed system of the bench (None: adaptive)
STACK_GAMMA.update({str(g): g for g in range(1, 9)})  # a digit: (d) at that fixed γ


async def probe(address: str, ports: dict[str, int], prompt_ids, configs, per_stream: int, max_new: int,
                warm_up: float, pids: dict[str, int] | None = None, systems: str = "fe",
                orchestrator_port: int | None = None) -> list[str]:
    client = StackClient(address)
    lines = []
    try:
        await client.warm_up(make_requests(prompt_ids, len(prompt_ids)), max_new, warm_up)
        for mode, streams in configs:
            for system in systems:
                gamma = STACK_GAMMA[system]
                before = {pool: scrape(port) for pool, port in ports.items()}
                cpu_before = {name: cpu_seconds(pid) for name, pid in (pids or {}).items()}
                overlap_before = overlap_counts(orchestrator_port)
                mux_before = mux_counts(orchestrator_port)
                t0 = time.perf_counter()
                run = await client.run(system, make_requests(prompt_ids, max(len(prompt_ids), per_stream * streams)),
                                       mode, streams, max_new, gamma)
                wall = time.perf_counter() - t0
                after = {pool: scrape(port) for pool, port in ports.items()}
                cpu_after = {name: cpu_seconds(pid) for name, pid in (pids or {}).items()}
                views = " | ".join(f"{pool}: {pool_view(before[pool], after[pool], wall)}" for pool in ports)
                if orchestrator_port:
                    views += " | " + overlap_view(overlap_before, overlap_counts(orchestrator_port), run.rounds)
                    views += mux_view(mux_before, mux_counts(orchestrator_port))
                if pids:
                    views += " | " + cpu_view(cpu_before, cpu_after, run.rounds)
                shape = (f"γ {run.drafted / run.rounds:.2f} tok/round {run.tokens / run.rounds:.2f} "
                         f"pre-drafted {run.overlap_hits / run.rounds:.2f} "
                         f"looked up {run.looked_up / max(run.drafted, 1):.2f}") if run.rounds else ""
                lines.append(f"{mode} {streams} streams ({system}) {run.tps:.1f} tok/s {shape} | {views}")
                print(lines[-1], flush=True)
    finally:
        await client.close()
    return lines


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.stack_probe", description=__doc__.split("\n\n")[1])
    ap.add_argument("--configs", default="greedy:16,t1:4,greedy:1",
                    help="mode:streams pairs, comma-separated (default greedy:16,t1:4,greedy:1)")
    ap.add_argument("--systems", default="fe",
                    help="which distributed systems to run per configuration, in order: d (fixed γ = 4), "
                         "e (adaptive γ with overlap), f (target only), or a digit 1-8 ((d) at that fixed γ); "
                         "default fe")
    ap.add_argument("--orchestrator-args", default="",
                    help="extra flags for the orchestrator, e.g. '--internal-calls stream'")
    add_workload_args(ap, warm_up=5.0)
    return ap


def add_workload_args(ap: argparse.ArgumentParser, warm_up: float) -> None:
    """The workload and model options the stack probes share."""
    ap.add_argument("--target-args", default="", help="extra flags for the target replica, e.g. "
                    "'--batch-wait-ms 0'")
    ap.add_argument("--draft-args", default="", help="extra flags for the draft replica")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts (default 8)")
    ap.add_argument("--per-stream", type=int, default=3,
                    help="requests per stream; every prompt runs at least once (default 3, as make bench)")
    ap.add_argument("--max-new-tokens", type=int, default=96, help="tokens per request (default 96)")
    ap.add_argument("--warm-up", type=float, default=warm_up,
                    help=f"seconds of traffic through each orchestrator before measuring (default {warm_up:g})")
    ap.add_argument("--draft", default=str(BUNDLED_DRAFT), help="draft model directory (default: bundled)")
    ap.add_argument("--target", default=str(BUNDLED_TARGET), help="target model directory (default: bundled)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configs = parse_configs(args.configs)
    if not args.systems or set(args.systems) - set(STACK_GAMMA):
        raise SystemExit(f"--systems takes letters of def and digits 1-8, got {args.systems!r}")
    if min(args.prompts, args.per_stream, args.max_new_tokens) < 1:
        raise SystemExit("--prompts, --per-stream and --max-new-tokens must be at least 1")
    from training.corpus import heldout_prompts

    tok = load_tokenizer(args.target)
    prompt_ids = [tok(p)["input_ids"] for p in heldout_prompts(args.prompts)]
    stack = LocalStack(draft_model=args.draft, target_model=args.target, threads=1)
    ports = {"target": free_port(), "draft": free_port()}
    try:
        stack.start_redis()
        pids = {}
        for pool, port in ports.items():
            own = shlex.split(args.target_args if pool == "target" else args.draft_args)
            pids[pool] = stack.start_replica(pool, wait=False, extra=["--metrics-port", str(port), *own]).proc.pid
        orchestrator_port = free_port()
        pids["orchestrator"] = stack.start_orchestrator(
            wait=False, extra=["--metrics-port", str(orchestrator_port), *shlex.split(args.orchestrator_args)]).proc.pid
        stack.wait_all(1, 1)
        asyncio.run(probe(stack.orchestrator_address, ports, prompt_ids, configs, args.per_stream,
                          args.max_new_tokens, args.warm_up, pids, args.systems, orchestrator_port))
    finally:
        stack.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
