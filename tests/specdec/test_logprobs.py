"""The pure log-probability functions (specdec/logprobs.py)."""
import math

import torch

from specdec import logprobs as lp
from specdec.sampling import SamplingParams, logits_to_probs


def test_chosen_and_top_log_probabilities_are_the_log_softmax_of_the_rows():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=g) * 3
    tokens = torch.tensor([7, 0, 49, 21])
    chosen, ids, values = lp.token_logprobs(logits, tokens, top=5)
    probs = torch.softmax(logits.double(), -1)
    for i, t in enumerate(tokens.tolist()):
        assert math.isclose(chosen[i].item(), math.log(probs[i, t].item()), abs_tol=1e-5)
        order = probs[i].argsort(descending=True)[:5]
        assert ids[i].tolist() == order.tolist()
        assert torch.allclose(values[i].double(), probs[i, order].log(), atol=1e-5)
    assert ids.dtype == torch.int32 and values.dtype == chosen.dtype == torch.float32


def test_no_top_gives_empty_columns_and_bf16_rows_are_read_in_float32():
    logits = torch.tensor([[1.0, 2.0, 3.0]], dtype=torch.bfloat16)
    chosen, ids, values = lp.token_logprobs(logits, torch.tensor([2]))
    assert ids.shape == values.shape == (1, 0)
    assert chosen.dtype == torch.float32
    assert math.isclose(chosen.item(), 3 - math.log(math.exp(1) + math.exp(2) + math.exp(3)), abs_tol=1e-6)


def test_processed_rows_are_the_sampled_laws_in_log_space():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2)) * 2
    laws = [SamplingParams(0.7, top_k=10, min_p=0.1), SamplingParams(0.0), SamplingParams(1.0, top_p=0.8)]
    rows = lp.processed_rows(logits, laws)
    for row, law, raw in zip(rows, laws, logits):
        assert torch.allclose(row.exp(), logits_to_probs(raw, law), atol=1e-6)
    assert (rows[1] == 0).sum() == 1 and rows[1].argmax() == logits[1].argmax() and torch.isinf(rows[1]).sum() == 49
    # as logits: their log-softmax is themselves, so token_logprobs reports the laws' numbers
    chosen, ids, values = lp.token_logprobs(rows, logits.argmax(-1), 2)
    assert torch.allclose(chosen, rows.gather(1, logits.argmax(-1, keepdim=True)).view(-1), atol=1e-6)
    assert torch.isinf(values[1, 1]) and values[1, 0] == 0
