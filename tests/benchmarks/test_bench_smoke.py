"""Smoke runs of the benchmarks: they run end to end and write their reports. The numbers
are not asserted (they belong to `make bench`, on a quiet machine)."""
import pytest

from benchmarks import bench, pair

pytestmark = [pytest.mark.bench, pytest.mark.e2e]


def test_bench_quick_writes_the_report_and_the_plot(bundled_paths, tmp_path):
    out = tmp_path / "RESULTS.md"
    assert bench.main(["--quick", "--prompts", "2", "--max-new-tokens", "16", "--concurrency", "1,2",
                       "--gammas", "2,4", "--cost-reps", "2", "--load-warm-up", "1", "--out", str(out)]) == 0
    text = out.read_text()
    assert "each concurrency c > 1 after 1 s of adaptive traffic at c" in text
    for header in ("# Benchmark results", "## Targets", "## Step costs", "## Verdicts and wire", "## greedy, 1 stream",
                   "## temperature 1, 2 streams", "## γ sweep of (d), one stream", "## Bytes on the wire per round",
                   "| system | tok/s |", "(e) distributed, adaptive γ", "(b) HF assisted generation"):
        assert header in text, header
    assert "parameters, float32" in text  # each model's dtype as served
    target = next(line for line in text.splitlines() if line.startswith("- target: "))
    assert "; attention native" in target and target.endswith(")")  # and the runner's kernels
    # the streamed systems report their first token apart from the rest; the in-process ones cannot
    header = next(line for line in text.splitlines() if line.startswith("| system | tok/s |"))
    ttft = [c.strip() for c in header.strip("|").split("|")].index("p50 TTFT ms")
    rows = {line.split("|")[1].strip()[:3]: [c.strip() for c in line.strip("|").split("|")]
            for line in text.split("## greedy, 1 stream")[1].split("##")[0].splitlines() if line.startswith("| (")}
    assert float(rows["(f)"][ttft]) > 0 and float(rows["(f)"][ttft + 1]) > 0 and rows["(c)"][ttft] == "—"
    png = tmp_path / "speedup.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pair_prints_its_table_and_returns_the_numbers(bundled_paths, capsys):
    res = pair.run_pair(str(bundled_paths[0]), str(bundled_paths[1]), prompts=2, max_new_tokens=12, cost_reps=2)
    assert set(res["modes"]) == {"greedy", "t1"}
    for m in res["modes"].values():
        assert set(m["tokens_per_s"]) == {"hf_generate", "hf_assisted", "spec_loop"}
    assert res["cost_ratio"] > 0
    table = pair.format_table(res)
    assert "| mode | α |" in table and "HF assisted tok/s" in table


