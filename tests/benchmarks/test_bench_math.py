"""The benchmark's arithmetic, without models: bound, interpolation, α bookkeeping, targets."""
import pytest

from benchmarks.costs import Costs, expected_tokens
from benchmarks.report import check_targets, checks_table
from benchmarks.runs import RunResult, merge, percentile, tried_tokens
from benchmarks.wire_meter import RoundBytes, WireLog, WireModel


def costs() -> Costs:
    return Costs(64, draft_step_ms={1: 1.0}, verify_ms={1: {0: 10.0, 2: 12.0, 4: 14.0}})


def test_expected_tokens_matches_the_geometric_series():
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(1.0, 4) == 5.0


def test_bound_is_expected_tokens_over_round_cost():
    c = costs()
    assert c.ratio == pytest.approx(0.1)
    assert c.verify(3) == pytest.approx(13.0)  # linear between γ = 2 and 4
    assert c.bound_tps(0.0, 0) == pytest.approx(100.0)  # plain decoding: one token per target step
    assert c.bound_tps(0.8, 4) == pytest.approx(1000 * expected_tokens(0.8, 4) / (4 * 1.0 + 14.0))
    assert c.speedup_bound(0.8, 4) == pytest.approx(expected_tokens(0.8, 4) / 1.8)


def test_tried_tokens_stop_at_the_first_rejection_and_skip_rounds_without_draft():
    # 16 new tokens, γ = 4: the last round has one token left, so it drafts nothing
    assert tried_tokens([4, 4, 4, 0], 4, 16) == 12
    assert tried_tokens([1, 4, 2, 4, 0], 4, 16) == 2 + 4 + 3 + 4


def test_percentile_is_nearest_rank():
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 99) == 99.0


def test_wire_model_splits_fixed_and_per_token_bytes():
    log = WireLog([RoundBytes(4, 300, 200, 80), RoundBytes(2, 200, 100, 80)])
    m = WireModel.fit(log)
    assert m.per_token == pytest.approx(50.0)
    assert m.bytes_per_round(4) == pytest.approx(100 + 200)
    assert m.bytes_per_round(0) == 80


def _run(system, mode, c, tps):
    r = RunResult(system, mode, c, None, wall_s=1.0)
    r.add_request([0] * int(tps), 1.0)
    return r


def test_targets_are_ratios_with_pass_and_fail():
    runs = [_run(s, m, c, tps) for m in ("greedy", "t1") for c in (1, 16)
            for s, tps in (("a", 10), ("b", 12), ("c", 20), ("d", 19), ("e", 25 * c), ("f", 10 * c))]
    checks = {c.target: c for c in check_targets(runs, [1, 16])}
    assert checks["one stream, greedy: (e) ÷ (a)"].measured == pytest.approx(2.5)
    assert checks["one stream, greedy: (e) ÷ (a)"].verdict == "PASS"
    assert checks["one stream, greedy: (e) ÷ (b)"].verdict == "PASS"  # 25/12 ≥ 1.5
    assert checks["greedy, one stream: (d) ÷ (c)"].verdict == "PASS"  # 0.95 ≥ 0.9
    assert checks["greedy: (e) at 16 streams ÷ (e) at one"].measured == pytest.approx(16.0)
    assert "| target (tokens/s ratio) |" in checks_table(list(checks.values()))
    small = {c.target: c for c in check_targets(runs, [1])}
    assert small["greedy, 1 stream: (e) ÷ (f)"].verdict == "PASS"


def test_an_e_that_never_speculated_is_noted_as_a_like_run_of_f():
    runs = [_run(s, "t1", c, tps) for c in (1, 4) for s, tps in (("e", 96 * c), ("f", 100 * c))]
    find = {(r.system, r.concurrency): r for r in runs}
    find[("e", 1)].gamma, find[("e", 4)].gamma = 3.9, 0.02  # the governor kept 4 streams target-only
    checks = {c.target: c for c in check_targets(runs, [1, 4]) if "(e) ÷ (f)" in c.target}
    alone, loaded = checks["temperature 1, 1 stream: (e) ÷ (f)"], checks["temperature 1, 4 streams: (e) ÷ (f)"]
    assert alone.verdict == loaded.verdict == "FAIL"  # the verdict stands; the note explains it
    assert alone.note == ""
    assert "mean γ 0.02" in loaded.note and "like runs" in loaded.note


