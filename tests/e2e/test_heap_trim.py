"""A replica gives the memory it has freed back between batches (--heap-trim-seconds,
specdec/heap_trim.py), and says so in its /metrics."""
from __future__ import annotations

import platform
import signal
import time

import grpc
import pytest

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")]


def _trims(port: int) -> float:
    from localstack.stack import scrape_metrics

    return scrape_metrics(port).get('specdec_replica_heap_trim_seconds_count{pool="target"}', 0.0)


def test_an_idle_replica_trims_its_heap_once_an_interval_and_not_when_told_not_to(local_stack, tokenizer):
    from localstack.stack import free_port
    from specdec.internal.v1 import replica_pb2 as rpb
    from specdec.internal.v1 import replica_pb2_grpc as rpb_grpc

    ports = {trim: free_port() for trim in ("1", "0")}
    reps = {trim: local_stack.start_replica("target", extra=["--heap-trim-seconds", trim,
                                                             "--metrics-port", str(port)])
            for trim, port in ports.items()}
    try:
        prompt = tokenizer("def main(")["input_ids"]
        for trim, rep in reps.items():  # a session, so that each has freed something
            with grpc.insecure_channel(rep.address) as channel:
                cache = rpb.CacheRef(session_id=f"trim-{trim}", epoch=1, start=0, tokens=prompt)
                rpb_grpc.TargetStub(channel).Verify(
                    rpb.VerifyRequest(cache=cache, sampling=rpb.SamplingParams(temperature=0.0, top_p=1.0)),
                    timeout=30)
        deadline = time.monotonic() + 20  # an interval of 1 s, checked at each heartbeat (every 2 s)
        while _trims(ports["1"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _trims(ports["1"]) >= 2
        assert _trims(ports["0"]) == 0
    finally:
        for rep in reps.values():
            local_stack.replicas.remove(rep)
            local_stack.kill(rep, signal.SIGTERM)
