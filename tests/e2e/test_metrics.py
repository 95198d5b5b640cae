"""Prometheus metrics are exported by the orchestrator and the replicas."""
from __future__ import annotations

import grpc
import pytest

from localstack.stack import free_port, scrape_metrics
from specdec.internal.v1 import replica_pb2, replica_pb2_grpc
from tests.e2e.helpers import api, request

pytestmark = pytest.mark.e2e


def test_metrics_count_rounds_acceptance_and_cache(local_stack):
    orch_port, target_port = free_port(), free_port()
    orch = local_stack.start_orchestrator(extra=["--metrics-port", str(orch_port)])
    target = local_stack.start_replica("target", extra=["--metrics-port", str(target_port), "--max-sessions", "1"])
    try:
        r = api(orch.address).Generate(request("def area(r):\n", 24, 0.0, gamma=4), timeout=120)
        chunks = list(api(orch.address).GenerateStream(request("def area(r):\n", 24, 0.0), timeout=120))
        times = chunks[-1].stats.times
        assert 0 < times.first_token_ms < times.total_ms  # the first chunk left before the last
        assert 0 < r.stats.times.first_token_ms <= r.stats.times.total_ms
        m = scrape_metrics(orch_port)
        # latencies of the two requests: whole calls, the stream's first chunk, per later token
        assert m['specdec_request_seconds_count{method="Generate"}'] == 1
        assert m['specdec_request_seconds_count{method="GenerateStream"}'] == 1
        assert m["specdec_time_to_first_token_seconds_count"] == 1  # streams only
        assert m["specdec_time_to_first_token_seconds_sum"] == pytest.approx(times.first_token_ms / 1000)
        per_token = (times.total_ms - times.first_token_ms) / (len(sum((list(c.token_ids) for c in chunks), [])) - 1)
        assert m['specdec_time_per_output_token_seconds_sum{method="GenerateStream"}'] == pytest.approx(per_token / 1000)
        assert m['specdec_time_per_output_token_seconds_count{method="Generate"}'] == 1
        assert m["specdec_rounds_total"] >= r.stats.rounds
        # every round's commit reached Redis, each alone in its write (one generation at a time)
        rounds = r.stats.rounds + chunks[-1].stats.rounds
        assert m["specdec_redis_commit_batch_size_sum"] == rounds
        assert m["specdec_redis_commit_batch_size_count"] == rounds
        assert m["specdec_drafted_tokens_total"] >= r.stats.drafted_tokens > 0
        assert m['specdec_drafted_at_position_total{position="0"}'] >= 1
        assert 'specdec_requests_total{code="OK",method="Generate"}' in m
        assert m["specdec_gamma_count"] >= r.stats.rounds
        assert "specdec_stage_seconds_bucket{le=\"0.01\",stage=\"verify\"}" in m
        # the policy's view of the target forward: γ = 4 alone feeds 5 rows a round
        assert m['specdec_target_forward_ms{rows="5"}'] > 0
        # one generation: one round stream to each pool, for all its rounds, over the
        # replicas' frame links (--internal-calls frames, the default)
        assert m['specdec_internal_streams_opened_total{pool="draft"}'] == 1
        assert m['specdec_internal_streams_opened_total{pool="target"}'] == 1
        assert m['specdec_frame_links_opened_total{pool="draft"}'] == 1
        assert m['specdec_frame_links_opened_total{pool="target"}'] == 1
        stub = replica_pb2_grpc.TargetStub(grpc.insecure_channel(target.address))
        for session in ("metrics-a", "metrics-b"):  # room for one: the second evicts the first
            stub.Verify(replica_pb2.VerifyRequest(
                cache=replica_pb2.CacheRef(session_id=session, epoch=1, start=0, tokens=[5, 6, 7]),
                sampling=replica_pb2.SamplingParams(temperature=0.0, top_p=1.0)), timeout=60)
        replica = scrape_metrics(target_port)
        assert replica['specdec_replica_sessions{pool="target"}'] >= 0  # follows the heartbeat
        assert 'specdec_replica_queue_length{pool="target"}' in replica
        assert replica['specdec_batch_size_count{pool="target"}'] >= 2
        assert replica['specdec_engine_seconds_count{pool="target"}'] >= 2
        assert replica['specdec_engine_seconds_sum{pool="target"}'] > 0
        assert replica['specdec_replica_evictions_total{pool="target"}'] >= 1
        assert 'specdec_batch_hold_seconds_count{pool="target"}' in replica
        # both processes froze their start-up heap out of the cyclic collector before serving:
        # the replica's torch, transformers and model, the orchestrator's transformers and
        # tokenizer (it runs without torch: 93,139 objects in the run that set this bound)
        assert replica["specdec_gc_frozen_objects"] > 100_000
        assert m["specdec_gc_frozen_objects"] > 50_000
    finally:
        for rep, group in ((orch, local_stack.orchestrators), (target, local_stack.replicas)):
            local_stack.kill(rep, sig=15)
            group.remove(rep)
