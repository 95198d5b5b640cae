// Inverse-CDF draws for rows of probabilities in one call: specdec.sampling.sample_from's
// draw to the bit, without its dozen operator dispatches (about 30 µs a row of 4,096 on the
// 2-core CPU, most of a draft step's sampling). Per row: a running float64 sum in token
// order (torch's CPU cumsum sums in that order too), the first token whose running sum
// exceeds u · total (searchsorted, right: a binary search of the sums), clamped to the
// last token, and a landing on a zero-mass token (a floating tie at the top) stepped back
// to the last token with mass. The sum is sequential on purpose: a vectorised one would
// round differently and draw other tokens than the torch path at the same uniforms.
#include <torch/extension.h>

#include <algorithm>
#include <vector>

#include "kernels.h"

template <typename T>
int64_t draw_row(const T* p, int64_t vocab, double u, std::vector<double>& cdf) {
  double running = 0.0;  // one dependent chain of adds: the draw's whole cost
  for (int64_t i = 0; i < vocab; i++) cdf[i] = running += static_cast<double>(p[i]);
  const double target = u * running;
  int64_t index = std::upper_bound(cdf.begin(), cdf.begin() + vocab, target) - cdf.begin();
  if (index > vocab - 1) index = vocab - 1;
  if (p[index] <= 0) {  // the last token with mass, or 0 where none has any (as torch's argmax of a zero count)
    index = 0;
    for (int64_t i = vocab - 1; i >= 0; i--)
      if (p[i] > 0) {
        index = i;
        break;
      }
  }
  return index;
}

int64_t draw_probability_row(const float* p, int64_t vocab, double u, std::vector<double>& cdf) {
  return draw_row(p, vocab, u, cdf);
}

int64_t draw_probability_row(const double* p, int64_t vocab, double u, std::vector<double>& cdf) {
  return draw_row(p, vocab, u, cdf);
}

// probs [..., vocab] float32 or float64 (need not sum to 1), u [...] uniforms in [0, 1)
// → [...] int64 tokens. Shapes, layout and u's type are settled here rather than by
// operators in Python, each of which costs more than the draw.
torch::Tensor sample_rows(torch::Tensor probs, torch::Tensor u) {
  TORCH_CHECK(probs.dim() >= 1 && probs.device().is_cpu() && u.device().is_cpu(),
              "sample_rows: probs [..., vocab] and u [...] must be CPU tensors");
  TORCH_CHECK(probs.scalar_type() == torch::kFloat32 || probs.scalar_type() == torch::kFloat64,
              "sample_rows: probs must be float32 or float64");
  TORCH_CHECK(u.sizes() == probs.sizes().slice(0, probs.dim() - 1),
              "sample_rows: u must have the shape of probs' rows ", probs.sizes().slice(0, probs.dim() - 1),
              ", got ", u.sizes());
  const int64_t vocab = probs.size(-1), rows = u.numel();
  TORCH_CHECK(vocab > 0, "sample_rows: an empty vocabulary");
  probs = probs.contiguous();
  u = u.to(torch::kFloat64).contiguous();
  auto out = torch::empty(u.sizes(), u.options().dtype(torch::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  const double* us = u.data_ptr<double>();
  std::vector<double> cdf(vocab);
  if (probs.scalar_type() == torch::kFloat32) {
    const float* p = probs.data_ptr<float>();
    for (int64_t r = 0; r < rows; r++) o[r] = draw_row(p + r * vocab, vocab, us[r], cdf);
  } else {
    const double* p = probs.data_ptr<double>();
    for (int64_t r = 0; r < rows; r++) o[r] = draw_row(p + r * vocab, vocab, us[r], cdf);
  }
  return out;
}
