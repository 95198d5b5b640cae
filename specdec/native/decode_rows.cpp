// encode_fp16_rows: a draft's quantised distributions (float32 values that fp16 holds exactly)
// into their dense fp16 bytes and each row's count of positive values, in one pass: what
// specdec.wire.encode needs to send them dense, without its numpy and torch calls over the
// block (18 µs for [4, 4,096] on the 2-core CPU, on every sampled proposal's answer).
//
// decode_fp16_rows: a draft's dense fp16 distributions, as they arrive at the target, into the float64 rows the
// verdicts read, in one call: specdec.wire.decode's dense path to the bit, without its seven
// operators over the block (50 µs for [4, 4,096] on the 2-core CPU, a verification's cost
// that grows with the sessions in a batch). Per row: each value widened exactly, the row's
// sum in sampling.lane_sums' order (16 lanes, each in token order, then the lanes in order),
// and each value divided by it; the same refusals as decode, in the same order over the rows.
//
// fp16_row_sums: the same rows' sums alone, for a target whose verdicts run on a GPU: it keeps
// the fp16 values (specdec/draft_rows.py) and divides only the values and rows it reads, so it
// neither writes nor moves the float64 block (specdec.wire.decode_half).
#include <torch/extension.h>

#include <cmath>
#include <stdexcept>
#include <vector>

#include "kernels.h"

#include <immintrin.h>

#include "isa.h"

namespace {

// fp16 → float32, exact on every path (the conversion instructions widen exactly, as c10::Half does)
void widen_scalar(const uint16_t* in, float* out, int64_t n) {
  const auto* h = reinterpret_cast<const c10::Half*>(in);
  for (int64_t i = 0; i < n; i++) out[i] = static_cast<float>(h[i]);
}

#pragma GCC push_options
#pragma GCC target("avx512f")
void widen_avx512(const uint16_t* in, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i))));
  widen_scalar(in + i, out + i, n - i);
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,f16c")
void widen_avx2(const uint16_t* in, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
  widen_scalar(in + i, out + i, n - i);
}
#pragma GCC pop_options

void widen(const uint16_t* in, float* out, int64_t n) {
  switch (specdec::current_isa()) {
    case specdec::Isa::kAvx512: return widen_avx512(in, out, n);
    case specdec::Isa::kAvx2: return widen_avx2(in, out, n);
    default: return widen_scalar(in, out, n);
  }
}

// One row's lane sums (lane[k] += the values v ≡ k mod kMassLanes, in order) → whether any
// is negative; STORE also keeps each widened value (decode's rows) or nothing (the sums
// alone). Adds and compares only: the same results at any vector width, which the target
// attributes below let the compiler choose.
#define SPECDEC_LANES_BODY(STORE)                                         \
  bool negative = false;                                                  \
  int64_t v = 0;                                                          \
  for (; v + kMassLanes <= vocab; v += kMassLanes)                        \
    for (int k = 0; k < kMassLanes; k++) {                                \
      const double x = in[v + k];                                         \
      STORE                                                               \
      negative |= x < 0.0;                                                \
      lane[k] += x;                                                       \
    }                                                                     \
  for (int k = 0; v + k < vocab; k++) {                                   \
    const double x = in[v + k];                                           \
    STORE                                                                 \
    negative |= x < 0.0;                                                  \
    lane[k] += x;                                                         \
  }                                                                       \
  return negative;
#define SPECDEC_ROW_BODY SPECDEC_LANES_BODY(out[v + k] = x;)
#define SPECDEC_SUM_BODY SPECDEC_LANES_BODY()

// Each value divided by the row's sum: IEEE division, the same quotient at any width.
#define SPECDEC_DIVIDE_BODY \
  for (int64_t v = 0; v < vocab; v++) out[v] = out[v] / total;

