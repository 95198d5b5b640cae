// y = x · Wᵀ with int8 weights AND int8 activations, by the CPU's 8-bit dot products
// (AVX-512 VNNI: one vpdpbusd is 64 multiply-adds of unsigned by signed bytes into int32).
//
// Why: a quantised draft's step at one row is bound by how fast its weights widen to float32
// (half_linear.cpp's int8 panels: three instructions per 16 weights before the multiply-add),
// not by their bytes. Quantising each row of x too (one scale per row, symmetric, then + 128
// so that it is unsigned) lets the products run in integers, exactly, a fourth of the
// instructions per weight. The result is another draft numerically (specdec.quantize's
// "w8a8"); speculation stays exact, since the target checks every token against the
// distribution the draft drew it from.
//
// Layout (specdec.half_weights.pack_int8_dot), per panel of P = 64 output columns, bytes:
//   [in4 / 4][P][4]  the values, four consecutive inputs of a column in one int32 lane
//                    (in4 = in rounded up to a multiple of 4, padded with zeros)
//   [P] int32        128 · Σ_i w[j, i], the correction for the + 128 of the activations
//   [P] float32      the columns' weight scales
// so a panel is [in4 + 8, P] bytes and the tensor is uint8 [panels, in4 + 8, P] (uint8 marks
// this layout apart from the widening kernel's int8 panels).
//
// Per row r: s_r = max|x_r| / 127 (1 for a row of zeros), a_ri = round(x_ri / s_r) + 128, and
// y_rj = float(Σ_i a_ri · w_ji − 128 · Σ_i w_ji) · (s_r · scale_j). The sums are exact int32
// (|Σ| ≤ 127 · 127 · in) and convert to float exactly below in = 1,040.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <immintrin.h>
#include <vector>

#include "isa.h"
#include "kernels.h"

namespace {

constexpr int64_t kP = 64;
constexpr int kRows = 6;

bool cpu_has_vnni() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
  }();
  return has;
}

// each row of x → its scale and its unsigned bytes, padded to in4 with 128 (zero)
void quantize_rows(const float* x, int64_t rows, int64_t in, int64_t in4, uint8_t* xq, float* sx) {
  for (int64_t r = 0; r < rows; r++) {
    const float* xr = x + r * in;
    float amax = 0.f;
    for (int64_t i = 0; i < in; i++) amax = std::max(amax, std::fabs(xr[i]));
    const float s = amax > 0.f ? amax / 127.f : 1.f;
    sx[r] = s;
    uint8_t* q = xq + r * in4;
    for (int64_t i = 0; i < in; i++) {
      const float v = std::nearbyint(xr[i] / s);  // round half to even, as torch.round
      q[i] = static_cast<uint8_t>(static_cast<int32_t>(std::min(127.f, std::max(-127.f, v))) + 128);
    }
    for (int64_t i = in; i < in4; i++) q[i] = 128;
  }
}

// any CPU: one panel, all rows
void panel_scalar(const uint8_t* xq, const float* sx, int64_t rows, int64_t in4, const int8_t* w,
                  const int32_t* csum, const float* scale, float* y, int64_t ldy, int64_t cols) {
  for (int64_t r = 0; r < rows; r++) {
    const uint8_t* a = xq + r * in4;
    for (int64_t j = 0; j < cols; j++) {
      int32_t acc = 0;
      for (int64_t g = 0; g < in4 / 4; g++)
        for (int t = 0; t < 4; t++) acc += static_cast<int32_t>(a[4 * g + t]) * w[(g * kP + j) * 4 + t];
      y[r * ldy + j] = static_cast<float>(acc - csum[j]) * (sx[r] * scale[j]);
    }
  }
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vnni")
namespace vnni {

// quantize_rows with 16 lanes at a time (the plain loop calls libm's nearbyintf per value:
// 4 µs of a 5 µs product at 768 inputs); the conversion rounds half to even, as nearbyint
// under the default rounding mode, so both give the same bytes
void quantize_rows(const float* x, int64_t rows, int64_t in, int64_t in4, uint8_t* xq, float* sx) {
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127), bias = _mm512_set1_epi32(128);
  for (int64_t r = 0; r < rows; r++) {
    const float* xr = x + r * in;
    __m512 vmax = _mm512_setzero_ps();
    for (int64_t i = 0; i < in; i += 16) {
      const __mmask16 m = in - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (in - i)) - 1);
      vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_maskz_loadu_ps(m, xr + i)));
    }
    const float amax = _mm512_reduce_max_ps(vmax);
    const float s = amax > 0.f ? amax / 127.f : 1.f;
    sx[r] = s;
    const __m512 vs = _mm512_set1_ps(s);
    uint8_t* q = xq + r * in4;
    for (int64_t i = 0; i < in; i += 16) {
      const __mmask16 m = in - i >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (in - i)) - 1);
      __m512i v = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_maskz_loadu_ps(m, xr + i), vs));
      v = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(v, lo), hi), bias);
      _mm512_mask_cvtepi32_storeu_epi8(q + i, m, v);
    }
    for (int64_t i = in; i < in4; i++) q[i] = 128;
  }
}