def test_scaling_target_is_not_judged_below_16_streams():
    runs = [_run(s, "greedy", c, 10 * c) for c in (1, 2) for s in "abcdef"]
    check = next(c for c in check_targets(runs, [1, 2]) if c.target.startswith("greedy: (e) at 2 streams"))
    assert check.measured == pytest.approx(2.0) and check.verdict == "n/a"


def test_merged_passes_pool_tokens_and_time():
    a = RunResult("e", "greedy", 1, 3.0, wall_s=2.0, ms_per_token=[5.0], outputs=[[1, 2, 3, 4]], rounds=2,
                  drafted=6, accepted=4, tried=None, target_passes=2, stage_ms={"draft": 4.0})
    b = RunResult("e", "greedy", 1, 5.0, wall_s=1.0, ms_per_token=[7.0, 9.0], outputs=[[1, 2], [3, 4]],
                  rounds=2, drafted=10, accepted=2, tried=None, target_passes=2, stage_ms={"draft": 2.0})
    m = merge([a, b])
    assert m.tokens == 8 and m.wall_s == 3.0 and abs(m.tps - 8 / 3) < 1e-12  # not the mean of 2 and 4
    assert m.ms_per_token == [5.0, 7.0, 9.0] and m.outputs == [[1, 2, 3, 4], [1, 2], [3, 4]]
    assert m.gamma == 16 / 4  # an adaptive run's mean γ over all rounds
    assert m.stage_per_round("draft") == 6.0 / 4 and m.tried is None
    fixed = merge([RunResult("d", "t1", 4, 4, tried=3), RunResult("d", "t1", 4, 4, tried=5)])
    assert fixed.gamma == 4 and fixed.tried == 8


def test_a_streamed_request_splits_its_first_token_from_the_rest():
    """A 3-token answer after a 40 ms prefill: 14.7 ms a token over the whole request, but
    its tokens after the first came 2 ms apart; a one-token answer has no TPOT; a request
    returned whole has neither. Merged passes pool them."""
    r = RunResult("f", "t1", 1, None)
    r.add_request([5, 6, 7], 44.0, first_ms=40.0)
    r.add_request([8], 30.0, first_ms=30.0)
    r.add_request([9, 10], 20.0)  # in-process: no first-token time
    assert r.ms_per_token == [pytest.approx(44 / 3), 30.0, 10.0]
    assert r.ttft_ms == [40.0, 30.0] and r.tpot_ms == [2.0]
    assert r.tpot_p50 == 2.0 and r.tpot_p99 == 2.0 and r.ttft_p50 in (30.0, 40.0)
    whole = RunResult("c", "t1", 1, 4)
    whole.add_request([1, 2], 8.0)
    assert whole.ttft_p50 is None and whole.tpot_p50 is None and whole.tpot_p99 is None
    assert merge([r, r]).tpot_ms == [2.0, 2.0] and len(merge([r, r]).ttft_ms) == 4


def test_a_run_keeps_every_stream_busy_for_per_stream_requests():
    from benchmarks.bench import parse_args, request_count

    args = parse_args(["--prompts", "8"])
    assert [request_count(args, c) for c in (1, 4, 16)] == [8, 12, 48]  # default: 3 per stream
    assert request_count(parse_args(["--prompts", "8", "--per-stream", "1"]), 16) == 16
    assert request_count(parse_args(["--quick"]), 2) == 2
    # a run of the fast systems: at least --min-requests (default 16); 16 streams already run more
    assert [request_count(args, c, fast=True) for c in (1, 4, 16)] == [16, 16, 48]
    assert request_count(parse_args(["--prompts", "8", "--min-requests", "4"]), 1, fast=True) == 8
    with pytest.raises(SystemExit, match="per-stream"):
        parse_args(["--per-stream", "0"])


