"""What the native draw, final norm and whole forward save: `python -m benchmarks.draw_probe`.

specdec.native's `sample_rows` (a sampled draw in one call) and `rms_norm` (the model's
final norm with the layers' own loop) replace a dozen torch operators each, and its
PackedModel runs a whole forward (embedding, layers, final norm, head), or every step of a
plain greedy proposal, as one call. This times, by turns in one process over the bundled
pair's engines, a draft step, a target step and a draft proposal of γ tokens after a
3-token feed (greedy and at temperature 1), once with the native calls and once with
torch's operators restored in their place (sampling's `sample_from_torch`, `F.rms_norm`,
and the layers one native call each with Python between them), and prints the median of
each, so that a slow spell of a shared machine weighs on both arms alike. The tokens drawn
are the same either way (tests/specdec/test_native_sampling.py,
tests/specdec/test_decoder_layer.py, tests/draft_service/test_engine.py).
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from specdec import native, sampling
from specdec.model_runner import ForwardItem, ModelRunner
from specdec.models import BUNDLED_DRAFT, BUNDLED_TARGET, load_model
from specdec.sessions import CacheRef


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, x.shape[-1:], weight, eps)


class Arms:
    """Switches the runners and the sampling core between the native calls and torch's."""

    def __init__(self, runners: list[ModelRunner]) -> None:
        if native.module() is None:
            raise SystemExit(f"specdec's CPU kernels are unavailable here: {native.unavailable_reason()}")
        self.draw = sampling.sample_from
        self.norms = [(r, r._final_rms_norm, r._whole) for r in runners]
        if any(norm is None for _, norm, _ in self.norms):
            raise SystemExit("the runners do not fuse their layers here (no 16-bit products?): nothing to compare")

    def use(self, native_calls: bool) -> None:
        # sampling's own functions look sample_from up at each call; the products and the
        # layers keep their native kernels either way (the draw, the final norm and the
        # whole forward in one call differ between arms)
        sampling.sample_from = self.draw if native_calls else sampling.sample_from_torch
        for runner, norm, whole in self.norms:
            runner._final_rms_norm = norm if native_calls else torch_rms_norm
            runner._whole = whole if native_calls else None


def median_us(call: Callable[[], object], reps: int, reset: Callable[[], None] | None = None) -> float:
    """The median time of `reps` calls, after `reset` (so that both arms time the same work)."""
    if reset is not None:
        reset()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def step_timer(runner: ModelRunner) -> tuple[Callable[[], object], Callable[[], None]]:
    """One decode step, and a reset to a 40-position cache: each arm's steps then run at
    the same positions, whose attention costs more as the cache grows."""
    cache, ids = runner.new_cache(), torch.arange(40)
    runner.forward_packed([ForwardItem(cache, ids, 1)])

    def step():
        return runner.forward_packed([ForwardItem(cache, ids[:1], 1)])

    def reset():
        cache.truncate(40)
    return step, reset


def propose_timer(draft, gamma: int, temperature: float) -> tuple[Callable[[], object], None]:
    from draft_service.engine import ProposeJob

    count = iter(range(1 << 62))

    def propose():
        sid = f"probe-{temperature}-{next(count)}"
        params = sampling.SamplingParams(temperature, seed=next(count))
        out = draft.propose([ProposeJob(CacheRef(sid, 0, 0, [5, 9, 11]), gamma, params)])[0]
        draft.sessions.release(sid)
        if isinstance(out, Exception):
            raise out
        return out
    return propose, None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.draw_probe", description=__doc__.split("\n\n")[1])
    ap.add_argument("--rounds", type=int, default=8, help="turns of both arms (default 8)")
    ap.add_argument("--reps", type=int, default=300,
                    help="timed calls of each kind per arm and round (default 300; steps run at cache positions "
                         "40 to 40 + reps)")
    ap.add_argument("--gamma", type=int, default=4, help="tokens per proposal (default 4)")
    ap.add_argument("--draft", default=str(BUNDLED_DRAFT), help="draft model directory (default: bundled)")
    ap.add_argument("--target", default=str(BUNDLED_TARGET), help="target model directory (default: bundled)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if min(args.rounds, args.reps, args.gamma) < 1:
        raise SystemExit("--rounds, --reps and --gamma must be at least 1")
    if args.reps > 1900:
        raise SystemExit("--reps: at most 1900 (the steps must stay inside the models' 2,048 positions)")
    from benchmarks.inprocess import build_engines

    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    draft, target = build_engines(load_model(args.draft, cpu, torch.float32), load_model(args.target, cpu, torch.float32))
    arms = Arms([draft.runner, target.runner])
    timers = {"draft step": step_timer(draft.runner), "target step": step_timer(target.runner),
              f"proposal γ={args.gamma}, greedy": propose_timer(draft, args.gamma, 0.0),
              f"proposal γ={args.gamma}, t=1": propose_timer(draft, args.gamma, 1.0)}
    results: dict[tuple[str, bool], list[float]] = {}
    try:
        for rnd in range(args.rounds):
            for native_calls in ((True, False) if rnd % 2 == 0 else (False, True)):
                arms.use(native_calls)
                for name, (timer, reset) in timers.items():
                    results.setdefault((name, native_calls), []).append(median_us(timer, args.reps, reset))
    finally:
        arms.use(True)
    print("| µs, median of rounds | torch's operators | native calls | ratio |")
    print("|---|---|---|---|")
    for name in timers:
        before, after = statistics.median(results[(name, False)]), statistics.median(results[(name, True)])
        print(f"| {name} | {before:.1f} | {after:.1f} | {after / before:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
