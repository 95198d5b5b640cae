"""A pool served in another dtype than the other: a bf16 target beside an fp32 draft.

The output law is the target's as the runner computes it, whatever the draft's
precision: the pipeline reproduces the in-process speculative loop over the same bf16
target and fp32 draft token for token (greedy, and seeded sampling at a fixed γ), and the
replicas report the dtype they serve in the registry. (Greedy output is not compared with
target-only decoding here: in bf16 a forward over five rows rounds differently from one
over one row, so near-ties can break differently; `make bench-bf16` counts how often.)"""
from __future__ import annotations

import json

import pytest
import torch

from draft_service.engine import DraftEngine
from localstack.stack import LocalStack
from specdec.model_runner import ModelRunner
from specdec.models import load_model
from specdec.quantize import resolve
from specdec.sampling import SamplingParams
from specdec.spec_loop import generate
from target_service.engine import TargetEngine
from tests.e2e.helpers import api, redis_client, request
from tests.stacks import started_stack, stopped

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def bf16_stack(bundled_paths):
    stack = started_stack(lambda: LocalStack(dtypes={"target": "bfloat16", "draft": "float32"}))
    yield stack
    stopped(stack)


@pytest.fixture(scope="module")
def bf16_engines(bundled_paths):
    cpu = torch.device("cpu")
    quantize = resolve("auto", cpu, torch.float32)  # the draft replica's default: w8a8 or int8 here
    return (DraftEngine(ModelRunner(load_model(bundled_paths[0], cpu, torch.float32), quantize=quantize)),
            TargetEngine(ModelRunner(load_model(bundled_paths[1], cpu, torch.bfloat16))))


def test_each_replica_reports_the_dtype_it_serves(bf16_stack):
    r = redis_client(bf16_stack)
    served = {rep.kind: json.loads(r.get(f"specdec:replica:{rep.kind}:{rep.address}"))["dtype"]
              for rep in bf16_stack.replicas}
    assert served == {"target": "bfloat16", "draft": "float32"}
    kernels = {rep.kind: json.loads(r.get(f"specdec:replica:{rep.kind}:{rep.address}"))["kernels"]
               for rep in bf16_stack.replicas}
    # the float16 checkpoint served in float32: 16-bit products (fastest at every row count
    # here) and the native attention; in bfloat16 neither applies, so MKL/oneDNN and SDPA
    assert kernels["draft"].startswith("products ") and "half" in kernels["draft"]
    auto = resolve("auto", torch.device("cpu"), torch.float32)  # w8a8 where the CPU has VNNI, else int8
    # --quantize auto, in float32; the compact kernel at every row count is batch-invariant
    draft_invariant = "; batch-invariant" if kernels["draft"].startswith("products 1+: half;") else ""
    assert kernels["draft"].endswith(f"; attention native{draft_invariant}; weights {auto}")
    # bf16 target: oneDNN/MKL pick their kernels by shape, SDPA takes the queries together
    assert "half" not in kernels["target"] and kernels["target"].endswith("; attention sdpa")


@pytest.mark.parametrize("temperature,seed", [(0.0, 0), (1.0, 41)])
def test_the_pipeline_reproduces_the_in_process_loop_over_a_bf16_target(bf16_stack, bf16_engines, tokenizer,
                                                                         heldout_prompts, temperature, seed):
    stub = api(bf16_stack.orchestrator_address)
    draft, target = bf16_engines
    for prompt in heldout_prompts[:3]:
        ids = tokenizer(prompt)["input_ids"]
        expected = generate(draft, target, ids, SamplingParams(temperature=temperature, seed=seed), 4, 40,
                            eos_id=tokenizer.eos_token_id)
        got = stub.Generate(request(prompt, 40, temperature, gamma=4, seed=seed), timeout=120)
        assert got.stats.drafted_tokens > 0
        assert list(got.token_ids) == expected.tokens