def test_each_pass_samples_its_own_texts_with_seeds_shared_by_its_systems():
    from benchmarks.runs import make_requests, pass_seed_base

    prompts = [[1, 2], [3]]
    first, again = make_requests(prompts, 48, pass_seed_base(0)), make_requests(prompts, 48, pass_seed_base(0))
    second = make_requests(prompts, 48, pass_seed_base(1))
    assert [r.seed for r in first] == [r.seed for r in again]  # (c) and (d) of one pass: the same seeds
    assert not {r.seed for r in first} & {r.seed for r in second}  # another pass: other texts
    assert [r.prompt_ids for r in first] == [r.prompt_ids for r in second]


def test_ab_probe_reads_arms_and_runs_and_refuses_the_rest():
    from benchmarks.ab_probe import parse_arm, parse_fields, parse_runs

    assert parse_arm("off=--overlap-min-hit 2") == ("off", ["--overlap-min-hit", "2"])
    assert parse_arm("base=") == ("base", [])
    assert parse_runs("t1:1:e, greedy:16:d") == [("t1", 1, "e"), ("greedy", 16, "d")]
    for bad in ("t1:1", "t3:1:e", "t1:0:e", "t1:1:x"):
        with pytest.raises(SystemExit, match="mode:streams:system"):
            parse_runs(bad)
    with pytest.raises(SystemExit, match="name=FLAGS"):
        parse_arm("--overlap-min-hit 2")
    fields = parse_fields(['lp={"logprobs": true, "top_logprobs": 20}'])
    assert fields["lp"].logprobs and fields["lp"].top_logprobs == 20
    for bad in ("lp={not json", 'lp={"no_such_field": 1}'):
        with pytest.raises(SystemExit, match="name=JSON"):
            parse_fields([bad])


def test_targets_table_shows_each_pass_beside_the_pooled_ratio():
    def runs(e_tps):
        return [_run(s, "greedy", 1, tps) for s, tps in (("a", 10), ("b", 12), ("c", 20), ("d", 19), ("e", e_tps),
                                                         ("f", 10))]
    passes = [runs(18), runs(26)]
    pooled = [merge([p, q]) for p, q in zip(*passes)]
    table = checks_table(check_targets(pooled, [1]), [check_targets(p, [1]) for p in passes])
    row = next(line for line in table.splitlines() if line.startswith("| one stream, greedy: (e) ÷ (a) |"))
    # pooled 44 tokens in 2 s against 20 in 2 s: 2.20, a PASS; the passes alone 1.80 and 2.60
    assert row == "| one stream, greedy: (e) ÷ (a) | 2.20 | ≥ 2.0 | PASS | 1.80 / 2.60 |  |"
    assert "per pass" in table.splitlines()[0]
    assert "per pass" not in checks_table(check_targets(pooled, [1]), [check_targets(passes[0], [1])])


