"""Orchestrator settings A/B on one stack, by turns: `python -m benchmarks.ab_probe`.

On a shared machine whose speed drifts by 10–30 % within minutes, two settings compare
fairly only side by side. This starts one local stack (Redis, one draft and one target
replica) with one orchestrator per arm, each with its own flags (say `--overlap-min-hit 2`
against the default), and runs the same workload through every arm in turn, the order
reversed every round, so a slow spell weighs on all arms alike. Each line gives a run's
tokens/s, mean γ, share of pre-drafted rounds, and of drafted tokens the share kept and
the share looked up (prompt lookup); the summary, each arm's mean and runs.

An arm may have a target replica of its own (`--arm-target name='[NAME=VALUE ...] FLAGS'`,
read as a soak's `--target-args` are): it runs in a pool of its own that only that arm's
orchestrator uses, so replica settings and environments (an allocator, a batching window)
compare by turns too; the arms without one share the stack's target replica. Only the arm
whose turn it is keeps its replicas busy.

Seeds: (d) and (f) requests are seeded (request i gets seed 1000 + 100000·round + i, so
every round samples its own texts and the arms of a round the same ones); (e) sends none,
as in `make bench`. With a fixed set of seeds the speed of (d) at temperature 1 is that of
a few fixed texts, which is how (d) seemed to beat (e) by 10 % at one stream in every run
(see benchmarks/bench.py).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shlex

from google.protobuf import json_format

from benchmarks.remote import StackClient
from benchmarks.runs import MODES, make_requests, pass_seed_base
from benchmarks.stack_probe import STACK_GAMMA, add_workload_args
from localstack.soak import parse_variant
from localstack.stack import LocalStack
from specdec.models import load_tokenizer
from specdec.v1 import orchestrator_pb2 as pb


def parse_arm(text: str) -> tuple[str, list[str]]:
    """'name=flags' → (name, orchestrator arguments); 'name=' is the defaults."""
    name, sep, flags = text.partition("=")
    if not sep or not name:
        raise SystemExit(f"--arm {text!r}: write name=FLAGS, e.g. off='--overlap-min-hit 2' (or base= for defaults)")
    return name, shlex.split(flags)


def parse_runs(text: str) -> list[tuple[str, int, str]]:
    runs = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        bits = part.split(":")
        if len(bits) != 3 or bits[0] not in MODES or not bits[1].isdigit() or int(bits[1]) < 1 \
                or bits[2] not in STACK_GAMMA:
            raise SystemExit(f"--runs: {part!r} is not mode:streams:system (mode in {', '.join(MODES)}, "
                             f"system in {''.join(STACK_GAMMA)})")
        runs.append((bits[0], int(bits[1]), bits[2]))
    if not runs:
        raise SystemExit("--runs names no run")
    return runs


def parse_fields(texts: list[str]) -> dict[str, pb.GenerateRequest]:
    """'name=JSON' → that arm's request fields, e.g. lp='{"logprobs": true, "top_logprobs": 20}'."""
    fields = {}
    for text in texts:
        name, _, body = text.partition("=")
        try:
            fields[name] = json_format.ParseDict(json.loads(body), pb.GenerateRequest())
        except (ValueError, json_format.ParseError) as exc:
            raise SystemExit(f"--fields {text!r}: write name=JSON of GenerateRequest fields ({exc})") from exc
    return fields


