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
//
// A quantised draft (specdec/quantize.py) streams int8 values instead, half the bytes again:
// the same panels, each followed by its columns' float32 scales, which multiply each
// finished sum once. The values widen to float32 exactly, so the products are the quantised
// model's (int8 × scale) to float rounding.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>
#include <immintrin.h>

#include "isa.h"
#include "kernels.h"

namespace {

constexpr int kRows = 6;

// How a panel's weight values widen to float32. Every loader widens exactly; int8 panels
// also carry one float32 scale per column, applied once to each finished sum (a quantised
// draft's weights are q · scale: specdec/quantize.py).
enum class Kind { kHalf, kBf16, kInt8 };

inline float widen_scalar(const void* w, int64_t k, Kind kind) {
  if (kind == Kind::kInt8) return static_cast<float>(static_cast<const int8_t*>(w)[k]);
  const uint16_t v = static_cast<const uint16_t*>(w)[k];
  if (kind == Kind::kBf16) {
    uint32_t bits = static_cast<uint32_t>(v) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    return f;
  }
  return static_cast<float>(c10::Half(v, c10::Half::from_bits()));
}

inline int64_t elem_bytes(Kind kind) { return kind == Kind::kInt8 ? 1 : 2; }

// any CPU: one panel, all rows
void panel_scalar(const float* x, int64_t rows, int64_t in, const void* w, int64_t P, Kind kind, const float* scale,
                  float* y, int64_t ldy, int64_t cols) {
  for (int64_t r = 0; r < rows; r++) {
    for (int64_t j = 0; j < cols; j++) {
      float acc = 0.f;
      for (int64_t i = 0; i < in; i++) acc += x[r * in + i] * widen_scalar(w, i * P + j, kind);
      y[r * ldy + j] = scale ? acc * scale[j] : acc;
    }
  }
}

#pragma GCC push_options
#pragma GCC target("avx512f")
namespace avx512 {
constexpr int64_t P = 64;

template <Kind K>
inline __m512 load(const void* base, int64_t k) {
  if constexpr (K == Kind::kInt8) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(base) + k));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  } else {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + k));
    if constexpr (K == Kind::kBf16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    else return _mm512_cvtph_ps(h);
  }
}

template <Kind K, int R>
void block(const float* x, int64_t in, const void* w, const float* scale, float* y, int64_t ldy, int64_t cols) {
  __m512 acc[R][4];
  for (int r = 0; r < R; r++)
    for (int v = 0; v < 4; v++) acc[r][v] = _mm512_setzero_ps();
  for (int64_t i = 0; i < in; i++) {
    const int64_t k = i * P;
    __m512 w0 = load<K>(w, k), w1 = load<K>(w, k + 16), w2 = load<K>(w, k + 32), w3 = load<K>(w, k + 48);
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
      if constexpr (K == Kind::kInt8) acc[r][v] = _mm512_mul_ps(acc[r][v], _mm512_loadu_ps(scale + 16 * v));
      __mmask16 m = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
      _mm512_mask_storeu_ps(y + r * ldy + 16 * v, m, acc[r][v]);
    }
  }
}

#include "panel_rows.inc"
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
constexpr int64_t P = 16;

template <Kind K>
inline __m256 load(const void* base, int64_t k) {
  if constexpr (K == Kind::kInt8) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(base) + k));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + k));
    if constexpr (K == Kind::kBf16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    else return _mm256_cvtph_ps(h);
  }
}

