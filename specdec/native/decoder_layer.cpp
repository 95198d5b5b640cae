// One Llama decoder layer of the packed forward as one call, for the common CPU case: every
// product over 16-bit weights (half_linear), attention native (packed_attention), SiLU, no
// biases and no per-head norms (specdec.model_runner decides). The runner's Python layer
// costs about 45 µs of operator dispatch at one row beside its products and attention
// (RMSNorm twice, the rotation's four operators, the residual adds, SiLU and its product);
// here those are loops over the rows, and the layer is one dispatch.
#include <torch/extension.h>
#include <cmath>
#include <cstring>
#include <vector>

#include "isa.h"
#include "kernels.h"

namespace {
namespace scalar {
#include "layer_ops.inc"
}
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
#include "layer_ops.inc"
}
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx512f")
namespace avx512 {
#include "layer_ops.inc"
}
#pragma GCC pop_options

struct Ops {
  void (*rms_norm)(const float*, const float*, float, int64_t, int64_t, float*);
  void (*rope)(float*, int64_t, int64_t, int64_t, int64_t, const float*, const float*);
  void (*silu_mul)(const float*, int64_t, int64_t, float*);
  void (*add)(float*, const float*, int64_t);
};

Ops ops_for(specdec::Isa isa) {
  if (isa == specdec::Isa::kAvx512) return {avx512::rms_norm_rows, avx512::rope_rows, avx512::silu_mul_rows, avx512::add_into};
  if (isa == specdec::Isa::kAvx2) return {avx2::rms_norm_rows, avx2::rope_rows, avx2::silu_mul_rows, avx2::add_into};
  return {scalar::rms_norm_rows, scalar::rope_rows, scalar::silu_mul_rows, scalar::add_into};
}

}  // namespace

// x [rows, hidden] float32 → the layer's output [rows, hidden]; cos/sin [rows, head_dim] for
// the rows' positions; weights packed by specdec.half_weights; caches as packed_attention's
torch::Tensor decoder_layer(torch::Tensor x, torch::Tensor norm1, torch::Tensor qkv_w, int64_t qkv_out,
                            torch::Tensor o_w, torch::Tensor norm2, torch::Tensor gate_up_w, int64_t gate_up_out,
                            torch::Tensor down_w, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t kv_heads,
                            std::vector<torch::Tensor> caches, std::vector<int64_t> starts, std::vector<int64_t> lengths,
                            int64_t layer, double scale, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "decoder_layer: x must be a contiguous float32 [rows, hidden] tensor");
  const int64_t rows = x.size(0), hidden = x.size(1), slots = heads + 2 * kv_heads;
  TORCH_CHECK(qkv_out % slots == 0, "decoder_layer: ", qkv_out, " q/k/v columns for ", slots, " head slots");
  const int64_t dim = qkv_out / slots, inter = gate_up_out / 2;
  TORCH_CHECK(dim <= 512 && dim % 2 == 0, "decoder_layer: head size ", dim, " is not supported");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == rows * dim && sin.numel() == rows * dim,
              "decoder_layer: cos and sin must be contiguous [rows, head_dim]");
  for (const auto& w : {norm1, norm2})
    TORCH_CHECK(w.scalar_type() == torch::kFloat32 && w.is_contiguous() && w.numel() == hidden,
                "decoder_layer: the norms' weights must be contiguous float32 of the hidden size");
  const Ops ops = ops_for(specdec::current_isa());
  auto h = torch::empty_like(x);
  ops.rms_norm(x.data_ptr<float>(), norm1.data_ptr<float>(), static_cast<float>(eps), rows, hidden, h.data_ptr<float>());
  auto qkv = half_linear(h, qkv_w, qkv_out, c10::nullopt);  // [rows, slots · dim]
  ops.rope(qkv.data_ptr<float>(), rows, qkv_out, heads + kv_heads, dim, cos.data_ptr<float>(), sin.data_ptr<float>());
  auto attended = packed_attention(qkv.view({rows, slots, dim}), heads, kv_heads, caches, starts, lengths, layer, scale);
  auto y = half_linear(attended, o_w, hidden, c10::nullopt);
  ops.add(y.data_ptr<float>(), x.data_ptr<float>(), rows * hidden);  // y = x + attention
  ops.rms_norm(y.data_ptr<float>(), norm2.data_ptr<float>(), static_cast<float>(eps), rows, hidden, h.data_ptr<float>());
  auto gate_up = half_linear(h, gate_up_w, gate_up_out, c10::nullopt);
  auto act = torch::empty({rows, inter}, x.options());
  ops.silu_mul(gate_up.data_ptr<float>(), rows, inter, act.data_ptr<float>());
  auto out = half_linear(act, down_w, hidden, c10::nullopt);
  ops.add(out.data_ptr<float>(), y.data_ptr<float>(), rows * hidden);  // out = y + MLP
  return out;
}

// The model's final norm over the rows the head reads, with the layers' own loop: torch's
// composite rms_norm costs about 18 µs of dispatch for one row of 256 on the 2-core CPU,
// a twentieth of a draft step.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "rms_norm: x must be a contiguous float32 [rows, hidden] tensor");
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.is_contiguous() && weight.numel() == x.size(1),
              "rms_norm: the weight must be contiguous float32 of the hidden size");
  auto out = torch::empty_like(x);
  ops_for(specdec::current_isa())
      .rms_norm(x.data_ptr<float>(), weight.data_ptr<float>(), static_cast<float>(eps), x.size(0), x.size(1),
                out.data_ptr<float>());
  return out;
}
