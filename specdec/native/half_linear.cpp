// y = x · Wᵀ (+ bias) with W held in 16-bit floats (IEEE half or bfloat16) and everything
// else in float32: a decode step reads every weight once, so on a CPU it is bound by the
// bytes of the weights, and half the bytes is about half the time. Each weight value is
// widened to float32 exactly, and products and sums are float32, so a model whose weights
// are 16-bit values computes the numbers it computes from float32 weights, rounded apart
// only by the order of the sums. (specdec/half_weights.py decides when that holds.)
//
// The weight is packed once into panels of P output columns, [panels, in, P], so that the
// kernel streams each panel front to back; the last panel is padded with zeros. For each
// panel, R rows of x at a time are multiplied into R × P float32 accumulators held in
// registers (AVX-512: P = 64, R ≤ 6; AVX2: P = 16, R ≤ 6). The panel (in × P × 2 bytes)
// stays in L1/L2 between row blocks, so the weight comes from memory once per call.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>
#include <immintrin.h>

#include "isa.h"

namespace {

constexpr int kRows = 6;

inline float widen(uint16_t v, bool bf16) {
  if (bf16) {
    uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }
  return static_cast<float>(c10::Half(v, c10::Half::from_bits()));
}

// any CPU: one panel, all rows
void panel_scalar(const float* x, int64_t rows, int64_t in, const uint16_t* w, int64_t P, bool bf16,
                  float* y, int64_t ldy, int64_t cols) {
  for (int64_t r = 0; r < rows; r++) {
    for (int64_t j = 0; j < cols; j++) {
      float acc = 0.f;
      for (int64_t i = 0; i < in; i++) acc += x[r * in + i] * widen(w[i * P + j], bf16);
      y[r * ldy + j] = acc;
    }
  }
}

#pragma GCC push_options
#pragma GCC target("avx512f")
namespace avx512 {
constexpr int64_t P = 64;

template <bool BF16>
inline __m512 load(const uint16_t* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (BF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  else return _mm512_cvtph_ps(h);
}

template <bool BF16, int R>
void block(const float* x, int64_t in, const uint16_t* w, float* y, int64_t ldy, int64_t cols) {
  __m512 acc[R][4];
  for (int r = 0; r < R; r++)
    for (int v = 0; v < 4; v++) acc[r][v] = _mm512_setzero_ps();
  for (int64_t i = 0; i < in; i++) {
    const uint16_t* wi = w + i * P;
    __m512 w0 = load<BF16>(wi), w1 = load<BF16>(wi + 16), w2 = load<BF16>(wi + 32), w3 = load<BF16>(wi + 48);
    for (int r = 0; r < R; r++) {
      __m512 xb = _mm512_set1_ps(x[r * in + i]);
      acc[r][0] = _mm512_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xb, w1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(xb, w2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(xb, w3, acc[r][3]);
    }
  }
  for (int r = 0; r < R; r++) {
    for (int v = 0; v < 4; v++) {
      int64_t left = cols - 16 * v;
      if (left <= 0) break;
      __mmask16 m = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
      _mm512_mask_storeu_ps(y + r * ldy + 16 * v, m, acc[r][v]);
    }
  }
}

template <bool BF16>
void panel(const float* x, int64_t rows, int64_t in, const uint16_t* w, float* y, int64_t ldy, int64_t cols) {
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) block<BF16, kRows>(x + r * in, in, w, y + r * ldy, ldy, cols);
  const float* xr = x + r * in;
  float* yr = y + r * ldy;
  switch (rows - r) {
    case 1: block<BF16, 1>(xr, in, w, yr, ldy, cols); break;
    case 2: block<BF16, 2>(xr, in, w, yr, ldy, cols); break;
    case 3: block<BF16, 3>(xr, in, w, yr, ldy, cols); break;
    case 4: block<BF16, 4>(xr, in, w, yr, ldy, cols); break;
    case 5: block<BF16, 5>(xr, in, w, yr, ldy, cols); break;
    default: break;
  }
}
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
constexpr int64_t P = 16;

template <bool BF16>
inline __m256 load(const uint16_t* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (BF16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  else return _mm256_cvtph_ps(h);
}

template <bool BF16, int R>
void block(const float* x, int64_t in, const uint16_t* w, float* y, int64_t ldy, int64_t cols) {
  __m256 acc[R][2];
  for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t i = 0; i < in; i++) {
    const uint16_t* wi = w + i * P;
    __m256 w0 = load<BF16>(wi), w1 = load<BF16>(wi + 8);
    for (int r = 0; r < R; r++) {
      __m256 xb = _mm256_set1_ps(x[r * in + i]);
      acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; r++) {
    if (cols >= P) {
      _mm256_storeu_ps(y + r * ldy, acc[r][0]);
      _mm256_storeu_ps(y + r * ldy + 8, acc[r][1]);
    } else {
      alignas(32) float tmp[P];
      _mm256_store_ps(tmp, acc[r][0]);
      _mm256_store_ps(tmp + 8, acc[r][1]);
      std::memcpy(y + r * ldy, tmp, cols * sizeof(float));
    }
  }
}

template <bool BF16>
void panel(const float* x, int64_t rows, int64_t in, const uint16_t* w, float* y, int64_t ldy, int64_t cols) {
  int64_t r = 0;
  for (; r + kRows <= rows; r += kRows) block<BF16, kRows>(x + r * in, in, w, y + r * ldy, ldy, cols);
  const float* xr = x + r * in;
  float* yr = y + r * ldy;
  switch (rows - r) {
    case 1: block<BF16, 1>(xr, in, w, yr, ldy, cols); break;
    case 2: block<BF16, 2>(xr, in, w, yr, ldy, cols); break;
    case 3: block<BF16, 3>(xr, in, w, yr, ldy, cols); break;
    case 4: block<BF16, 4>(xr, in, w, yr, ldy, cols); break;
    case 5: block<BF16, 5>(xr, in, w, yr, ldy, cols); break;
    default: break;
  }
}
}  // namespace avx2
#pragma GCC pop_options

}  // namespace

// The panel width this CPU's kernel wants: the weight is packed for it.
int64_t panel_width() {
  const specdec::Isa isa = specdec::current_isa();
  return isa == specdec::Isa::kAvx512 ? avx512::P : (isa == specdec::Isa::kAvx2 ? avx2::P : 16);
}

// x [N, in] float32; packed [panels, in, P] float16 or bfloat16; out = the true column count
torch::Tensor half_linear(torch::Tensor x, torch::Tensor packed, int64_t out, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "half_linear: x must be a 2-D float32 tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous(), "half_linear: the weight must be packed [panels, in, P]");
  TORCH_CHECK(packed.scalar_type() == torch::kHalf || packed.scalar_type() == torch::kBFloat16,
              "half_linear: the packed weight must be float16 or bfloat16");
  const int64_t panels = packed.size(0), in = packed.size(1), P = packed.size(2);
  TORCH_CHECK(x.size(1) == in, "half_linear: x has ", x.size(1), " columns, the weight ", in);
  TORCH_CHECK(P == panel_width(), "half_linear: the weight was packed for panels of ", P, ", this CPU takes ", panel_width());
  TORCH_CHECK(out > (panels - 1) * P && out <= panels * P, "half_linear: ", out, " columns do not fit ", panels, " panels");
  x = x.contiguous();
  const int64_t rows = x.size(0);
  auto y = torch::empty({rows, out}, x.options());
  const bool bf16 = packed.scalar_type() == torch::kBFloat16;
  const float* xp = x.data_ptr<float>();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  float* yp = y.data_ptr<float>();
  const specdec::Isa isa = specdec::current_isa();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; p++) {
      const uint16_t* w = wp + p * in * P;
      float* yc = yp + p * P;
      const int64_t cols = std::min(P, out - p * P);
      if (isa == specdec::Isa::kAvx512) {
        bf16 ? avx512::panel<true>(xp, rows, in, w, yc, out, cols) : avx512::panel<false>(xp, rows, in, w, yc, out, cols);
      } else if (isa == specdec::Isa::kAvx2) {
        bf16 ? avx2::panel<true>(xp, rows, in, w, yc, out, cols) : avx2::panel<false>(xp, rows, in, w, yc, out, cols);
      } else {
        panel_scalar(xp, rows, in, w, P, bf16, yc, out, cols);
      }
    }
  });
  if (bias.has_value()) y.add_(*bias);
  return y;
}