def test_rpc_floor_prints_echo_and_verify_rows(capsys):
    from benchmarks import rpc_floor

    assert rpc_floor.main(["--calls", "3", "--gaps-ms", "0,1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    # header, rule, then echo, Verify, VerifyStream, VerifyMux over gRPC and over the frame
    # link, and the bare step for each gap; then the paired table: header, rule and three rows
    # by unary gRPC, three over the frame link
    assert len(rows) == 2 + 12 + 2 + 6
    verify = [r for r in rows if r.startswith("| Verify")]
    assert len(verify) == 8 and sum("VerifyStream" in r for r in verify) == 2
    assert sum("VerifyMux call over the frame link" in r for r in verify) == 2
    assert all(float(r.split("|")[5]) > 0 for r in verify)  # the replica reported its compute time
    steps = [r for r in rows if r.startswith("| no call")]
    assert len(steps) == 2 and all(float(r.split("|")[3]) > 0 for r in steps)
    paired = rows[-6:]
    assert paired[0].startswith("| replica's compute of a Verify |")
    assert paired[3].startswith("| replica's compute of a VerifyMux call over the frame link |")
    assert all(float(r.split("|")[2]) > 0 for r in paired)


def test_commit_probe_prints_a_row_per_way(capsys):
    from benchmarks import commit_probe

    assert commit_probe.main(["--sessions", "3", "--turns", "5", "--rounds", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows[1:]] == list(commit_probe.WAYS)
    assert all(float(r.split("|")[4]) > 0 for r in rows[1:])  # wall time per commit


def test_stack_probe_reports_each_run_with_the_replicas_batching(capsys):
    from benchmarks import stack_probe

    assert stack_probe.main(["--configs", "greedy:2", "--prompts", "2", "--per-stream", "1",
                             "--max-new-tokens", "6", "--warm-up", "0", "--systems", "fed1"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("greedy 2 streams")]
    assert [ln.split()[3] for ln in lines] == ["(f)", "(e)", "(d)", "(1)"]
    assert 0.5 < float(lines[3].split("γ ")[1].split()[0]) <= 1.0  # a digit: (d) at that γ (short last rounds draft fewer)
    assert "γ 0.00 tok/round 1.00" in lines[0]  # target only: one token a round
    assert float(lines[2].split("γ ")[1].split()[0]) > 0  # (d) drafted
    assert all("target: batch" in ln for ln in lines)  # the target served every run
    assert "draft: batch" in lines[2]  # (d) drafted through the draft replica
    # (e) may rightly switch speculation off when two streams saturate the target (γ 0), or draft
    # every token by prompt lookup (greedy): then the draft replica must have been idle; when it
    # drafted, the replica must report its batches
    e_gamma = float(lines[1].split("γ ")[1].split()[0])
    e_looked_up = float(lines[1].split("looked up ")[1].split()[0])
    assert 0 <= e_looked_up <= 1 and "looked up 0.00" in lines[2]  # a fixed γ with its draft never looks up
    assert "draft: batch" in lines[1] or ((e_gamma == 0 or e_looked_up == 1) and "draft: idle" in lines[1])
    assert "pre-drafts: none" in lines[0] and "pre-drafts: none" in lines[2]  # only (e) pre-drafts
    assert "pre-drafts:" in lines[1]  # (e): the orchestrator's own counts, scraped
    for ln in lines:  # each process's CPU time per round, as measured from /proc
        cpu = dict(part.rsplit(" ", 1) for part in ln.split("cpu ms/round: ")[1].split(", "))
        assert set(cpu) == {"target", "draft", "orchestrator"} and float(cpu["target"]) > 0


def test_attention_probe_prints_both_ways_for_each_case(capsys):
    from benchmarks import attention_probe

    assert attention_probe.main(["--batches", "1,3", "--lengths", "5-20", "--tokens", "2", "--reps", "2"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + 2  # header, then one row per batch size (the rule starts with "|-")
    for row in rows[1:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert all(float(c) > 0 for c in cells[3:6]) and float(cells[2]) >= 1.0


def test_ab_probe_runs_every_arm_by_turns_and_sums_them_up(capsys):
    """The arm `off` with a target replica of its own, in a pool only its orchestrator
    reads: its calls succeed only if that replica serves them."""
    from benchmarks import ab_probe

    assert ab_probe.main(["--arm", "base=", "--arm", "off=--overlap-min-hit 2", "--runs", "t1:1:e", "--rounds", "2",
                          "--prompts", "2", "--per-stream", "1", "--max-new-tokens", "6", "--warm-up", "0",
                          "--join", "2",  # prompts of two held-out prompts each
                          "--arm-target", "off=MALLOC_ARENA_MAX=2 --batch-wait-ms 0"]) == 0
    out = capsys.readouterr().out
    rounds = [line.split(":")[0] for line in out.splitlines() if line.startswith("round ")]
    assert rounds == ["round 1 base", "round 1 off", "round 2 off", "round 2 base"]  # order reversed each round
    assert "| t1 1 streams (e) | base |" in out and "| t1 1 streams (e) | off |" in out
    with pytest.raises(SystemExit, match="--join must be at least 1"):
        ab_probe.main(["--arm", "a=", "--arm", "b=", "--join", "0"])
    with pytest.raises(SystemExit, match="--arm-target names arms that are not given with --arm: c"):
        ab_probe.main(["--arm", "a=", "--arm", "b=", "--arm-target", "c=--batch-wait-ms 0"])


def test_dtype_probe_times_each_shape_in_each_dtype(capsys):
    from benchmarks import dtype_probe
    from specdec.models import BUNDLED_DRAFT

    assert dtype_probe.main(["--model", str(BUNDLED_DRAFT), "--shapes", "1x1,2x3", "--reps", "2",
                             "--context", "8"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "session(s)" in ln]
    assert len(lines) == 2 and "2 session(s) × 3 token(s)" in lines[1]
    assert all("float32" in ln and "bfloat16" in ln and "×)" in ln for ln in lines)


def test_dtype_probe_compares_a_drafts_16_bit_and_int8_weights(capsys):
    from benchmarks import dtype_probe
    from specdec.models import BUNDLED_DRAFT

    assert dtype_probe.main(["--model", str(BUNDLED_DRAFT), "--dtypes", "float32", "--quantize", "none,int8",
                             "--shapes", "1x1", "--reps", "2", "--context", "8"]) == 0
    out = capsys.readouterr().out
    assert "float32 int8: products" in out and out.count("; weights int8") == 1
    line = next(ln for ln in out.splitlines() if "session(s)" in ln)
    assert "float32 none" in line and "float32 int8" in line and "×)" in line


def test_dtype_probe_counts_the_operators_of_attention_per_session_and_over_paged_caches(capsys):
    """What a GPU launches: per session the operators grow with the batch in every layer
    (12 here), paged only once a forward (its packed ids and logits rows)."""
    from benchmarks import dtype_probe

    assert dtype_probe.main(["--dtypes", "float32", "--attention", "sdpa,paged",
                             "--shapes", "1x5,8x5", "--reps", "1", "--context", "8", "--count-ops"]) == 0
    out = capsys.readouterr().out
    counts = {}
    for line in out.split("torch operators per forward")[1].splitlines()[1:]:
        batch = int(line.split()[0])
        for name in ("sdpa", "paged"):
            counts[name, batch] = int(line.split(f"float32 {name} ")[1].split()[0])
    assert counts["sdpa", 8] - counts["sdpa", 1] > 7 * 12 * 2  # a write, the attention, ... per session and layer
    assert counts["paged", 8] - counts["paged", 1] < 7 * 2 + 4


def test_quant_probe_reports_every_draft_on_the_same_windows(capsys):
    from benchmarks import quant_probe
    from specdec import native

    assert quant_probe.main(["--windows", "2", "--seq", "32", "--requests", "2", "--seed-bases", "7",
                             "--max-new-tokens", "8"]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(("| as stored", "| int8", "| w8a8"))]
    generated = 3 if native.module().has_int8_dot() else 2
    assert len(rows) == 3 + generated  # teacher-forced, then generated
    alphas = [float(r.split("|")[2]) for r in rows[:3]]
    assert all(0.3 < a < 1.0 for a in alphas) and max(alphas) - min(alphas) < 0.05
    assert all(0.0 <= float(r.split("|")[2]) <= 1.0 for r in rows[3:])


def test_draw_probe_times_both_arms_and_leaves_the_native_calls_on(capsys):
    from benchmarks import draw_probe
    from specdec import native, sampling

    assert draw_probe.main(["--rounds", "2", "--reps", "3", "--gamma", "2"]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| ") and "median" not in ln]
    assert [r.split(" | ")[0] for r in rows] == ["| draft step", "| target step", "| proposal γ=2, greedy",
                                                 "| proposal γ=2, t=1"]
    assert all(float(r.split(" | ")[1]) > 0 and float(r.split(" | ")[2]) > 0 for r in rows)
    assert native.loaded() is not None and sampling.sample_from is not sampling.sample_from_torch  # switched back


def test_stop_rule_probe_prices_fixed_and_stopping_proposals(capsys):
    from benchmarks import stop_rule_probe

    assert stop_rule_probe.main(["--prompts", "2", "--max-new-tokens", "12", "--max-gamma", "3",
                                 "--thresholds", "0.2", "--overhead-ms", "1", "--cost-reps", "3"]) == 0
    out = capsys.readouterr().out
    assert "rounds of γ = 3 (t1)" in out
    assert [ln.split(":")[0] for ln in out.splitlines() if ln.startswith("fixed")] == [
        "fixed γ = 1", "fixed γ = 2", "fixed γ = 3"]
    assert "1.000 × the best fixed γ" in out  # the best one is itself
    assert "stop after q(x) < 0.2" in out and "stop after max q < 0.2" in out


def test_stop_rule_counts_what_a_cut_proposal_yields():
    from benchmarks.stop_rule_probe import Round, first_below, tokens_per_second

    rounds = [Round([0.9, 0.1, 0.8], [0.9, 0.5, 0.8], accepted=3), Round([0.9, 0.9, 0.9], [0.9, 0.9, 0.9], 0)]
    assert first_below(rounds[0].q_token, 0.2) == 2 and first_below(rounds[1].q_token, 0.2) == 3
    # cut after 2: the first round keeps both and the bonus (3 tokens), the second 1; 2 rounds
    # of 1 + 2·1 + 2 ms each
    tps, mean = tokens_per_second(rounds, lambda r: 2, 1.0, lambda k: 2.0, 1.0)
    assert tps == pytest.approx(1000 * 4 / 10) and mean == 2


REFUSALS = [
    ("rpc_floor", ["--gaps-ms", "0,x"], "--gaps-ms"),
    ("rpc_floor", ["--calls", "0"], "--calls"),
    ("stack_probe", ["--configs", "greedy:x"], "mode:streams"),
    ("stack_probe", ["--systems", "ex"], "--systems"),
    ("attention_probe", ["--lengths", "50-10"], "--lengths"),
    ("attention_probe", ["--batches", "x"], "--batches"),
    ("dtype_probe", ["--dtypes", "float8"], "--dtypes"),
    ("dtype_probe", ["--shapes", "4"], "--shapes"),
    ("dtype_probe", ["--quantize", "int4"], "--quantize"),
    ("quant_probe", ["--windows", "0"], "--windows"),
    ("quant_probe", ["--seed-bases", "x"], "--seed-bases"),
    ("stop_rule_probe", ["--thresholds", "0.1,x"], "--thresholds"),
    ("stop_rule_probe", ["--max-gamma", "0"], "--max-gamma"),
    ("draw_probe", ["--reps", "0"], "--reps"),
    ("commit_probe", ["--sessions", "0"], "--sessions"),
]


@pytest.mark.parametrize("probe,argv,words", REFUSALS, ids=[f"{p} {' '.join(a)}" for p, a, _ in REFUSALS])
def test_probes_refuse_bad_arguments_before_any_work(probe, argv, words):
    import importlib

    with pytest.raises(SystemExit, match=words):
        importlib.import_module(f"benchmarks.{probe}").main(argv)


def test_law_probe_times_both_arms_of_every_law_on_the_same_tokens(capsys):
    from benchmarks import law_probe
    from specdec import sampling, shaping

    native_ones = sampling.top_p_drop, shaping.native_shaping
    assert law_probe.main(["--rounds", "2", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "both arms committed the same tokens under every law" in out  # else it exits with the laws
    rows = [line for line in out.splitlines() if line.startswith("| ") and "median" not in line]
    assert [r.split("|")[1].strip() for r in rows] == list(law_probe.LAWS)
    for row in rows:
        assert all(float(c) > 0 for c in row.strip("|").split("|")[1:])
    assert (sampling.top_p_drop, shaping.native_shaping) == native_ones  # the kernels are back


def test_law_probe_alone_times_each_law_both_ways_and_refuses_bad_rows(capsys):
    from benchmarks import law_probe

    assert law_probe.main(["--alone", "--rows", "1,3", "--rounds", "1"]) == 0
    rows = [line.strip("|").split("|") for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and "operators" not in line]
    assert [(r[0].strip(), int(r[1])) for r in rows] == [(name, n) for n in (1, 3) for name in law_probe.ALONE_LAWS]
    assert all(float(c) > 0 for r in rows for c in r[2:])
    with pytest.raises(SystemExit, match="--rows"):
        law_probe.main(["--alone", "--rows", "0"])


def test_prefix_probe_times_a_first_round_with_and_without_reuse(capsys):
    from benchmarks import prefix_probe

    assert prefix_probe.main(["--prefix", "40", "--question", "5", "--rounds", "2"]) == 0
    out = capsys.readouterr().out
    assert "the same tokens either way over 2 sessions" in out  # else it exits naming the session
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| prefix reuse")}
    assert set(rows) == {"prefix reuse off", "prefix reuse on"}
    with pytest.raises(SystemExit, match="at least 16"):
        prefix_probe.main(["--prefix", "8"])


def test_short_calls_probe_prints_a_line_per_batch(capsys):
    import ast

    from benchmarks import short_calls_probe

    short_calls_probe.main(["--callers", "2,1", "--calls", "6", "--tokens", "4"])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("batch")]
    assert [ln.split(":")[0] for ln in lines] == ["batch 0", "batch 1"]
    assert "2 callers, 6 calls" in lines[0] and "1 callers, 6 calls" in lines[1]
    for ln in lines:  # every round of a call counted once, by the γ it chose
        rounds = ast.literal_eval(ln.split("rounds by γ ")[1])
        assert sum(rounds.values()) >= 6 * 2 and set(rounds) <= {"0", "1", "2"}


def test_short_calls_probe_refuses_bad_callers():
    from benchmarks import short_calls_probe

    with pytest.raises(SystemExit) as exc:
        short_calls_probe.parse_args(["--callers", "4,x"])
    assert exc.value.code == 2
