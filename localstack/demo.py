"""The demo: a few held-out prompts streamed through the public API, each shown with its
stats, then decoded target-only through the same services for the speedup."""
from __future__ import annotations

import sys
import time

import grpc

from orchestrator.client import format_stats
from specdec.v1 import orchestrator_pb2 as pb
from specdec.v1 import orchestrator_pb2_grpc as pb_grpc

PROMPTS = [
    "def _read_config(path):\n    \"\"\"Read a configuration file and return a dict.\"\"\"\n",
    "class LRUCache:\n    def __init__(self, capacity):\n",
    "import os\nimport sys\n\n\ndef main(argv):\n",
]


def _stream(stub, prompt: str, max_new: int, gamma: int | None, show: bool) -> tuple[pb.GenerationStats, float]:
    req = pb.GenerateRequest(prompt=prompt, max_new_tokens=max_new, temperature=0.0)
    if gamma is not None:
        req.num_speculative_tokens = gamma
    t0 = time.perf_counter()
    stats = None
    for chunk in stub.GenerateStream(req, timeout=300):
        if show and chunk.text:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        if chunk.HasField("stats"):
            stats = chunk.stats
    return stats, time.perf_counter() - t0


def run_demo(address: str, max_new_tokens: int) -> int:
    stub = pb_grpc.OrchestratorStub(grpc.insecure_channel(address))
    _stream(stub, "import os\n", 8, None, False)  # warm up both replicas
    speedups = []
    for prompt in PROMPTS:
        print("\n" + "=" * 72 + "\n\033[1m" + prompt + "\033[0m", end="", flush=True)
        spec, t_spec = _stream(stub, prompt, max_new_tokens, None, True)
        base, t_base = _stream(stub, prompt, max_new_tokens, 0, False)
        speedup = (spec.generated_tokens / t_spec) / (base.generated_tokens / t_base)
        speedups.append(speedup)
        print(f"\n--- speculative (adaptive γ): {format_stats(spec)}")
        print(f"--- target-only through the same services: {base.generated_tokens / t_base:.1f} tok/s, first after "
              f"{base.times.first_token_ms:.0f} ms; speedup {speedup:.2f}x")
    print(f"\nmean speedup over target-only decoding: {sum(speedups) / len(speedups):.2f}x (greedy, one stream)")
    return 0