async def alternate(addresses: dict[str, str], prompt_ids, runs, rounds: int, per_stream: int, max_new: int,
                    warm_up: float, fields: dict[str, pb.GenerateRequest] | None = None) -> dict[tuple, list[float]]:
    clients = {name: StackClient(address) for name, address in addresses.items()}
    results: dict[tuple, list[float]] = {}
    try:
        for client in clients.values():
            await client.warm_up(make_requests(prompt_ids, len(prompt_ids)), max_new, warm_up)
        for k in range(rounds):
            order = list(clients) if k % 2 == 0 else list(clients)[::-1]
            for mode, streams, system in runs:
                requests = make_requests(prompt_ids, max(len(prompt_ids), per_stream * streams), pass_seed_base(k))
                for arm in order:
                    run = await clients[arm].run(system, requests, mode, streams, max_new, STACK_GAMMA[system],
                                                 (fields or {}).get(arm))
                    results.setdefault((mode, streams, system, arm), []).append(run.tps)
                    shape = (f" γ {run.drafted / run.rounds:.2f} pre-drafted {run.overlap_hits / run.rounds:.2f}"
                             if run.rounds else "")
                    shape += (f" accepted {run.accepted / run.drafted:.2f} looked up {run.looked_up / run.drafted:.2f}"
                              if run.drafted else "")
                    latency = (f" TTFT p50 {run.ttft_p50:.2f} ms TPOT p50 {run.tpot_p50:.2f} ms"
                               if run.tpot_p50 is not None else "")
                    print(f"round {k + 1} {arm}: {mode} {streams} streams ({system}) {run.tps:.1f} tok/s{latency}{shape}",
                          flush=True)
    finally:
        for client in clients.values():
            await client.close()
    return results


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ab_probe", description=__doc__.split("\n\n")[1])
    ap.add_argument("--arm", action="append", default=[],
                    help="name=ORCHESTRATOR_FLAGS, once per arm (at least two), e.g. --arm base= "
                         "--arm off='--overlap-min-hit 2'")
    ap.add_argument("--fields", action="append", default=[],
                    help="name=JSON: request fields that arm's requests carry besides the workload's, e.g. "
                         "--arm plain= --arm lp= --fields lp='{\"logprobs\": true, \"top_logprobs\": 20}'")
    ap.add_argument("--runs", default="t1:1:e", help="mode:streams:system runs per round, comma-separated "
                    "(system d = fixed γ 4, e = adaptive, f = target only; default t1:1:e)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over all arms (default 3)")
    ap.add_argument("--drafts", type=int, default=1,
                    help="draft replicas (default 1; 0: an empty draft pool, say prompt lookup against "
                         "target-only: --arm lookup= --arm off='--prompt-lookup off')")
    ap.add_argument("--draft-flags", default="", help="flags for the draft replica, shared by every arm "
                    "(e.g. '--max-batch 1': an undersized draft pool)")
    ap.add_argument("--target-flags", default="", help="flags for the target replica, shared by every arm")
    ap.add_argument("--arm-target", action="append", default=[], metavar="NAME='[NAME=VALUE ...] [FLAGS ...]'",
                    help="that arm's own target replica, with these environment variables and flags (in a pool "
                    "of its own), e.g. --arm glibc= --arm je= --arm-target "
                    "je='LD_PRELOAD=/lib/x86_64-linux-gnu/libjemalloc.so.2'")
    ap.add_argument("--join", type=int, default=1,
                    help="held-out prompts joined into each prompt (default 1; 10 makes prompts of 300-450 "
                         "tokens, longer than --prefill-chunk's default 256)")
    add_workload_args(ap, warm_up=3.0)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    arms = [parse_arm(a) for a in args.arm]
    if len(arms) < 2 or len({name for name, _ in arms}) != len(arms):
        raise SystemExit("give at least two --arm name=FLAGS, with different names")
    runs = parse_runs(args.runs)
    fields = parse_fields(args.fields)
    try:
        own = {name: parse_variant(text) for name, _, text in (a.partition("=") for a in args.arm_target)}
    except ValueError as exc:
        raise SystemExit(f"--arm-target {exc}") from None
    for flag, named in (("--fields", fields), ("--arm-target", own)):
        unknown = set(named) - {name for name, _ in arms}
        if unknown:
            raise SystemExit(f"{flag} names arms that are not given with --arm: {', '.join(sorted(unknown))}")
    if min(args.rounds, args.prompts, args.per_stream, args.max_new_tokens, args.join) < 1:
        raise SystemExit("--rounds, --prompts, --per-stream, --max-new-tokens and --join must be at least 1")
    if not 0 <= args.drafts <= 4:
        raise SystemExit(f"--drafts must lie in 0..4, got {args.drafts}")
    from training.corpus import heldout_prompts

    tok = load_tokenizer(args.target)
    texts = heldout_prompts(args.prompts + args.join - 1)
    prompt_ids = [tok("\n".join(texts[i : i + args.join]))["input_ids"] for i in range(args.prompts)]
    stack = LocalStack(draft_model=args.draft, target_model=args.target, threads=1)
    try:
        stack.start_redis()
        stack.start_replica("target", wait=False, extra=shlex.split(args.target_flags))
        for name, v in own.items():
            stack.start_replica("target", wait=False, extra=[*shlex.split(args.target_flags), "--pool",
                                                             f"target-{name}", *v.args], env=v.env, label=name)
        for _ in range(args.drafts):
            stack.start_replica("draft", wait=False, extra=shlex.split(args.draft_flags))
        addresses = {name: stack.start_orchestrator(
            wait=False, extra=[*(["--target-pool", f"target-{name}"] if name in own else []), *flags]).address
            for name, flags in arms}
        stack.wait_all(args.drafts, 1 + len(own))
        results = asyncio.run(alternate(addresses, prompt_ids, runs, args.rounds, args.per_stream,
                                        args.max_new_tokens, args.warm_up, fields))
    finally:
        stack.stop()
    print("\n| run | arm | mean tok/s | runs |\n|---|---|---|---|")
    for (mode, streams, system, arm), tps in results.items():
        print(f"| {mode} {streams} streams ({system}) | {arm} | {sum(tps) / len(tps):.1f} | "
              f"{', '.join(f'{x:.1f}' for x in tps)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
