"""The soak's own run, short: every kind of request it mixes goes through a real stack,
with no error, the greedy requests repeat their tokens whatever γ they ran with, and no
session handle or cache is left once the clients stop."""
from __future__ import annotations

import asyncio
import time

import pytest

from localstack.soak import (CHAOS_SIGNALS, KINDS, chaos_plan, format_report, kv_cache_mib, less_kv, memory_summary,
                             parse_variant, passed, processes, soak, stack_env)
from localstack.stack import Variant

pytestmark = pytest.mark.e2e


def test_a_short_soak_through_every_kind_of_request_leaves_nothing_behind(local_stack):
    report = asyncio.run(soak(local_stack, streams=4, seconds=300, max_new_tokens=16, max_requests=3 * len(KINDS)))
    assert passed(report), format_report(report)
    assert report["kinds"] == {kind: 3 for kind in KINDS}
    assert report["cancelled"] >= 1
    # each prompt's greedy requests (adaptive γ, γ = 4, target-only) share one key
    assert report["compared"]["greedy"] >= 6
    # every server's memory was read, at the start and at the end
    memory = report["memory_mib"]
    assert set(memory) == set(processes(local_stack)), memory
    assert all(m["start"] > 0 and m["end"] > 0 for m in memory.values()), memory


def test_servers_stopped_under_a_soak_are_invisible_to_its_clients(bundled_paths):
    """Two replicas a pool and two orchestrators; one server stopped every few seconds, the
    pools and the orchestrators in turn, killed and drained (as a rolling update does) by
    turns, and a new one started in its place: no error, the same tokens for every repeated greedy
    request (and seeded one, where every replica is batch-invariant, as the bundled pair is
    here), and nothing left over. The clients send a call refused by an orchestrator
    shutting down to the other, and one cut by an orchestrator killed again with its request
    id, which must continue the tokens it had streamed. With drains, one
    CI run had requests fail UNAVAILABLE for most of the run and a session left over, not
    understood; since then stops no longer hang on a dropped cancellation and a pool whose
    every replica failed a call is tried again (benchmarks/HISTORY.md, "Soaks with chaos",
    "Drains that hung"). A failure carries the servers' logs."""
    from localstack.stack import LocalStack
    from tests.stacks import started_stack, stopped

    stack = started_stack(lambda: LocalStack(extra_env=stack_env("both", True)), drafts=2, targets=2,
                          orchestrators=2)
    try:
        report = asyncio.run(soak(stack, streams=4, seconds=16, max_new_tokens=24, chaos=2.0,
                                  chaos_signal="both", chaos_orchestrators=True, min_stops=4))
        # the servers' logs go with a failure: the stack's files are gone once it stops
        diagnosis = "" if passed(report) else stack.diagnostics(lines=60)
    finally:
        stopped(stack)
    assert passed(report), format_report(report) + "\n" + diagnosis
    stopped_kinds = {r.split("@")[0] for r in report["restarts"]}
    assert stopped_kinds >= {"target", "draft", "orchestrator"}, report["restarts"]
    # the orchestrators were killed and drained, the pools met at least one of the two each
    assert {r.split(" ")[1].strip("(,") for r in report["restarts"] if r.startswith("orchestrator")} == \
        {"SIGKILL", "SIGTERM"}, report["restarts"]
    assert report["compared"]["greedy"] >= 20
    assert report["logprobs_compared"] >= 5  # repeats asking for log-probabilities, every one matching