def test_the_gpu_kit_explains_itself_and_refuses_to_run_off_the_device(tmp_path):
    """benchmarks/gpu_kit.sh is run once a session draws a GPU: it must at least parse,
    print its usage, and refuse `run` where no $OUT says it is on the device machine."""
    import os
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_kit.sh"
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    usage = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env)
    assert usage.returncode == 2 and "bash benchmarks/gpu_kit.sh prepare" in usage.stdout
    assert usage.stdout.rstrip().endswith("(e.g. --repeats 1 to fit the lease).")  # the whole header
    refused = subprocess.run(["bash", str(script), "run"], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert refused.returncode != 0 and "run on the device machine" in refused.stderr


def test_step_costs_are_timed_by_turns_with_the_draft_in_runs(monkeypatch):
    """measure_costs times every shape once per turn (so a slow spell weighs on all of
    them) and the draft's steps in runs of γ, as a round drafts after a verification: in
    one native call each where the runner drafts natively, as the draft service does."""
    import torch

    from benchmarks import costs as costs_mod
    from specdec import native
    from specdec.model_runner import ModelRunner
    from specdec.models import BUNDLED_DRAFT, BUNDLED_TARGET, load_model

    order, native_drafts = [], []
    real_run = costs_mod._Forward.run

    def spy(self, keep, times=1):
        order.append((self.runner is draft, self.n_new, len(self.caches), times))
        real_run(self, keep, times)

    monkeypatch.setattr(costs_mod._Forward, "run", spy)
    cpu = torch.device("cpu")
    draft = ModelRunner(load_model(BUNDLED_DRAFT, cpu, torch.float32), quantize="w8a8" if native.module() else "none")
    target = ModelRunner(load_model(BUNDLED_TARGET, cpu, torch.float32))
    real_draft = draft.draft_greedy
    monkeypatch.setattr(draft, "draft_greedy", lambda items, gammas: native_drafts.append(
        (len(items), tuple(it.cache.length for it in items), tuple(gammas))) or real_draft(items, gammas))
    c = costs_mod.measure_costs(draft, target, [1, 2], [2], context=8, reps=3, decision_gamma=3)
    turn = [(False, 1, 1, 1), (False, 3, 1, 1), (False, 1, 2, 1), (False, 3, 2, 1), (True, 1, 1, 3), (True, 1, 2, 3)]
    assert order == turn * 5  # two warm-up turns and three kept
    if native.module() is not None:  # every run of steps one call, each from the 8-token context
        assert native_drafts == [(1, (8,), (3,)), (2, (8, 8), (3, 3))] * 5
    assert c.draft_run == 3 and set(c.draft_step_ms) == {1, 2} and set(c.verify_ms[2]) == {0, 2}
    assert all(ms > 0 for ms in [*c.draft_step_ms.values(), *c.verify_ms[1].values(), *c.verify_ms[2].values()])


def test_consistency_pairs_requests_pass_by_pass_when_systems_ran_different_counts():
    from benchmarks.report import identity_lines

    def run(system, outputs):
        r = RunResult(system, "greedy", 1, 4)
        r.outputs = [list(o) for o in outputs]
        return r

    # pass k: (a) ran 2 requests, (c) and (d) ran 4; (d) differs from (c) on request 3 of pass 1
    p0 = [run("a", [[1], [2]]), run("c", [[1], [2], [3], [4]]), run("d", [[1], [2], [3], [4]])]
    p1 = [run("a", [[5], [6]]), run("c", [[5], [6], [7], [8]]), run("d", [[5], [6], [7], [9]])]
    merged = [run("a", [[1], [2], [5], [6]]), run("c", [[1], [2], [3], [4], [5], [6], [7], [8]]),
              run("d", [[1], [2], [3], [4], [5], [6], [7], [9]])]
    lines = identity_lines(merged, ["greedy"], [p0, p1])
    assert "(d) = (c) token for token on 7/8 requests" in lines[0]
    assert "(c) = (a) HF generate() token for token on 4/4 requests" in lines[1]  # pooled, (a)'s 4 would misalign


def test_the_targets_note_says_where_e_ran_target_only_or_drafted_by_prompt_lookup():
    from benchmarks.report import _like_runs_note

    idle = RunResult("e", "greedy", 16, 0.05)
    assert "target-only rounds, as (f)" in _like_runs_note(idle)
    looked = RunResult("e", "greedy", 16, 1.3)
    looked.drafted, looked.looked_up = 200, 174
    assert _like_runs_note(looked) == "(e): 87% of its drafted tokens by prompt lookup"
    drafted = RunResult("e", "greedy", 1, 3.5)
    drafted.drafted = 300
    assert _like_runs_note(drafted) == "" and _like_runs_note(None) == ""
