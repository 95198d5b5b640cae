"""The load governor (orchestrator/governor.py) in a running orchestrator: under 4 concurrent
adaptive streams it measures speculation both on and off, exports both rates, and the text
stays token-identical to target-only greedy while the mode flips mid-generation."""
from __future__ import annotations

import time

import pytest

from localstack.stack import free_port, scrape_metrics
from tests.e2e.helpers import Streams, api, request

pytestmark = pytest.mark.e2e

PROMPTS = ["def area(r):\n", "import os\n\ndef", "class Stack:\n", "for i in range("]


def _tokens(result) -> list[int]:
    assert not isinstance(result, Exception), result
    return result[0]


def test_governor_measures_both_modes_and_keeps_greedy_exact(local_stack):
    port = free_port()
    orch = local_stack.start_orchestrator(extra=["--metrics-port", str(port), "--load-governor", "on"])
    try:
        stub = api(orch.address)
        want = {p: list(stub.Generate(request(p, 40, 0.0, gamma=0), timeout=120).token_ids) for p in PROMPTS}
        key = 'specdec_load_governor{key="greedy,4,%s"}'
        deadline, m = time.monotonic() + 90, {}
        while time.monotonic() < deadline:  # a closed loop of 4 streams until both modes are measured
            streams = Streams(stub, [request(p, 40, 0.0) for p in PROMPTS])
            for p, result in zip(PROMPTS, streams.join()):
                assert _tokens(result) == want[p], f"governed greedy output differs from target-only for {p!r}"
            m = scrape_metrics(port)
            if key % "on_tokens_per_s" in m and key % "off_tokens_per_s" in m:
                break
        assert m.get(key % "on_tokens_per_s", 0) > 0, sorted(k for k in m if "governor" in k)
        assert m.get(key % "off_tokens_per_s", 0) > 0, sorted(k for k in m if "governor" in k)
        assert m[key % "speculating"] in (0.0, 1.0)
    finally:
        local_stack.kill(orch, sig=15)
        local_stack.orchestrators.remove(orch)


def test_governor_off_exports_nothing(local_stack):
    port = free_port()
    orch = local_stack.start_orchestrator(extra=["--metrics-port", str(port), "--load-governor", "off"])
    try:
        stub = api(orch.address)
        for result in Streams(stub, [request(p, 24, 1.0) for p in PROMPTS]).join():
            assert len(_tokens(result)) > 0
        assert not [k for k in scrape_metrics(port) if k.startswith("specdec_load_governor")]
    finally:
        local_stack.kill(orch, sig=15)
        local_stack.orchestrators.remove(orch)