bool row_scalar(const float* in, double* out, int64_t vocab, double* lane) { SPECDEC_ROW_BODY }
bool sum_scalar(const float* in, int64_t vocab, double* lane) { SPECDEC_SUM_BODY }
void divide_scalar(double* out, int64_t vocab, double total) { SPECDEC_DIVIDE_BODY }

#pragma GCC push_options
#pragma GCC target("avx512f")
bool row_avx512(const float* in, double* out, int64_t vocab, double* lane) { SPECDEC_ROW_BODY }
bool sum_avx512(const float* in, int64_t vocab, double* lane) { SPECDEC_SUM_BODY }
void divide_avx512(double* out, int64_t vocab, double total) { SPECDEC_DIVIDE_BODY }
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2")
bool row_avx2(const float* in, double* out, int64_t vocab, double* lane) { SPECDEC_ROW_BODY }
bool sum_avx2(const float* in, int64_t vocab, double* lane) { SPECDEC_SUM_BODY }
void divide_avx2(double* out, int64_t vocab, double total) { SPECDEC_DIVIDE_BODY }
#pragma GCC pop_options

// float32 → fp16 of values fp16 holds exactly (any rounding mode gives them back), and the
// count of those above zero (NaN is not): encode's `a > 0`.
int64_t narrow_scalar(const float* in, uint16_t* out, int64_t n) {
  int64_t positive = 0;
  for (int64_t i = 0; i < n; i++) {
    out[i] = c10::Half(in[i]).x;
    positive += in[i] > 0.0f;
  }
  return positive;
}

#pragma GCC push_options
#pragma GCC target("avx512f")
int64_t narrow_avx512(const float* in, uint16_t* out, int64_t n) {
  int64_t i = 0, positive = 0;
  const __m512 zero = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(in + i);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
    positive += __builtin_popcount(_mm512_cmp_ps_mask(x, zero, _CMP_GT_OQ));
  }
  return positive + narrow_scalar(in + i, out + i, n - i);
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,f16c")
int64_t narrow_avx2(const float* in, uint16_t* out, int64_t n) {
  int64_t i = 0, positive = 0;
  const __m256 zero = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(in + i);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
    positive += __builtin_popcount(_mm256_movemask_ps(_mm256_cmp_ps(x, zero, _CMP_GT_OQ)));
  }
  return positive + narrow_scalar(in + i, out + i, n - i);
}
#pragma GCC pop_options

int64_t narrow(const float* in, uint16_t* out, int64_t n) {
  switch (specdec::current_isa()) {
    case specdec::Isa::kAvx512: return narrow_avx512(in, out, n);
    case specdec::Isa::kAvx2: return narrow_avx2(in, out, n);
    default: return narrow_scalar(in, out, n);
  }
}

bool widen_row(const float* in, double* out, int64_t vocab, double* lane) {
  switch (specdec::current_isa()) {
    case specdec::Isa::kAvx512: return row_avx512(in, out, vocab, lane);
    case specdec::Isa::kAvx2: return row_avx2(in, out, vocab, lane);
    default: return row_scalar(in, out, vocab, lane);
  }
}

bool sum_row(const float* in, int64_t vocab, double* lane) {
  switch (specdec::current_isa()) {
    case specdec::Isa::kAvx512: return sum_avx512(in, vocab, lane);
    case specdec::Isa::kAvx2: return sum_avx2(in, vocab, lane);
    default: return sum_scalar(in, vocab, lane);
  }
}

// decode's refusals, in its order: negative or non-finite values anywhere, then a row without mass
void check_totals(const std::vector<double>& totals, bool negative) {
  for (double total : totals)  // fp16 values are finite unless inf or NaN, so a sum is finite exactly when its row is
    if (negative || !std::isfinite(total)) throw std::invalid_argument("draft distributions hold negative or non-finite values");
  for (double total : totals)
    if (total <= 0.0) throw std::invalid_argument("a draft distribution row has no mass");
}