def test_target_variants_run_side_by_side_with_their_own_flags_and_environment(bundled_paths):
    """A pool of two target variants: each replica started with its variant's environment
    and flags (read back from /proc), the report naming each in its memory table and giving
    each one's share of the engine's work from its /metrics."""
    from pathlib import Path

    from localstack.stack import LocalStack
    from tests.stacks import started_stack, stopped

    variants = [parse_variant(""), parse_variant("SPECDEC_SOAK_VARIANT=b --heap-trim-seconds 0")]
    stack = started_stack(lambda: LocalStack(extra_env=stack_env("kill", False, variants=True)),
                          target_variants=variants, metrics=True)
    try:
        targets = [r for r in stack.replicas if r.kind == "target"]
        environ = [Path(f"/proc/{r.proc.pid}/environ").read_bytes().split(b"\0") for r in targets]
        argv = [Path(f"/proc/{r.proc.pid}/cmdline").read_bytes().split(b"\0") for r in targets]
        orchestrator_env = Path(f"/proc/{stack.orchestrators[0].proc.pid}/environ").read_bytes().split(b"\0")
        report = asyncio.run(soak(stack, streams=4, seconds=300, max_new_tokens=16, max_requests=2 * len(KINDS)))
        held = kv_cache_mib(stack)  # the released caches kept as prefix donors, once a heartbeat has counted them
        for _ in range(50):
            if all(held.get(name, 0) > 0 for name in report["engines"]):
                break
            time.sleep(0.1)
            held = kv_cache_mib(stack)
    finally:
        stopped(stack)
    assert passed(report), format_report(report)
    assert [r.label for r in targets] == ["defaults", "SPECDEC_SOAK_VARIANT=b --heap-trim-seconds 0"]
    assert [b"SPECDEC_SOAK_VARIANT=b" in e for e in environ] == [False, True]
    assert [b"--heap-trim-seconds" in a for a in argv] == [False, True]
    assert b"SPECDEC_PREFIX_AFFINITY=off" in orchestrator_env  # by load alone: each variant meets every kind
    names = [f"target@{r.port} [{r.label}]" for r in targets]
    engines = {name: e for name, e in report["engines"].items() if e["kind"] == "target"}
    assert set(names) <= set(report["memory_mib"]) and set(engines) == set(names)
    assert all(e["batches"] > 0 for e in report["engines"].values()), report["engines"]  # the draft's too
    assert sum(e["share"] for e in engines.values()) == pytest.approx(1.0)
    text = format_report(report)
    assert all(text.count(name) == 3 for name in names), text  # its memory, that less its caches, its work
    draft = next(r for r in stack.replicas if r.kind == "draft")
    assert report["engines"][f"draft@{draft.port}"]["share"] == 1.0
    assert set(held) == set(report["engines"]) and all(v > 0 for v in held.values()), held
    for name in held:  # each replica's memory less its caches
        m = report["memory_mib"][name]
        assert m["kv_mean"] >= 0 and 0 < m["less_kv"]["end"] <= m["end"], m
    assert "orchestrator" not in str([n for n, m in report["memory_mib"].items() if "less_kv" in m])
    assert "less its KV caches" in text


def test_a_variant_reads_its_leading_assignments_as_environment_as_a_shell_does():
    assert parse_variant("") == Variant({}, [], "defaults")
    v = parse_variant("MALLOC_ARENA_MAX=2 LD_PRELOAD='/lib/a b.so' --heap-trim-seconds 0 --x=1")
    assert v.env == {"MALLOC_ARENA_MAX": "2", "LD_PRELOAD": "/lib/a b.so"}
    assert v.args == ["--heap-trim-seconds", "0", "--x=1"]  # NAME=VALUE after the first flag is the flag's
    assert v.label == "MALLOC_ARENA_MAX=2 'LD_PRELOAD=/lib/a b.so' --heap-trim-seconds 0 --x=1"
    with pytest.raises(ValueError, match="No closing quotation"):
        parse_variant("--x 'a")


@pytest.mark.parametrize("orchestrators", [False, True])
def test_the_chaos_plan_stops_each_kind_with_each_signal_and_the_orchestrators_early(orchestrators):
    kinds = {"target", "draft"} | ({"orchestrator"} if orchestrators else set())
    for name, sigs in CHAOS_SIGNALS.items():
        plan = chaos_plan(sigs, orchestrators)
        assert set(plan) == {(kind, sig) for kind in kinds for sig in sigs}, name
        assert {kind for kind, _ in plan[:len(kinds)]} == kinds, name  # every kind before any twice
    if orchestrators:  # four stops: the orchestrators killed and drained, each signal on a pool
        first = chaos_plan(CHAOS_SIGNALS["both"], True)[:4]
        assert {sig for kind, sig in first if kind == "orchestrator"} == set(CHAOS_SIGNALS["both"])
        assert {sig for kind, sig in first if kind != "orchestrator"} == set(CHAOS_SIGNALS["both"])


