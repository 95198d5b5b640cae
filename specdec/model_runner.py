"""Runs one causal LM over many sessions' KV caches in a single packed forward pass.

The Hugging Face model supplies the weights; the forward is ours, so that sessions of
different lengths share one pass with no padding: the new tokens of all sessions are
packed into one sequence for every matrix product, and attention runs per session
against that session's cache views. Llama-family architectures (Llama, Mistral, Qwen2,
Qwen3) are supported.

A decode step of a small model is bound by per-operator overhead and by streaming the
weights, not by arithmetic, so the forward is written for few operators: q/k/v are one
matrix product, gate/up another, RMSNorm is the fused kernel, the rotary embedding is
a table lookup and a roll, the causal mask a slice of a precomputed table. The numbers
are the ones Hugging Face's own modules compute (same operations in the same order;
tests/specdec/test_model_runner.py checks the logits), only with fewer dispatches.

On a CPU in float32, the products take the fastest kernel for their row count
(specdec.linear_kernels: MKL, oneDNN, or 16-bit weights where that loses nothing), and
attention is one call per layer for all sessions
(specdec/native/packed_attention.cpp): it writes each session's new keys and values into
that session's cache and attends from its rows to its own cache, with no padding or
gathering, where torch's SDPA takes a cache write, two views and a call per session and
layer. On a GPU it is paged (`attention="paged"`: the caches in blocks of one pool,
specdec.paged_cache, and one gather and SDPA call per layer for sessions of like lengths,
specdec.paged_attention), where a launch per session and layer costs more than the
gather's copy; on a CPU the gather costs about what the saved calls do (`python -m
benchmarks.attention_probe`, benchmarks/HISTORY.md, "One attention call per batch"), so
other dtypes and a CPU without the kernels take SDPA per session.
Where products and attention are both native and the layer is plain Llama, each layer is
one call of specdec/native/decoder_layer.cpp, and a forward whose rows all take the compact
products is one call of specdec/native/packed_model.cpp (embedding, layers, final norm and
head: the same kernels in the same order, so the same bits, without about 20 µs of Python
a step between them).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch
import torch.nn.functional as F

from specdec import native, paged_attention
from specdec.kv_cache import KVCache
from specdec.linear_kernels import KERNELS, KernelTable, Product, prepare
from specdec.paged_cache import BlockPool, PagedKVCache
from specdec.quantize import MODES as quantize_modes, quantize_linears_, w8a8_unavailable
from specdec.sampling import SamplingParams


HALF = KERNELS.index("half")


@dataclass
class ForwardItem:
    cache: KVCache | PagedKVCache
    tokens: torch.Tensor  # [n] int64 new tokens, written at cache.length ..
    logits_rows: int  # how many trailing positions need logits (1 .. n)


def _packed_ids(items: list[ForwardItem]) -> torch.Tensor:
    """The items' new tokens one after the other, [Σ n] (a lone item's own tensor)."""
    return items[0].tokens if len(items) == 1 else torch.cat([it.tokens for it in items])


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


def _fuse(linears: list[torch.nn.Linear], column_major: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One [Σout, in] weight for several linears that read the same input, and their
    modules re-pointed at views of it, so the model holds each weight once."""
    weights = [lin.weight for lin in linears]
    base = weights[0]
    rows = sum(w.shape[0] for w in weights)
    fused = getattr(linears[0], "_specdec_fused", None)
    if fused is None or fused.data_ptr() != base.data_ptr() or fused.shape[0] != rows:
        if column_major:
            fused = torch.empty(base.shape[1], rows, dtype=base.dtype, device=base.device).t()
        else:
            fused = torch.empty(rows, base.shape[1], dtype=base.dtype, device=base.device)
        offset = 0
        for lin in linears:
            n = lin.weight.shape[0]
            fused[offset : offset + n] = lin.weight.data
            lin.weight.data = fused[offset : offset + n]
            offset += n
        linears[0]._specdec_fused = fused
    bias = None
    if linears[0].bias is not None:
        bias = torch.cat([lin.bias.data for lin in linears])
    return fused, bias