// Each of `rows` fp16 rows' sum in lane order, with decode's refusals; `out`, where given,
// also receives the rows widened to float64.
std::vector<double> row_totals(const uint16_t* h, int64_t rows, int64_t vocab, double* out) {
  std::vector<double> totals(rows);
  std::vector<float> wide(vocab);
  bool negative = false;
  for (int64_t r = 0; r < rows; r++) {
    double lane[kMassLanes] = {};
    widen(h + r * vocab, wide.data(), vocab);
    negative |= out != nullptr ? widen_row(wide.data(), out + r * vocab, vocab, lane)
                               : sum_row(wide.data(), vocab, lane);
    double total = 0.0;
    for (int k = 0; k < kMassLanes; k++) total += lane[k];
    totals[r] = total;
  }
  check_totals(totals, negative);
  return totals;
}

void divide_row(double* out, int64_t vocab, double total) {
  switch (specdec::current_isa()) {
    case specdec::Isa::kAvx512: return divide_avx512(out, vocab, total);
    case specdec::Isa::kAvx2: return divide_avx2(out, vocab, total);
    default: return divide_scalar(out, vocab, total);
  }
}
}  // namespace

torch::Tensor decode_fp16_rows(pybind11::bytes data, int64_t rows, int64_t vocab) {
  char* buffer = nullptr;
  Py_ssize_t length = 0;
  if (PyBytes_AsStringAndSize(data.ptr(), &buffer, &length) != 0) throw pybind11::error_already_set();
  TORCH_CHECK(rows >= 0 && vocab > 0 && length == 2 * rows * vocab, "decode_fp16_rows: ", 2 * rows * vocab,
              " bytes expected for ", rows, " rows of ", vocab, ", got ", length);
  // the rest without the GIL (the caller's reference keeps `data` alive): a large vocabulary's
  // rows take the target's servicer half a millisecond a message, decoded on worker threads
  pybind11::gil_scoped_release nogil;
  auto out = torch::empty({rows, vocab}, torch::dtype(torch::kFloat64));
  double* o = out.data_ptr<double>();
  const std::vector<double> totals = row_totals(reinterpret_cast<const uint16_t*>(buffer), rows, vocab, o);
  for (int64_t r = 0; r < rows; r++) divide_row(o + r * vocab, vocab, totals[r]);
  return out;
}

torch::Tensor fp16_row_sums(torch::Tensor values) {
  TORCH_CHECK(values.dim() == 2 && values.scalar_type() == torch::kFloat16 && values.device().is_cpu() &&
                  values.is_contiguous() && values.size(1) > 0,
              "fp16_row_sums: a contiguous [rows, vocab] float16 CPU tensor expected");
  const int64_t rows = values.size(0), vocab = values.size(1);
  const auto* h = reinterpret_cast<const uint16_t*>(values.data_ptr<at::Half>());
  pybind11::gil_scoped_release nogil;  // as decode_fp16_rows: on worker threads, beside the event loop
  return torch::tensor(row_totals(h, rows, vocab, nullptr), torch::dtype(torch::kFloat64));
}

std::tuple<pybind11::bytes, std::vector<int64_t>> encode_fp16_rows(torch::Tensor q) {
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kFloat32 && q.device().is_cpu() && q.is_contiguous(),
              "encode_fp16_rows: a contiguous [rows, vocab] float32 CPU tensor expected");
  const int64_t rows = q.size(0), vocab = q.size(1);
  const float* in = q.data_ptr<float>();
  std::vector<int64_t> positive(rows);
  PyObject* out = PyBytes_FromStringAndSize(nullptr, 2 * rows * vocab);
  if (out == nullptr) throw pybind11::error_already_set();
  auto* h = reinterpret_cast<uint16_t*>(PyBytes_AS_STRING(out));
  for (int64_t r = 0; r < rows; r++) positive[r] = narrow(in + r * vocab, h + r * vocab, vocab);
  return {pybind11::reinterpret_steal<pybind11::bytes>(out), positive};
}