def test_memory_summary_tells_a_steady_leak_from_the_allocators_swing():
    swing = [(t, 700.0 + (60.0 if (t // 15) % 2 else 0.0)) for t in range(0, 721, 15)]  # 700 and 760 by turns
    flat = memory_summary(swing)
    assert abs(flat["mib_per_minute"]) < 1.0 and flat["first_minute_peak"] == flat["last_minute_peak"] == 760.0
    leak = memory_summary([(t, m + 2.0 * t / 60) for t, m in swing])  # the same swing, and 2 MiB a minute more
    assert leak["mib_per_minute"] == pytest.approx(2.0, abs=0.6)
    assert leak["last_minute_peak"] - leak["first_minute_peak"] > 18.0
    assert (leak["start"], leak["end"]) == (700.0, swing[-1][1] + 24.0)


def test_a_replicas_memory_less_its_kv_caches_tells_a_leak_from_its_sessions_coming_and_going():
    """Caches of long prompts come and go (the resident memory swings and, as they grow over
    a run, rises with them); less them the same memory is flat."""
    t = list(range(0, 721, 15))
    kv = [(s, 40.0 + (120.0 if (s // 30) % 3 == 0 else 0.0) + s / 12) for s in t]  # + 5 MiB a minute
    rss = [(s, 500.0 + m) for s, m in kv]
    assert memory_summary(rss)["mib_per_minute"] == pytest.approx(5.0, abs=1.5)
    rest = memory_summary(less_kv(rss, kv))
    assert rest["mib_per_minute"] == pytest.approx(0.0, abs=1e-9) and rest["last_minute_peak"] == 500.0
    gone = less_kv([(0.0, 600.0), (5.0, 610.0), (10.0, None)], [(0.0, 100.0)])  # no KV reading, a process gone
    assert gone == [(0.0, 500.0), (5.0, None), (10.0, None)]


def test_memory_summary_of_a_short_run_or_a_process_gone_midway():
    short = memory_summary([(0.0, 500.0), (5.0, 510.0), (10.0, 505.0)])  # no reading past the first minute
    assert short["first_minute_peak"] == 510.0 and short["last_minute_peak"] is None
    assert short["mib_per_minute"] is None
    gone = memory_summary([(t, 600.0) for t in range(0, 400, 5)] + [(400.0, None), (405.0, None)])  # killed at 400 s
    assert gone["end"] is None and gone["last_minute_peak"] == 600.0 and gone["mib_per_minute"] == 0.0
    brief = memory_summary([(t, 600.0 + t) for t in range(0, 200, 5)])  # 2 minutes past the first: no trend yet
    assert brief["mib_per_minute"] is None and brief["last_minute_peak"] == 795.0
    assert memory_summary([(0.0, None)])["start"] is None


def test_end_session_waits_out_a_call_that_still_holds_the_session(local_stack):
    """EndSession refused ABORTED "in use" (a call still runs on the session; after an
    orchestrator's death, its cut call until the lease lapses) is sent again until the call
    ends, as the refusal says, not counted as the soak's error: a chaos CI run failed on one."""
    import grpc

    from localstack.soak import Front, Tally, end_session
    from specdec.v1 import orchestrator_pb2 as pb

    async def run() -> tuple[Tally, int]:
        front = Front(local_stack)
        _, stub = front.stub()
        first = await stub.Generate(pb.GenerateRequest(prompt="def main(", max_new_tokens=4, keep_session=True),
                                    timeout=60)
        long = pb.GenerateRequest(prompt="\n", max_new_tokens=400, session_id=first.session_id, keep_session=True,
                                  ignore_eos=True)
        stream = stub.GenerateStream(long, timeout=120)
        await stream.read()  # the call holds the session now
        tally = Tally()
        ending = asyncio.create_task(end_session(front, first.session_id, tally, 30))
        tokens = 0
        while (chunk := await stream.read()) is not grpc.aio.EOF:
            tokens += len(chunk.token_ids)
        await ending
        await front.close()
        return tally, tokens

    tally, tokens = asyncio.run(run())
    assert tokens > 0 and not tally.errors, tally.errors
