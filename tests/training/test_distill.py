"""The draft-distillation pieces: growing a draft keeps its function, and the loss is the
quantity speculative decoding pays for (1 − α = TV(p, q))."""
import torch
from transformers import LlamaForCausalLM

from training.distill import alpha_loss, grow


def test_grown_draft_computes_the_same_logits(bundled_paths):
    draft = LlamaForCausalLM.from_pretrained(bundled_paths[0], dtype=torch.float32).eval()
    ids = torch.randint(0, draft.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = draft(input_ids=ids).logits
        grown = grow(draft, draft.config.num_hidden_layers + 1).eval()
        after = grown(input_ids=ids).logits
    assert grown.config.num_hidden_layers == len(grown.model.layers)
    assert torch.allclose(before, after, atol=1e-5)
    assert any(p.abs().sum() > 0 for p in grown.model.layers[-1].parameters())  # new, trainable, not empty


def test_alpha_loss_is_total_variation():
    gen = torch.Generator().manual_seed(1)
    t_logits, d_logits = torch.randn(3, 5, 17, generator=gen), torch.randn(3, 5, 17, generator=gen)
    p, q = t_logits.softmax(-1), d_logits.softmax(-1)
    alpha = torch.minimum(p, q).sum(-1).mean()
    assert torch.allclose(alpha_loss(d_logits, t_logits, kl_weight=0.0), 1 - alpha, atol=1e-6)
    assert alpha_loss(t_logits, t_logits, kl_weight=0.1).abs() < 1e-6  # zero exactly when q = p
    assert alpha_loss(d_logits, t_logits, kl_weight=0.1) > alpha_loss(d_logits, t_logits, kl_weight=0.0)
