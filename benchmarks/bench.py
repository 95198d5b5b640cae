"""The side-by-side benchmark of issue 4: `python -m benchmarks.bench` (`make bench`).

One run over held-out prompts (training.corpus.heldout_prompts), greedy and temperature 1:

  (a) HF generate(), target alone, in-process (left-padded batches of c at concurrency c)
  (b) HF assisted generation with the draft, in-process, γ fixed, one stream
  (c) our in-process speculative loop (specdec.spec_loop.generate), γ fixed, one stream
  (d) the distributed pipeline through the public gRPC API, num_speculative_tokens = γ
  (e) the same with the adaptive policy (num_speculative_tokens unset)
  (f) the same, target only (num_speculative_tokens = 0)

(d)–(f) run against one LocalStack (real redis-server, one draft and one target replica,
one orchestrator, as subprocesses) started once, at each concurrency c with c concurrent
streams (f, d, e; on odd passes e, d, f); then a γ sweep of (d) at one stream, every γ
and a target-only run together in one block. At concurrency c a run has
max(prompts, per_stream·c) requests cycling over the prompts, and a run of (c)–(f) at
least --min-requests (default 16: 8 requests through the stack last about 2 s, which one
slow spell moves by 10 %; 12 requests at 4 streams about 1.3 s) (--per-stream, default 3: with
one request per stream, a 16-stream run is mostly its ramp — every stream prefilling at
once, then a tail with fewer streams left — rather than 16 streams kept busy). Request i
of pass k carries seed 1000 + 100000·k + i in every system but (e), so (c) and (d) must
agree token for token; each pass draws its own sample paths, because at temperature 1 the
speed of (c) and (d) depends on the texts their seeds sample (measured: with the same 8
seeds in every run, (d) at one stream beat (e) by about 10 % in every run, and with 24
requests (e), (d) seeded and (d) unseeded were within 1.5 % of each other);
(e) sends no seed (benchmarks/remote.py), so that at temperature 1 too it runs the
load-adaptive policy that unseeded requests get.

All of that is measured --repeats times (default 2), the in-process part first on even
passes and the distributed part first on odd ones, and each run's passes are pooled
(tokens and wall times add up): a shared machine's speed drifts by 10–20 % over minutes,
and interleaving lets the drift weigh on every system alike instead of on whichever ran
during a slow spell.

How each number is computed:
- tokens/s, time per output token, acceptance rate, α, accepted length, tokens per target
  pass, stage times: see benchmarks/runs.py;
- step costs, the analytic bound and the speedup bound: benchmarks/costs.py. The bound of
  (a) and (f) is plain decoding; (b) uses the α measured by (c) (same pair, γ, prompts);
  (e) uses the α measured by (d) in the same mode and concurrency, with its own mean γ;
  efficiency = measured tokens/s / bound tokens/s;
- bytes on the wire per round: benchmarks/wire_meter.py (exact protobuf sizes of the
  internal messages, measured on the in-process run (c); other γ estimated, marked ≈);
- where (b) and (c) differ by design, see benchmarks/inprocess.py.

All model forwards in this process use --threads torch threads (default 1), as each
replica of the stack does (LocalStack threads=1): the in-process systems use one core,
the distributed ones one core for the draft and one for the target.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks import report
from benchmarks.costs import Costs, measure_costs
from benchmarks.inprocess import build_engines, measure_wire, quiet_transformers, run_hf, run_spec_loop
from benchmarks.remote import StackClient
from benchmarks.runs import MODE_TITLES, MODES, SYSTEMS, RunResult, make_requests, merge, pass_seed_base
from specdec.model_runner import ModelRunner
from specdec.models import (BUNDLED_DRAFT, BUNDLED_TARGET, DTYPE_NAMES, dtype_name, load_model, load_tokenizer,
                             pick_device, pick_dtype)
from specdec.quantize import CHOICES as QUANTIZE_CHOICES, resolve as resolve_quantize

HERE = Path(__file__).resolve().parent
FULL = {"prompts": 8, "max_new_tokens": 96, "concurrency": "1,4,16", "gammas": "1,2,4,6,8", "cost_reps": 10,
        "repeats": 2, "warm_up": 5.0, "load_warm_up": 6.0, "per_stream": 3, "min_requests": 16}
QUICK = {"prompts": 2, "max_new_tokens": 16, "concurrency": "1,2", "gammas": "2,4", "cost_reps": 3, "repeats": 1, "warm_up": 0.0,
         "load_warm_up": 0.0, "per_stream": 1, "min_requests": 0}


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, help=f"held-out prompts (default {FULL['prompts']})")
    ap.add_argument("--max-new-tokens", type=int, help=f"new tokens per request (default {FULL['max_new_tokens']})")
    ap.add_argument("--concurrency", help=f"comma-separated stream counts (default {FULL['concurrency']})")
    ap.add_argument("--gammas", help=f"γ sweep of (d) at one stream (default {FULL['gammas']})")
    ap.add_argument("--gamma", type=int, default=4, help="the fixed γ of (b), (c) and (d) (default 4)")
    ap.add_argument("--modes", default="greedy,t1", help="greedy and/or t1 (temperature 1) (default both)")
    ap.add_argument("--quick", action="store_true",
                    help=f"smoke run: {QUICK['prompts']} prompts, {QUICK['max_new_tokens']} tokens, concurrency "
                         f"{QUICK['concurrency']}, γ sweep {QUICK['gammas']} (explicit options still win)")
    ap.add_argument("--out", type=Path, default=HERE / "RESULTS.md", help="the report (default benchmarks/RESULTS.md)")
    ap.add_argument("--plot", type=Path, help="the PNG (default: beside --out, speedup.png for RESULTS.md and "
                                              "speedup-X.png for RESULTS-X.md)")
    ap.add_argument("--draft", default=str(BUNDLED_DRAFT), help="draft model directory (default: the bundled draft)")
    ap.add_argument("--target", default=str(BUNDLED_TARGET), help="target model directory (default: the bundled target)")
    ap.add_argument("--device", default="auto", help="auto|cpu|cuda, here and in the stack's replicas")
    ap.add_argument("--dtype", default="auto", choices=DTYPE_NAMES,
                    help="the target's dtype (auto: fp32 on a CPU, bf16 on a GPU; float32|bfloat16|float16), "
                         "in every system, in process and in the stack's replicas")
    ap.add_argument("--draft-dtype", choices=DTYPE_NAMES, help="the draft's dtype, likewise (default: --dtype)")
    ap.add_argument("--draft-quantize", choices=QUANTIZE_CHOICES, default="auto",
                    help="the draft's weights in every system, as the draft replica's --quantize (auto: w8a8 or int8 for "
                         "a float32 draft on a CPU with the native kernels, else none; default auto)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads in this process (default 1)")
    ap.add_argument("--server-threads", type=int, default=1, help="torch threads per replica (default 1)")
    ap.add_argument("--cost-reps", type=int, help="repetitions per timed forward (default 10)")
    ap.add_argument("--warm-up", type=float,
                    help=f"seconds of traffic through the stack before each pass's distributed runs "
                         f"(default {FULL['warm_up']:.0f})")
    ap.add_argument("--load-warm-up", type=float,
                    help=f"seconds of adaptive traffic at each concurrency above 1 before that concurrency's "
                         f"distributed runs, in each pass: the γ policy and the load governor learn per load "
                         f"(default {FULL['load_warm_up']:.0f})")
    ap.add_argument("--per-stream", type=int,
                    help=f"requests per stream at concurrency c: a run has max(prompts, per_stream × c) requests, "
                         f"so that the streams stay busy past the ramp (default {FULL['per_stream']})")
    ap.add_argument("--min-requests", type=int,
                    help=f"requests in each run of (c)–(f) and of the γ sweep, at least (a one-stream run of 8 "
                         f"requests lasts about 2 s through the stack, and a single slow spell moves it by 10 %%; "
                         f"(a) and (b), 5× slower, keep the count above) (default {FULL['min_requests']})")
    ap.add_argument("--repeats", type=int,
                    help=f"passes over all systems, interleaved so that a slow spell of a shared machine "
                         f"hits every system alike; their results are pooled (default {FULL['repeats']})")
    return ap


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.concurrency = sorted(set(int_list(args.concurrency)) | {1})
    args.gammas = sorted(set(int_list(args.gammas)))
    args.modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        raise SystemExit(f"unknown mode(s) {bad}: choose from {', '.join(MODES)}")
    if args.per_stream < 1:
        raise SystemExit(f"--per-stream must be at least 1, got {args.per_stream}")
    # RESULTS.md → speedup.png, RESULTS-bf16.md → speedup-bf16.png: one run's plot never
    # overwrites another's
    args.plot = args.plot or args.out.with_name(f"speedup{args.out.stem.removeprefix('RESULTS')}.png")
    args.draft_dtype = args.draft_dtype or args.dtype
    return args


def request_count(args: argparse.Namespace, concurrency: int, fast: bool = False) -> int:
    """Requests in a run at this concurrency: every prompt at least once, and enough for
    each stream to stay busy past the ramp (--per-stream); a run of the fast systems,
    (c) to (f), at least --min-requests, whose runs would otherwise last a second or two
    (a 4-stream run of 12 requests took about 1.3 s and swung ±7 % from pass to pass)."""
    n = max(args.prompts, args.per_stream * concurrency)
    return max(n, args.min_requests) if fast else n


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def describe(r: RunResult) -> str:
    alpha = f", α {r.alpha:.2f}" if r.alpha is not None else ""
    gamma = f", γ {r.gamma:.2f}" if r.gamma is not None else ""
    tpot = f" (TPOT {r.tpot_p50:.1f})" if r.tpot_p50 is not None else ""
    return (f"({r.system}) {SYSTEMS[r.system]:<28} {MODE_TITLES[r.mode]:<13} c={r.concurrency:<3}"
            f" {r.tps:8.1f} tok/s, p50 {r.p50:.1f} ms/tok{tpot}{gamma}{alpha}")


# ----------------------------------------------------------------------------- machine
def cpu_isa() -> str:
    """torch's CPU kernel level and the matrix extensions that decide whether bf16 pays
    (benchmarks.dtype_probe): the machines these runs get differ from session to session."""
    try:
        flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    except OSError:
        flags = []
    extras = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    return torch.backends.cpu.get_cpu_capability() + (f" ({', '.join(extras)})" if extras else "")


def machine_info(device: torch.device) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        cpu = fields.get("Model name", cpu).strip()
    except (OSError, subprocess.SubprocessError):
        pass
    info = {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "device": str(device),
            "load": " ".join(f"{x:.1f}" for x in os.getloadavg())}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    info["isa"] = cpu_isa()
    import grpc
    import transformers

    info["versions"] = f"Python {platform.python_version()}, torch {torch.__version__}, " \
                       f"transformers {transformers.__version__}, grpcio {grpc.__version__}"
    return info


def model_summary(model, path: str) -> str:
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    return (f"`{path}`: {cfg.num_hidden_layers} layers × {cfg.hidden_size}, {params / 1e6:.1f} M parameters, "
            f"{dtype_name(next(model.parameters()).dtype)}")


# ----------------------------------------------------------------------------- the phases
def in_process_phase(args, draft_model, target_model, tok, requests_for,
                     with_wire: bool = True) -> tuple[list[RunResult], dict]:
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else (eos if eos is not None else 0)
    draft, target = build_engines(draft_model, target_model, args.draft_quantize)
    runs, wire = [], {}
    for mode in args.modes:
        for c in args.concurrency:
            runs.append(run_hf(target_model, requests_for(c), mode, c, args.max_new_tokens, eos, pad))
            log(describe(runs[-1]))
        runs.append(run_hf(target_model, requests_for(1), mode, 1, args.max_new_tokens, eos, pad,
                           assistant=draft_model, gamma=args.gamma))
        log(describe(runs[-1]))
        runs.append(run_spec_loop(draft, target, requests_for(1, fast=True), mode, args.max_new_tokens, eos, args.gamma))
        log(describe(runs[-1]))
        if with_wire:
            wire[mode] = measure_wire(draft, target, requests_for(1), mode, args.max_new_tokens, eos, args.gamma)
    return runs, wire


async def stack_phase(args, address: str, requests_for, rep: int = 0) -> tuple[list[RunResult], list[RunResult]]:
    """The distributed systems of one pass. Odd passes run each block's systems in reverse
    order, so that a drift over a block weighs on (d), (e) and (f) alike. The γ sweep is a
    block of its own: every γ of it, the fixed one included, and a target-only run that
    its speedups are taken over, measured together at the end of the pass (taking the fixed
    γ's figure from the main runs would set a point measured minutes earlier, under other
    conditions, beside the rest)."""
    client = StackClient(address)
    runs, sweep = [], []
    order = (lambda xs: xs) if rep % 2 == 0 else (lambda xs: xs[::-1])
    try:
        await client.warm_up(requests_for(1, fast=True), args.max_new_tokens, args.warm_up)
        for mode in args.modes:
            for c in args.concurrency:
                await client.warm_up_loaded(requests_for(c, fast=True), mode, c, args.max_new_tokens, args.load_warm_up)
                for system, gamma in order([("f", 0), ("d", args.gamma), ("e", None)]):
                    runs.append(await client.run(system, requests_for(c, fast=True), mode, c, args.max_new_tokens, gamma))
                    log(describe(runs[-1]))
        for mode in args.modes:
            for system, gamma in order([("f", 0)] + [("d", g) for g in args.gammas]):
                sweep.append(await client.run(system, requests_for(1, fast=True), mode, 1, args.max_new_tokens, gamma))
                log(describe(sweep[-1]) + " (γ sweep)")
    finally:
        await client.close()
    key = lambda r: (r.mode, r.system, r.concurrency, r.gamma if r.gamma is not None else -1.0)  # noqa: E731
    return sorted(runs, key=key), sorted(sweep, key=key)  # the same order in every pass (merge pairs them up)


def start_stack(args):
    from localstack.stack import LocalStack

    extra = {} if args.device == "auto" else {"SPECDEC_DEVICE": args.device}
    stack = LocalStack(draft_model=args.draft, target_model=args.target, threads=args.server_threads, extra_env=extra,
                       dtypes={"draft": args.draft_dtype, "target": args.dtype},
                       draft_args=["--quantize", args.draft_quantize])
    t0 = time.perf_counter()
    stack.start()
    log(f"stack up in {time.perf_counter() - t0:.1f}s (orchestrator {stack.orchestrator_address}, logs in {stack.workdir})")
    return stack


def measure_all(args, draft_model, target_model, tok, requests_for):
    """`args.repeats` passes over every system; odd passes run the stack first, so that a
    drift of the machine's speed over the run weighs on the in-process and the distributed
    systems alike. The passes of each run are pooled (runs.merge)."""
    stack = start_stack(args)
    passes, sweeps, wire = [], [], {}
    try:
        for rep in range(args.repeats):
            log(f"pass {rep + 1} of {args.repeats}")
            pass_requests = lambda c, rep=rep, fast=False: requests_for(c, rep, fast)  # noqa: E731
            in_process = lambda: in_process_phase(args, draft_model, target_model, tok, pass_requests,  # noqa: E731
                                                  with_wire=not wire)
            distributed = lambda: asyncio.run(stack_phase(args, stack.orchestrator_address, pass_requests, rep))  # noqa: E731
            if rep % 2 == 0:
                (local, w), (remote, sweep) = in_process(), distributed()
            else:
                (remote, sweep), (local, w) = distributed(), in_process()
            wire = wire or w
            passes.append(local + remote)
            sweeps.append(sweep)
    finally:
        stack.stop()
    runs = [merge(list(group)) for group in zip(*passes)]
    sweep = [merge(list(group)) for group in zip(*sweeps)]
    return runs, sweep, wire, passes


# ----------------------------------------------------------------------------- derived numbers
def attach_bounds(runs: list[RunResult], sweep: list[RunResult], costs: Costs, wire: dict, fixed_gamma: int) -> None:
    """Each run's analytic bound and bytes per round (see the module docstring)."""
    for r in runs + sweep:
        if r.system in ("a", "f"):
            r.bound_tps = costs.bound_tps(0.0, 0, r.concurrency)
        elif r.system == "b":
            ref = report.find(runs, "c", r.mode, 1)
            r.bound_tps = costs.bound_tps(ref.alpha, r.gamma, 1) if ref and ref.alpha is not None else None
        elif r.system == "e":
            ref = report.find(runs, "d", r.mode, r.concurrency)
            if ref and ref.alpha is not None and r.gamma is not None:
                r.bound_tps = costs.bound_tps(ref.alpha, r.gamma, r.concurrency)
        elif r.alpha is not None:
            r.bound_tps = costs.bound_tps(r.alpha, r.gamma, r.concurrency)
        model = wire.get(r.mode)
        if model is not None and r.system in ("d", "e", "f"):
            exact = r.system == "d" and r.gamma == fixed_gamma  # the rounds wire_meter sized
            r.wire_bytes, r.wire_note = (model.measured, "") if exact else (model.bytes_per_round(r.gamma or 0), "≈")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    quiet_transformers()
    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    tok = load_tokenizer(args.target)
    draft_model = load_model(args.draft, device, pick_dtype(args.draft_dtype, device))
    target_model = load_model(args.target, device, pick_dtype(args.dtype, device))
    # resolved once, here, for the in-process systems and the draft replica alike
    args.draft_quantize = resolve_quantize(args.draft_quantize, device, next(draft_model.parameters()).dtype)
    from training.corpus import heldout_prompts

    prompt_ids = [tok(p)["input_ids"] for p in heldout_prompts(args.prompts)]

    def requests_for(c: int, rep: int = 0, fast: bool = False):
        return make_requests(prompt_ids, request_count(args, c, fast), seed_base=pass_seed_base(rep))

    draft_runner, target_runner = ModelRunner(draft_model, quantize=args.draft_quantize), ModelRunner(target_model)
    meta = machine_info(device)
    meta.update(command="python -m benchmarks.bench " + " ".join(argv if argv is not None else sys.argv[1:]),
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                draft=model_summary(draft_model, args.draft) + (
                    f", {args.draft_quantize} weights" if args.draft_quantize != "none" else "")
                + f" ({draft_runner.kernels_summary})",
                target=model_summary(target_model, args.target) + f" ({target_runner.kernels_summary})",
                min_requests=request_count(args, 1, fast=True))
    log(f"measuring step costs (batches {args.concurrency})")
    costs = measure_costs(draft_runner, target_runner,
                          args.concurrency,
                          sorted(set(args.gammas) | {0, args.gamma, 8}), reps=args.cost_reps,
                          decision_gamma=args.gamma)
    log(f"c = {costs.ratio:.3f}: draft step {costs.draft_ms(1):.2f} ms, target step {costs.target_step_ms(1):.2f} ms")
    runs, sweep, wire, passes = measure_all(args, draft_model, target_model, tok, requests_for)
    attach_bounds(runs, sweep, costs, wire, args.gamma)
    meta["elapsed"] = time.perf_counter() - t_start
    report.write_results(args.out, args.plot, args, meta, costs, runs, sweep, wire, passes)
    for check in report.check_targets(runs, args.concurrency):
        log(f"{check.verdict:>4}  {check.target} = {report.fmt(check.measured)} (≥ {check.required:.1f}) {check.note}")
    log(f"wrote {args.out} and {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