template <int R>
void block(const uint8_t* xq, const float* sx, int64_t in4, const int8_t* w, const int32_t* csum,
           const float* scale, float* y, int64_t ldy, int64_t cols) {
  __m512i acc[R][4];
  for (int r = 0; r < R; r++)
    for (int v = 0; v < 4; v++) acc[r][v] = _mm512_setzero_si512();
  for (int64_t g = 0; g < in4 / 4; g++) {
    const int8_t* wg = w + g * kP * 4;
    const __m512i w0 = _mm512_loadu_si512(wg), w1 = _mm512_loadu_si512(wg + 64);
    const __m512i w2 = _mm512_loadu_si512(wg + 128), w3 = _mm512_loadu_si512(wg + 192);
    for (int r = 0; r < R; r++) {
      int32_t four;
      std::memcpy(&four, xq + r * in4 + 4 * g, sizeof four);
      const __m512i a = _mm512_set1_epi32(four);
      acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], a, w0);
      acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], a, w1);
      acc[r][2] = _mm512_dpbusd_epi32(acc[r][2], a, w2);
      acc[r][3] = _mm512_dpbusd_epi32(acc[r][3], a, w3);
    }
  }
  for (int r = 0; r < R; r++) {
    const __m512 s = _mm512_set1_ps(sx[r]);
    for (int v = 0; v < 4; v++) {
      const int64_t left = cols - 16 * v;
      if (left <= 0) break;
      const __m512i d = _mm512_sub_epi32(acc[r][v], _mm512_loadu_si512(csum + 16 * v));
      const __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(s, _mm512_loadu_ps(scale + 16 * v)));
      const __mmask16 m = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
      _mm512_mask_storeu_ps(y + r * ldy + 16 * v, m, f);
    }
  }
}

void panel(const uint8_t* xq, const float* sx, int64_t rows, int64_t in4, const int8_t* w, const int32_t* csum,
           const float* scale, float* y, int64_t ldy, int64_t cols) {
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) block<kRows>(xq + r * in4, sx + r, in4, w, csum, scale, y + r * ldy, ldy, cols);
  const uint8_t* a = xq + r * in4;
  const float* s = sx + r;
  float* yr = y + r * ldy;
  switch (rows - r) {
    case 1: block<1>(a, s, in4, w, csum, scale, yr, ldy, cols); break;
    case 2: block<2>(a, s, in4, w, csum, scale, yr, ldy, cols); break;
    case 3: block<3>(a, s, in4, w, csum, scale, yr, ldy, cols); break;
    case 4: block<4>(a, s, in4, w, csum, scale, yr, ldy, cols); break;
    case 5: block<5>(a, s, in4, w, csum, scale, yr, ldy, cols); break;
    default: break;
  }
}

}  // namespace vnni
#pragma GCC pop_options

}  // namespace

// Whether the dot-product kernel runs in integers here (else it runs its plain C++ loop,
// correct but slow: specdec.quantize only serves "w8a8" where this is true).
bool has_int8_dot() { return cpu_has_vnni() && specdec::current_isa() == specdec::Isa::kAvx512; }

// x [N, in] float32; packed uint8 [panels, ceil4(in) + 8, 64] as above; out = the true column count
torch::Tensor int8_dot_linear(torch::Tensor x, torch::Tensor packed, int64_t out, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "int8_dot_linear: x must be a 2-D float32 tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == torch::kByte,
              "int8_dot_linear: the weight must be packed uint8 [panels, in4 + 8, 64]");
  const int64_t in = x.size(1), in4 = (in + 3) / 4 * 4, panels = packed.size(0);
  TORCH_CHECK(packed.size(2) == kP, "int8_dot_linear: panels of ", packed.size(2), " columns, the kernel takes ", kP);
  TORCH_CHECK(packed.size(1) == in4 + 8, "int8_dot_linear: x has ", x.size(1), " columns, the weight ",
              packed.size(1) - 8, " (rounded up to a multiple of 4)");
  TORCH_CHECK(out > (panels - 1) * kP && out <= panels * kP, "int8_dot_linear: ", out, " columns do not fit ",
              panels, " panels");
  x = x.contiguous();
  const int64_t rows = x.size(0);
  auto y = torch::empty({rows, out}, x.options());
  if (rows == 0) return y;
  std::vector<uint8_t> xq(rows * in4);
  std::vector<float> sx(rows);
  const bool fast = has_int8_dot();
  if (fast) vnni::quantize_rows(x.data_ptr<float>(), rows, in, in4, xq.data(), sx.data());
  else quantize_rows(x.data_ptr<float>(), rows, in, in4, xq.data(), sx.data());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const int64_t panel_bytes = (in4 + 8) * kP;
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; p++) {
      const uint8_t* base = wp + p * panel_bytes;
      const int8_t* w = reinterpret_cast<const int8_t*>(base);
      int32_t csum[kP];
      float scale[kP];
      std::memcpy(csum, base + in4 * kP, sizeof csum);
      std::memcpy(scale, base + (in4 + 4) * kP, sizeof scale);
      const int64_t cols = std::min(kP, out - p * kP);
      if (fast) vnni::panel(xq.data(), sx.data(), rows, in4, w, csum, scale, yp + p * kP, out, cols);
      else panel_scalar(xq.data(), sx.data(), rows, in4, w, csum, scale, yp + p * kP, out, cols);
    }
  });
  if (bias.has_value()) y.add_(*bias);
  return y;
}
