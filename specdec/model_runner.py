"""Runs one causal LM over many sessions' KV caches in a single packed forward pass.

The Hugging Face model supplies the weights and its own modules (embeddings, norms,
projections, MLP, rotary embedding); only attention is ours, so that sessions of
different lengths share one pass with no padding: the new tokens of all sessions are
packed into one sequence for every matrix product, and attention runs per session
against that session's cache views. Llama-family architectures (Llama, Mistral, Qwen2,
Qwen3) are supported.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from specdec.kv_cache import KVCache


@dataclass
class ForwardItem:
    cache: KVCache
    tokens: torch.Tensor  # [n] int64 new tokens, written at cache.length ..
    logits_rows: int  # how many trailing positions need logits (1 .. n)


def column_major_linears(model: torch.nn.Module) -> None:
    """Store every linear weight as the transpose of a contiguous [in, out] matrix.

    A decode step on a CPU multiplies a few rows by each weight, so it is bound by how
    fast the weight streams from memory; the BLAS kernel reads a column-major weight in
    one pass and a row-major one in strided blocks. Measured on the 2-core CPU: a cold
    256→768 linear at one row, 116 µs → 69 µs; a whole target step, 9.9 ms → 8.7 ms.
    Values are unchanged (the same numbers, laid out differently), and so are the HF
    modules that use them.
    """
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.weight.is_contiguous():
            module.weight.data = module.weight.data.t().contiguous().t()


class ModelRunner:
    """Owns the model; knows nothing of sessions, sampling or the network."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model.eval()
        if next(model.parameters()).device.type == "cpu":
            column_major_linears(model)
        cfg = model.config
        self.config = cfg
        self.layers = model.model.layers
        self.num_heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.max_length = cfg.max_position_embeddings
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        attn = self.layers[0].self_attn
        self.scaling = getattr(attn, "scaling", self.head_dim**-0.5)
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True) \
                and cfg.model_type in ("mistral", "qwen2") and cfg.sliding_window < self.max_length:
            self.max_length = cfg.sliding_window  # stay inside full attention

    def new_cache(self) -> KVCache:
        return KVCache(len(self.layers), self.kv_heads, self.head_dim, dtype=self.dtype,
                       device=self.device, max_length=self.max_length)

    def bytes_per_token(self) -> int:
        return 2 * len(self.layers) * self.kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8

    @torch.inference_mode()
    def forward(self, items: list[ForwardItem]) -> list[torch.Tensor]:
        """Feed each item's tokens and return, per item, [logits_rows, vocab] float32 logits."""
        starts = [it.cache.length for it in items]
        lengths = [int(it.tokens.shape[0]) for it in items]
        for it, s, n in zip(items, starts, lengths):
            it.cache.reserve(s + n)
        ids = torch.cat([it.tokens for it in items]).to(self.device)  # [N]
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)]).to(self.device)
        x = self.model.model.embed_tokens(ids)[None]  # [1, N, hidden]
        cos, sin = self.model.model.rotary_emb(x, positions[None])
        for layer_idx, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            attn_out = self._attention(layer.self_attn, layer_idx, h, cos, sin, items, starts, lengths)
            x = x + attn_out
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        ends = torch.tensor(lengths).cumsum(0).tolist()
        rows = torch.cat([torch.arange(e - it.logits_rows, e) for e, it in zip(ends, items)]).to(self.device)
        hidden = self.model.model.norm(x[0, rows])  # [R, hidden]
        logits = self.model.lm_head(hidden).float()  # [R, vocab]
        for it, s, n in zip(items, starts, lengths):
            it.cache.length = s + n
        return list(logits.split([it.logits_rows for it in items]))

    def _attention(self, attn, layer_idx, h, cos, sin, items, starts, lengths) -> torch.Tensor:
        N = h.shape[1]
        q = attn.q_proj(h).view(1, N, self.num_heads, self.head_dim)
        k = attn.k_proj(h).view(1, N, self.kv_heads, self.head_dim)
        v = attn.v_proj(h).view(1, N, self.kv_heads, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [1, heads, N, dim]
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out = torch.empty_like(q)
        offset = 0
        for it, s, n in zip(items, starts, lengths):
            it.cache.write(layer_idx, s, k[0, :, offset : offset + n], v[0, :, offset : offset + n])
            keys, values = it.cache.view(layer_idx, s + n)  # [kv_heads, s+n, dim]
            mask = None
            if n > 1:  # causal, with the new queries at the end of the sequence
                mask = torch.arange(s + n, device=h.device)[None] <= torch.arange(s, s + n, device=h.device)[:, None]
            out[:, :, offset : offset + n] = F.scaled_dot_product_attention(
                q[:, :, offset : offset + n], keys[None], values[None], attn_mask=mask,
                scale=self.scaling, enable_gqa=self.kv_heads != self.num_heads)
            offset += n
        return attn.o_proj(out.transpose(1, 2).reshape(1, N, self.num_heads * self.head_dim))
