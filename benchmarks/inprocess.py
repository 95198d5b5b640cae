"""The in-process systems: (a) Hugging Face generate() with the target alone, (b) Hugging
Face assisted generation with the draft, (c) our speculative loop over the same weights.

(a) at concurrency c > 1 runs HF generate() on left-padded batches of c requests (one
seed per batch when sampling); each request's time is its batch's time. Tokens after a
request's EOS (HF pads finished rows) are not counted. (b) and (c) run one request at a
time: HF assisted generation supports batch 1 only, and our loop is a single session.
(b) uses num_assistant_tokens = γ with the "constant" schedule and the confidence
threshold off (transformers' defaults are 20 tokens, a heuristic schedule and a 0.4
threshold), so that (b) and (c) draft the same γ. Sampling is plain temperature 1:
top_k=0, top_p=1.0 (generate() would default to top_k=50).
"""
from __future__ import annotations

import time
import uuid

import torch

from benchmarks.costs import sync_device
from benchmarks.runs import MODES, Request, RunResult, cut_at_eos, tried_tokens
from benchmarks.wire_meter import MeteredDraft, MeteredTarget, WireLog, WireModel
from draft_service.engine import DraftEngine
from specdec.model_runner import ModelRunner
from specdec.sampling import SamplingParams
from specdec.spec_loop import generate
from target_service.engine import TargetEngine


def _sampling_kwargs(params: SamplingParams) -> dict:
    if params.greedy:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p,
            "min_p": params.min_p or None}


def _left_padded(batch: list[Request], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r.prompt_ids) for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, r in enumerate(batch):
        ids[i, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
        mask[i, width - len(r.prompt_ids):] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def hf_generate(target, batch: list[Request], params: SamplingParams, max_new: int, eos_id: int | None,
                pad_id: int, assistant=None) -> list[list[int]]:
    """One HF generate() call over a left-padded batch → each request's new tokens."""
    ids, mask = _left_padded(batch, pad_id, next(target.parameters()).device)
    torch.manual_seed(batch[0].seed)
    out = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=0,
                          pad_token_id=pad_id, eos_token_id=eos_id, assistant_model=assistant,
                          **_sampling_kwargs(params))
    return [cut_at_eos(row, eos_id) for row in out[:, ids.shape[1]:].tolist()]


def configure_assistant(draft, gamma: int) -> None:
    cfg = draft.generation_config
    cfg.num_assistant_tokens = gamma
    cfg.num_assistant_tokens_schedule = "constant"
    cfg.assistant_confidence_threshold = 0.0


def run_hf(target, requests: list[Request], mode: str, concurrency: int, max_new: int, eos_id, pad_id,
           assistant=None, gamma: int | None = None) -> RunResult:
    """(a) with assistant=None (batches of `concurrency`), (b) with the draft (batch 1)."""
    params = MODES[mode]
    if assistant is not None:
        assert concurrency == 1, "HF assisted generation supports batch 1 only"
        configure_assistant(assistant, gamma)
    res = RunResult("b" if assistant is not None else "a", mode, concurrency, gamma if assistant is not None else None)
    hf_generate(target, list(requests[:1]), params, min(8, max_new), eos_id, pad_id, assistant)  # warm-up
    t_run = time.perf_counter()
    for start in range(0, len(requests), concurrency):
        batch = list(requests[start:start + concurrency])
        sync_device(target.device)
        t0 = time.perf_counter()
        outs = hf_generate(target, batch, params, max_new, eos_id, pad_id, assistant)
        sync_device(target.device)
        ms = (time.perf_counter() - t0) * 1000
        for out in outs:
            res.add_request(out, ms)
    res.wall_s = time.perf_counter() - t_run
    return res


def build_engines(draft_model, target_model, draft_quantize: str = "none") -> tuple[DraftEngine, TargetEngine]:
    """Our engines over the very modules HF runs (shared weights: an int8 draft is quantised
    in place, so HF's assisted generation drafts with the same quantised model)."""
    return (DraftEngine(ModelRunner(draft_model, quantize=draft_quantize)),
            TargetEngine(ModelRunner(target_model)))


def _params(base: SamplingParams, seed: int) -> SamplingParams:
    return SamplingParams(base.temperature, base.top_k, base.top_p, seed)


def run_spec_loop(draft: DraftEngine, target: TargetEngine, requests: list[Request], mode: str, max_new: int,
                  eos_id, gamma: int) -> RunResult:
    """(c): specdec.spec_loop.generate, one request at a time, through the wire encoding."""
    generate(draft, target, list(requests[0].prompt_ids), MODES[mode], gamma, min(8, max_new), eos_id, "warm-up")
    res = RunResult("c", mode, 1, gamma, stage_ms={"draft": 0.0, "verify": 0.0}, tried=0)
    t_run = time.perf_counter()
    for r in requests:
        t0 = time.perf_counter()
        out = generate(draft, target, list(r.prompt_ids), _params(MODES[mode], r.seed), gamma, max_new, eos_id,
                       uuid.uuid4().hex)
        res.add_request(out.tokens, (time.perf_counter() - t0) * 1000)
        s = out.stats
        res.rounds += s.rounds
        res.drafted += s.drafted
        res.accepted += s.accepted
        res.target_passes += s.target_passes
        res.tried += tried_tokens(s.accepted_per_round, gamma, max_new)
        res.stage_ms["draft"] += s.draft_ms
        res.stage_ms["verify"] += s.verify_ms
    res.wall_s = time.perf_counter() - t_run
    return res


def measure_wire(draft: DraftEngine, target: TargetEngine, requests: list[Request], mode: str, max_new: int,
                 eos_id, gamma: int) -> WireModel | None:
    """The same requests again, untimed, with the messages of every round sized (wire_meter)."""
    log = WireLog()
    d, t = MeteredDraft(draft, log), MeteredTarget(target, log)
    for r in requests:
        generate(d, t, list(r.prompt_ids), _params(MODES[mode], r.seed), gamma, max_new, eos_id, uuid.uuid4().hex)
    return WireModel.fit(log)


def quiet_transformers() -> None:
    """No weight-loading bars, and no notices from inside assisted generation."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