template <Kind K, int R>
void block(const float* x, int64_t in, const void* w, const float* scale, float* y, int64_t ldy, int64_t cols) {
  __m256 acc[R][2];
  for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t i = 0; i < in; i++) {
    const int64_t k = i * P;
    __m256 w0 = load<K>(w, k), w1 = load<K>(w, k + 8);
    for (int r = 0; r < R; r++) {
      __m256 xb = _mm256_set1_ps(x[r * in + i]);
      acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; r++) {
    if constexpr (K == Kind::kInt8) {
      acc[r][0] = _mm256_mul_ps(acc[r][0], _mm256_loadu_ps(scale));
      acc[r][1] = _mm256_mul_ps(acc[r][1], _mm256_loadu_ps(scale + 8));
    }
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

#include "panel_rows.inc"
}  // namespace avx2
#pragma GCC pop_options

template <Kind K>
void run_panel(specdec::Isa isa, const float* x, int64_t rows, int64_t in, const void* w, int64_t P,
               const float* scale, float* y, int64_t ldy, int64_t cols) {
  if (isa == specdec::Isa::kAvx512) avx512::panel<K>(x, rows, in, w, scale, y, ldy, cols);
  else if (isa == specdec::Isa::kAvx2) avx2::panel<K>(x, rows, in, w, scale, y, ldy, cols);
  else panel_scalar(x, rows, in, w, P, K, scale, y, ldy, cols);
}

}  // namespace

// The panel width this CPU's kernel wants: the weight is packed for it.
int64_t panel_width() {
  const specdec::Isa isa = specdec::current_isa();
  return isa == specdec::Isa::kAvx512 ? avx512::P : (isa == specdec::Isa::kAvx2 ? avx2::P : 16);
}

// x [N, in] float32; packed [panels, in, P] float16 or bfloat16, or int8 [panels, in + 4, P]
// whose last four rows of each panel hold its P columns' float32 scales (specdec.half_weights),
// or uint8 for int8_dot.cpp's layout; out = the true column count
torch::Tensor half_linear(torch::Tensor x, torch::Tensor packed, int64_t out, c10::optional<torch::Tensor> bias) {
  // uint8 panels: int8 weights laid out for 8-bit dot products with int8 activations
  if (packed.scalar_type() == torch::kByte) return int8_dot_linear(x, packed, out, bias);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "half_linear: x must be a 2-D float32 tensor");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous(), "half_linear: the weight must be packed [panels, in, P]");
  const auto dtype = packed.scalar_type();
  TORCH_CHECK(dtype == torch::kHalf || dtype == torch::kBFloat16 || dtype == torch::kChar,
              "half_linear: the packed weight must be float16, bfloat16 or int8");
  const Kind kind = dtype == torch::kChar ? Kind::kInt8 : (dtype == torch::kBFloat16 ? Kind::kBf16 : Kind::kHalf);
  const int64_t panels = packed.size(0), P = packed.size(2);
  const int64_t in = packed.size(1) - (kind == Kind::kInt8 ? 4 : 0);
  TORCH_CHECK(in > 0, "half_linear: an int8 weight needs its four rows of scales after its values");
  TORCH_CHECK(x.size(1) == in, "half_linear: x has ", x.size(1), " columns, the weight ", in);
  TORCH_CHECK(P == panel_width(), "half_linear: the weight was packed for panels of ", P, ", this CPU takes ", panel_width());
  TORCH_CHECK(out > (panels - 1) * P && out <= panels * P, "half_linear: ", out, " columns do not fit ", panels, " panels");
  x = x.contiguous();
  const int64_t rows = x.size(0);
  auto y = torch::empty({rows, out}, x.options());
  const float* xp = x.data_ptr<float>();
  const char* wp = static_cast<const char*>(packed.data_ptr());
  const int64_t panel_bytes = packed.size(1) * P * elem_bytes(kind);
  float* yp = y.data_ptr<float>();
  const specdec::Isa isa = specdec::current_isa();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; p++) {
      const char* w = wp + p * panel_bytes;
      float* yc = yp + p * P;
      const int64_t cols = std::min(P, out - p * P);
      if (kind == Kind::kInt8) {
        float scale[64];  // the panel's scales, copied out of its int8 rows (P ≤ 64)
        std::memcpy(scale, w + in * P, P * sizeof(float));
        run_panel<Kind::kInt8>(isa, xp, rows, in, w, P, scale, yc, out, cols);
      } else if (kind == Kind::kBf16) {
        run_panel<Kind::kBf16>(isa, xp, rows, in, w, P, nullptr, yc, out, cols);
      } else {
        run_panel<Kind::kHalf>(isa, xp, rows, in, w, P, nullptr, yc, out, cols);
      }
    }
  });
  if (bias.has_value()) y.add_(*bias);
  return y;
}
