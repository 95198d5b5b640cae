"""Replicas on paged caches (`--attention paged`, a GPU's default) through the whole stack:
greedy answers are the target's alone, a shared prompt's blocks are reused, seeded sampling
repeats (the pool under a --max-cache-mb budget, as sized at start)."""
from __future__ import annotations

import json
import signal
import time

import pytest

from localstack.stack import LocalStack
from tests.e2e.helpers import api, load_report, redis_client, request, stream
from tests.e2e.test_pipeline import target_greedy
from tests.e2e.test_prefix_reuse import SYSTEM
from tests.stacks import started_stack, stopped

pytestmark = pytest.mark.e2e
GAUGE = 'specdec_replica_cache_pool_bytes{pool="target"}'


@pytest.fixture(scope="module")
def paged_stack(bundled_paths):
    stack = started_stack(lambda: LocalStack(extra_env={"SPECDEC_ATTENTION": "paged", "SPECDEC_MAX_CACHE_MB": "16"}))
    yield stack
    stopped(stack)


def test_paged_replicas_answer_as_the_target_alone_and_share_a_prompts_blocks(paged_stack, target_model, tokenizer):
    r = redis_client(paged_stack)
    for rep in paged_stack.replicas:
        entry = json.loads(r.get(f"specdec:replica:{rep.kind}:{rep.address}"))
        assert "; attention paged" in entry["kernels"], entry
    stub = api(paged_stack.orchestrator_address)
    prompts = [SYSTEM + q for q in ("def median(xs):\n", "class LRU:\n")]
    first = stub.Generate(request(prompts[0], 32, 0.0, gamma=4), timeout=120)
    target = first.stats.target_replica
    before = load_report(target, "target").prefill_tokens
    second = stub.Generate(request(prompts[1], 32, 0.0, gamma=4), timeout=120)
    fed = load_report(target, "target").prefill_tokens - before
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    assert list(first.token_ids) == target_greedy(target_model, ids[0], 32, tokenizer.eos_token_id)
    assert list(second.token_ids) == target_greedy(target_model, ids[1], 32, tokenizer.eos_token_id)
    shared = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)
    assert second.stats.target_replica == target and shared > 16
    # the prompt but its shared part, then each round's pending token and draft
    assert fed <= len(ids[1]) - shared + second.stats.drafted_tokens + second.stats.rounds
    assert stream(stub, request(prompts[1], 32, 0.0))[0] == list(second.token_ids)
    seeded = [stub.Generate(request(prompts[0], 24, 1.0, seed=11), timeout=120) for _ in range(2)]
    assert list(seeded[0].token_ids) == list(seeded[1].token_ids)


def test_a_paged_replica_reports_its_pool_beside_the_bytes_its_caches_hold(paged_stack):
    from localstack.stack import free_port, scrape_metrics

    port = free_port()
    rep = paged_stack.start_replica("target", wait=False, extra=["--metrics-port", str(port)])
    try:
        paged_stack.wait_serving(rep)
        deadline = time.monotonic() + 30
        while (metrics := scrape_metrics(port)).get(GAUGE) is None and time.monotonic() < deadline:
            time.sleep(0.2)  # set with the first heartbeat
        assert 15 * 2**20 < metrics[GAUGE] <= 16 * 2**20  # the budget's whole blocks, from the start
        assert metrics['specdec_replica_cache_bytes{pool="target"}'] == 0
    finally:
        rep.proc.send_signal(signal.SIGTERM)
        rep.proc.wait(30)