@dataclass
class _Layer:
    """One decoder layer's tensors, as the packed forward uses them."""
    norm1: torch.Tensor
    qkv: Product  # weight [(heads + 2 kv_heads) × head_dim, hidden]
    q_norm: torch.Tensor | None  # Qwen3's per-head norms
    k_norm: torch.Tensor | None
    o: Product
    norm2: torch.Tensor
    gate_up: Product  # weight [2 × intermediate, hidden]
    down: Product

    def products(self) -> list[Product]:
        return [self.qkv, self.o, self.gate_up, self.down]


def aligned_mask(mask: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """[n, k] → [groups · n, k]: the mask once for each query head of a group, in a fresh
    buffer whose start and row stride are multiples of 8 elements. CUDA's memory-efficient
    attention, the SDPA kernel that takes a mask, refuses one whose data pointer is not
    16-byte aligned ("attn_bias_ptr is not correctly aligned"), as a slice of the band
    table that begins at an odd column is in 16 bits; torch pads a misaligned stride, not
    a misaligned start."""
    n, k = mask.shape
    buf = torch.empty(groups, n, -(-k // 8) * 8, dtype=mask.dtype, device=mask.device)
    buf[:, :, :k] = mask
    return buf.view(groups * n, -1)[:, :k]


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                      scale: float, fold: bool = False) -> torch.Tensor:
    """One session's attention: [H, n, D] queries over [KV, k, D] keys and values → [H, n,
    D], query head h reading kv head h ÷ (H ÷ KV) as SDPA's `enable_gqa` does. With `fold`
    (a GPU) the H ÷ KV query heads of a kv head become that many times n rows of one head
    instead, `mask` already repeated as many times (`aligned_mask`): on CUDA, SDPA with
    `enable_gqa` and a mask, as every verification of γ + 1 rows has, falls back to its math
    kernel, which copies the keys and values out to every query head and materialises the
    scores; folded, the memory-efficient kernel (a mask) or flash attention (none) takes
    it, the same sums for each row."""
    H, n, D = q.shape
    KV = keys.shape[0]
    if not fold or H == KV:
        return F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask, scale=scale,
                                              enable_gqa=KV != H)[0]
    rows = q.reshape(1, KV, (H // KV) * n, D)
    out = F.scaled_dot_product_attention(rows, keys[None], values[None], attn_mask=mask, scale=scale)
    return out.reshape(H, n, D)


class ModelRunner:
    """Owns the model; knows nothing of sessions, sampling or the network."""

    BAND = 64  # chunks up to this many tokens take their causal mask from a table

    def __init__(self, model: torch.nn.Module, linear_kernels: str = "auto", attention: str = "auto",
                 fuse_layers: bool = True, quantize: str = "none", whole_forward: bool = True) -> None:
        """`linear_kernels`: "auto" (on a CPU, time the product kernels this machine has at
        start-up and keep the fastest per row count; specdec.linear_kernels), or one kernel
        everywhere: "aten" (F.linear: MKL on a CPU, cuBLAS on a GPU), "onednn" (a CPU's
        packed products) or "half" (16-bit weights, where that loses nothing).
        `attention`: "native" (every session's attention of a layer in one call of
        specdec.native's packed_attention: float32 on a CPU), "sdpa" (torch's
        scaled_dot_product_attention per session), "paged" (paged caches in one pool,
        specdec.paged_cache, and a few calls a layer for the whole batch,
        specdec.paged_attention) or "auto" (native where it can run, else paged on a GPU
        and sdpa on a CPU).
        `fuse_layers`: where both are native (16-bit products, native attention, a plain
        Llama layer), run each layer as one call of specdec.native's decoder_layer, and
        with `whole_forward` a forward whose rows all take those products as one call of
        its PackedModel (the same bits; off only to measure what it saves).
        `quantize`: "int8" serves the model with int8 weights (specdec.quantize: a draft's
        option, never a target's, whose law is the output's); "w8a8" the same weights with
        the compact kernel's rows rounded to int8 too (8-bit dot products: a CPU with AVX-512
        VNNI); "none" as it is."""
        if quantize not in quantize_modes:
            raise ValueError(f"quantize must be one of {', '.join(quantize_modes)}, not {quantize!r}")
        self.model = model.eval()
        cfg = model.config
        self.config = cfg
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        if quantize == "w8a8" and (why := w8a8_unavailable(self.device, self.dtype)) is not None:
            raise ValueError(f"w8a8 cannot serve this model: {why}")
        column_major = self.device.type == "cpu"
        self.kernels = KernelTable()
        self._quantize = quantize
        self._int8 = quantize_linears_(model) if quantize != "none" else None  # before the fused copies
        self.layers = [self._layer(layer, column_major) for layer in model.model.layers]
        if column_major:
            column_major_linears(model)  # o, down and the LM head
        self._geometry(cfg)
        self.scaling = getattr(model.model.layers[0].self_attn, "scaling", self.head_dim**-0.5)
        self.eps = model.model.norm.variance_epsilon
        # the embedding, the final norm and the LM head called as functions: the modules'
        # own calls cost a dispatch through nn.Module each (about 75 µs a step for HF's
        # unfused RMSNorm here), for the same operations. These are the modules' own
        # Parameters, whose data column_major_linears (above) has already re-laid out.
        self.embed = model.model.embed_tokens.weight
        self.final_norm = model.model.norm.weight
        output = model.get_output_embeddings()
        self.head = self._product([output], column_major)
        self.vocab_size = output.weight.shape[0]
        self.kernel_timings = self._choose_kernels(linear_kernels)
        self.paged = attention == "paged" or (attention == "auto" and self.device.type != "cpu")
        self._packed_attention = None if self.paged else self._choose_attention(attention)
        self.act = F.silu if cfg.hidden_act == "silu" else model.model.layers[0].mlp.act_fn
        self._rope_tables()
        self._band = self._causal_band()
        # on a GPU, SDPA's kernels want grouped query heads folded and masks aligned
        # (`grouped_attention`, `aligned_mask`); a test turns this on to run that path here
        self.device_layout = self.device.type != "cpu"
        self.pool = BlockPool(len(self.layers), self.kv_heads, self.head_dim, dtype=self.dtype,
                              device=self.device) if self.paged else None
        self._decoder_layer = self._choose_fused(fuse_layers)
        self._final_rms_norm = None if self._decoder_layer is None else native.module().rms_norm
        self._whole = self._whole_model() if whole_forward else None
        # fixed from here on: the start-up log and every heartbeat's registry entry show it
        self.kernels_summary = f"products {self.kernels.describe()}; attention {self.attention}" + \
            ("; batch-invariant" if self.batch_invariant else "") + (f"; weights {quantize}" if quantize != "none" else "")

    def _geometry(self, cfg) -> None:
        """Heads, head size and the longest context served. A sliding-window model (Mistral,
        Qwen2) is served within its window only, where its attention is full attention."""
        self.num_heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.max_length = cfg.max_position_embeddings
        if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True) \
                and cfg.model_type in ("mistral", "qwen2") and cfg.sliding_window < self.max_length:
            self.max_length = cfg.sliding_window

    def _causal_band(self) -> torch.Tensor:
        """Query i of a chunk fed at position s sees keys j ≤ s + i, i.e. column j − s + L of
        band[i] is set where that is ≤ i + L: any chunk of up to BAND rows is one slice of it.
        Additive (0 where a key is seen, −inf where not): SDPA turns a boolean mask into this
        on every call, 12–14 % of a short chunk's attention here, for the same numbers."""
        L = self.max_length
        offsets = torch.arange(L + self.BAND, device=self.device) - L
        return self._additive(offsets[None, :] <= torch.arange(self.BAND, device=self.device)[:, None])

    def _layer(self, layer, column_major: bool) -> _Layer:
        a, mlp = layer.self_attn, layer.mlp
        qkv = self._product([a.q_proj, a.k_proj, a.v_proj], column_major)
        gate_up = self._product([mlp.gate_proj, mlp.up_proj], column_major)
        q_norm = a.q_norm.weight if hasattr(a, "q_norm") else None
        k_norm = a.k_norm.weight if hasattr(a, "k_norm") else None
        return _Layer(layer.input_layernorm.weight, qkv, q_norm, k_norm, self._product([a.o_proj], column_major),
                      layer.post_attention_layernorm.weight, gate_up, self._product([mlp.down_proj], column_major))

    def _product(self, linears: list[torch.nn.Linear], column_major: bool) -> Product:
        """One product over the linears (fused where several read the same input), with
        their int8 factors where the model was quantised."""
        if len(linears) == 1:
            weight, bias = linears[0].weight, linears[0].bias
        else:
            weight, bias = _fuse(linears, column_major)
        int8 = None
        if self._int8 is not None:
            factors = [self._int8[lin] for lin in linears]
            int8 = (torch.cat([q for q, _ in factors]), torch.cat([s for _, s in factors]))
        return Product(weight, bias, self.kernels, int8)

    def _choose_kernels(self, mode: str) -> dict[int, dict[str, float]]:
        """The kernel of every product by row count (specdec.linear_kernels); on a GPU, or
        where no other kernel can take the weights, every product is F.linear."""
        products = [p for layer in self.layers for p in layer.products()] + [self.head]
        return prepare(products, self.kernels, mode, self.device, self.dtype, int8_dot=self._quantize == "w8a8")

    def _choose_attention(self, mode: str):
        """specdec.native's packed_attention, or None for torch's SDPA per session."""
        if mode not in ("auto", "native", "sdpa", "paged"):
            raise ValueError(f"attention must be auto, native, sdpa or paged, not {mode!r}")
        fits = self.device.type == "cpu" and self.dtype == torch.float32
        if mode == "sdpa" or (mode == "auto" and not fits):
            return None
        if not fits:
            raise ValueError(f"native attention serves float32 models on a CPU, not {self.device.type} {self.dtype}")
        module = native.module()
        if module is None and mode == "native":
            raise ValueError(f"native attention did not build: {native.unavailable_reason()}")
        return None if module is None else module.packed_attention

    def _choose_fused(self, wanted: bool):
        """specdec.native's decoder_layer where every part of a layer has its native kernel
        and the layer is plain Llama (no biases, no per-head norms, SiLU, a static rotary
        table); None otherwise."""
        products = [p for layer in self.layers for p in layer.products()]
        plain = all(p.bias is None and p.half is not None for p in products) and \
            all(layer.q_norm is None for layer in self.layers) and self.act is F.silu and self.cos_table is not None
        if not wanted or self._packed_attention is None or not plain:
            return None
        return native.module().decoder_layer

    def _whole_model(self):
        """specdec.native's PackedModel over the fused layers, the tables and the head (the
        runner's own tensors): a forward whose tokens and logits rows both take the compact
        products is then one native call. None where the layers are not fused, the rotary
        table is not static or the head is not plain."""
        if self._decoder_layer is None or self.cos_table is None or self.head.half is None or self.head.bias is not None:
            return None
        layers = [[la.norm1, la.qkv.half, la.o.half, la.norm2, la.gate_up.half, la.down.half] for la in self.layers]
        return native.module().PackedModel(
            self.embed, self.cos_table.contiguous(), self.sin_table.contiguous(), layers,
            [la.qkv.weight.shape[0] for la in self.layers], [la.gate_up.weight.shape[0] for la in self.layers],
            self.final_norm, self.head.half, self.vocab_size, self.num_heads, self.kv_heads, self.scaling, self.eps)

    def _whole_takes(self, *row_counts: int) -> bool:
        """Whether the whole native forward runs forwards of these row counts: it exists and
        the compact products are every such count's kernel."""
        return self._whole is not None and all(self.kernels.kernel(n) == HALF for n in row_counts)

    @property
    def whole(self) -> bool:
        """Whether forwards whose rows all take the compact products are one native call."""
        return self._whole is not None

    @property
    def fused(self) -> bool:
        """Whether forwards whose rows take the 16-bit products run fused layers."""
        return self._decoder_layer is not None

    @property
    def attention(self) -> str:
        return "paged" if self.paged else "sdpa" if self._packed_attention is None else "native"

    @property
    def batch_invariant(self) -> bool:
        """Whether a session's logits are the same bits whatever else its forward holds (other
        sessions, the rest of a prompt's chunk): the compact products at every row count,
        which compute each row alone in one order, and native attention, which attends each
        query alone. Elsewhere a product's last bits move with its row count (MKL and
        oneDNN pick their kernels by shape) and SDPA's with the queries it takes together."""
        return self.kernels.used() == {"half"} and self.attention == "native"

    def _rope_tables(self) -> None:
        """cos and a sign-folded sin for every position: rotate_half(x) · sin equals
        roll(x, d/2) · [−sin₁, sin₂] exactly, so the rotation is four operators."""
        rotary = self.model.model.rotary_emb
        self._rope_static = getattr(rotary, "rope_type", "default") not in ("dynamic", "longrope")
        self.cos_table = self.sin_table = None
        if self._rope_static:
            positions = torch.arange(self.max_length, device=self.device)
            self.cos_table, self.sin_table = self._rope(positions)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probe = torch.empty(0, dtype=self.dtype, device=self.device)
        cos, sin = self.model.model.rotary_emb(probe, positions[None])
        half = self.head_dim // 2
        sin = torch.cat([-sin[0, :, :half], sin[0, :, half:]], -1)
        return cos[0], sin

    def new_cache(self) -> KVCache | PagedKVCache:
        if self.paged:
            return PagedKVCache(self.pool, self.max_length)
        return KVCache(len(self.layers), self.kv_heads, self.head_dim, dtype=self.dtype,
                       device=self.device, max_length=self.max_length)

    def bytes_per_token(self) -> int:
        return 2 * len(self.layers) * self.kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8

    def forward(self, items: list[ForwardItem]) -> list[torch.Tensor]:
        """Feed each item's tokens and return, per item, [logits_rows, vocab] float32 logits."""
        return list(self.forward_packed(items).split([it.logits_rows for it in items]))

    @torch.inference_mode()
    def forward_packed(self, items: list[ForwardItem]) -> torch.Tensor:
        """`forward`, with the logits of all items as one [Σ logits_rows, vocab] tensor, in
        item order: what a caller that treats the rows as a batch wants."""
        starts = [it.cache.length for it in items]
        lengths = [int(it.tokens.shape[0]) for it in items]
        for it, s, n in zip(items, starts, lengths):
            it.cache.reserve(s + n)
        wanted = [it.logits_rows for it in items]
        if self._whole_takes(sum(lengths), sum(wanted)):
            logits = self._whole.forward(_packed_ids(items), [it.cache.kv for it in items], starts, lengths, wanted)
            for it, s, n in zip(items, starts, lengths):
                it.cache.length = s + n
            return logits
        ids = _packed_ids(items).to(self.device)  # [N]
        if len(items) == 1:
            positions = slice(starts[0], starts[0] + lengths[0])
        else:
            positions = torch.tensor([p for s, n in zip(starts, lengths) for p in range(s, s + n)],
                                     device=self.device)
        cos, sin = self._rotation(positions)
        masks, kvs = self._attention_inputs(items, starts, lengths)
        x = F.embedding(ids, self.embed)  # [N, hidden]
        fused = self._decoder_layer is not None and self.kernels.kernel(x.shape[0]) == HALF
        if fused:
            cos, sin = cos[:, 0], sin[:, 0]  # [N, head_dim]
            for index, layer in enumerate(self.layers):  # each layer one native call
                x = self._decoder_layer(x, layer.norm1, layer.qkv.half, layer.qkv.weight.shape[0], layer.o.half,
                                        layer.norm2, layer.gate_up.half, layer.gate_up.weight.shape[0],
                                        layer.down.half, cos, sin, self.num_heads, self.kv_heads, kvs, starts,
                                        lengths, index, self.scaling, self.eps)
        else:
            for index, layer in enumerate(self.layers):
                h = F.rms_norm(x, x.shape[-1:], layer.norm1, self.eps)
                x = x + self._attention(layer, index, h, cos, sin, items, starts, lengths, masks, kvs)
                h = F.rms_norm(x, x.shape[-1:], layer.norm2, self.eps)
                gate, up = layer.gate_up(h).chunk(2, -1)
                x = x + layer.down(self.act(gate) * up)
        rows = [slice(e - it.logits_rows, e) for e, it in zip(accumulate(lengths), items)]
        last = x[rows[0]] if len(items) == 1 else torch.cat([x[r] for r in rows])
        if fused:  # the layers' own norm, one call (torch's composite costs ~18 µs a row of dispatch)
            last = self._final_rms_norm(last.contiguous(), self.final_norm, self.eps)
        else:
            last = F.rms_norm(last, last.shape[-1:], self.final_norm, self.eps)
        logits = self.head(last).float()  # [R, vocab]
        for it, s, n in zip(items, starts, lengths):
            it.cache.length = s + n
        return logits

    def _attention_inputs(self, items: list[ForwardItem], starts: list[int],
                          lengths: list[int]) -> tuple[object, list | None]:
        """→ (masks, kvs), what every layer of one forward's attention takes: a paged plan, each
        session's SDPA mask, or the caches' buffers for the native kernel. Made after the
        caches' reservations, which settle their blocks and buffers for this forward."""
        if self.paged:
            fold = self.num_heads // self.kv_heads if self.device_layout else 1
            return paged_attention.plan([it.cache for it in items], starts, lengths, self.BAND, fold,
                                        self.dtype, self.device), None
        if self._packed_attention is None:
            return [self._sdpa_mask(s, n) for s, n in zip(starts, lengths)], None
        return None, [it.cache.kv for it in items]

    @torch.inference_mode()
    def draft_greedy(self, items: list[ForwardItem], gammas: list[int], shapings: list | None = None
                     ) -> list[list[int]] | None:
        """Greedy drafting of gammas[i] tokens per item, every step in one native call
        (PackedModel.draft_greedy): the tokens `forward` and each row's argmax, fed back step
        by step, would give, without the Python of each step between. The caches then hold
        their items' tokens and all but the last drafted token, as a step-by-step loop
        leaves them. `shapings`: per item the kernels' Shaping of its logits
        (specdec.shaping.native_shaping) or None, each step's row shaped by the item's cache
        ids, its fed tokens and the tokens drafted before it. None where the whole forward is
        not native for every row count the steps take (then the caller steps itself)."""
        tokens = self._draft_natively(items, gammas, shapings, lambda *args: self._whole.draft_greedy(*args))
        return None if tokens is None else [row[:g] for row, g in zip(tokens.tolist(), gammas)]

    @torch.inference_mode()
    def draft_sampled(self, items: list[ForwardItem], gammas: list[int], law: SamplingParams,
                      uniforms: torch.Tensor, shapings: list | None = None
                      ) -> tuple[list[list[int]], list[torch.Tensor]] | None:
        """Sampled drafting under one law (`law`'s temperature, top-k, top-p and min-p), every
        step in one native call (PackedModel.draft_sampled): per step the logits (shaped as
        `draft_greedy` shapes them) through sampling.logits_to_probs' operators, rounded to
        fp16 (wire.quantize), and item i's token drawn from those at uniforms[i, step]
        (sampling.sample_from), as DraftEngine's step loop draws, to the bit. → (tokens, q
        [γ_i, vocab] float32) per item, caches as `draft_greedy` leaves them; None where the
        whole forward is not native (then the caller steps itself)."""
        out = self._draft_natively(items, gammas, shapings, lambda *args: self._whole.draft_sampled(
            *args[:5], float(law.temperature), int(law.top_k), float(law.top_p), float(law.min_p), uniforms,
            *args[5:]))
        if out is None:
            return None
        tokens, q = out
        return [row[:g] for row, g in zip(tokens.tolist(), gammas)], [q[i, :g] for i, g in enumerate(gammas)]

    def _draft_natively(self, items: list[ForwardItem], gammas: list[int], shapings: list | None, call):
        """`call`(ids, caches, starts, lengths, gammas, shapings, prefixes) for a native draft
        of every step, with room reserved in the caches and their lengths set after; None
        where the whole forward is not native for every row count the steps take."""
        lengths = [int(it.tokens.shape[0]) for it in items]
        if not items or not self._whole_takes(sum(lengths), *range(1, len(items) + 1)):
            return None
        starts = [it.cache.length for it in items]
        for it, s, n, g in zip(items, starts, lengths, gammas):
            it.cache.reserve(s + n + g - 1)
        laws, prefixes = self._shapings(items, starts, shapings)
        out = call(_packed_ids(items), [it.cache.kv for it in items], starts, lengths, gammas, laws, prefixes)
        for it, s, n, g in zip(items, starts, lengths, gammas):
            it.cache.length = s + n + g - 1
        return out

    @staticmethod
    def _shapings(items: list[ForwardItem], starts: list[int], shapings: list | None) -> tuple[list, list]:
        """The native draft's shapings and prefixes: none where no item shapes, else one of
        each per item (an empty Shaping and prefix for an item that does not)."""
        if not shapings or all(s is None for s in shapings):
            return [], []
        kernels = native.module()
        empty = torch.empty(0, dtype=torch.long)
        prefixes = [empty if law is None else
                    torch.from_numpy(np.concatenate([it.cache.ids[:s], it.tokens.numpy()]).astype(np.int64, copy=False))
                    for it, s, law in zip(items, starts, shapings)]
        return [kernels.Shaping() if law is None else law for law in shapings], prefixes

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        return torch.zeros(allowed.shape, dtype=self.dtype, device=self.device).masked_fill_(~allowed, float("-inf"))

    def _mask(self, start: int, n: int) -> torch.Tensor | None:
        """[n, start + n] additive causal mask of a chunk fed at `start` (None for one token)."""
        if n == 1:
            return None
        if n <= self.BAND:
            L = self.max_length
            return self._band[:n, L - start : L + n]
        keys = torch.arange(start + n, device=self.device)
        return self._additive(keys[None] <= torch.arange(start, start + n, device=self.device)[:, None])

    def _sdpa_mask(self, start: int, n: int) -> torch.Tensor | None:
        """`_mask` as this device's SDPA takes it: as it is on a CPU; with `device_layout`
        (a GPU) repeated for the query heads of a group (`grouped_attention` folds them
        into rows) in a fresh aligned buffer (`aligned_mask`)."""
        mask = self._mask(start, n)
        if mask is None or not self.device_layout:
            return mask
        return aligned_mask(mask, self.num_heads // self.kv_heads)

    def _rotation(self, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, 1, head_dim] cos and sign-folded sin for the fed positions."""
        if self._rope_static:
            cos, sin = self.cos_table[positions], self.sin_table[positions]
        else:
            if isinstance(positions, slice):
                positions = torch.arange(positions.start, positions.stop, device=self.device)
            cos, sin = self._rope(positions)
        return cos[:, None], sin[:, None]

    def _attention(self, layer: _Layer, index, h, cos, sin, items, starts, lengths, masks, kvs) -> torch.Tensor:
        N, H, KV, D = h.shape[0], self.num_heads, self.kv_heads, self.head_dim
        qkv = layer.qkv(h).view(N, H + 2 * KV, D)
        qk = qkv[:, : H + KV]
        if layer.q_norm is not None:  # Qwen3: RMSNorm over each head before the rotation
            qk.copy_(torch.cat([F.rms_norm(qk[:, :H], (D,), layer.q_norm, self.eps),
                                F.rms_norm(qk[:, H:], (D,), layer.k_norm, self.eps)], 1))
        # the rotary embedding of q and k, in place: qkv then holds each token's keys and
        # values side by side, as the cache stores them (one write per session and layer).
        # The same operators as qk · cos + roll(qk) · sin, so the same numbers.
        turned = qk.roll(D // 2, -1).mul_(sin)
        qk.mul_(cos).add_(turned)
        if kvs is not None:  # every session's cache write and attention in one native call
            out = self._packed_attention(qkv, H, KV, kvs, starts, lengths, index, self.scaling)
            return layer.o(out)
        if self.paged:  # `masks` is the forward's paged_attention.Plan
            return layer.o(paged_attention.attend(self.pool.kv[index], qkv, H, KV, masks, self.scaling,
                                                  self.device_layout))
        kv = qkv[:, H:].transpose(0, 1)  # [2 × kv_heads, N, dim]
        q = qk[:, :H].transpose(0, 1)  # [heads, N, dim]
        if len(items) == 1:
            qs, kvs = (q[None],), (kv,)
        else:  # one split per tensor: the views of every session in one call
            qs, kvs = q[None].split(lengths, 2), kv.split(lengths, 1)
        outs = []
        for it, s, n, mask, qi, kvi in zip(items, starts, lengths, masks, qs, kvs):
            it.cache.write(index, s, kvi)
            keys, values = it.cache.view(index, s + n)  # [kv_heads, s+n, dim]
            outs.append(grouped_attention(qi[0], keys, values, mask, self.scaling,
                                          fold=self.device_layout))  # [heads, n, dim]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, 1)
        return layer.o(out.transpose(0, 1).reshape(N, H * D))
