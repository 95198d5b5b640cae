// A sampled law (temperature, top-k, top-p, min-p) over rows of float32 logits in one call:
// specdec.sampling.logits_to_probs_torch's operators to the bit, for a fraction of their cost.
//
// That chain runs up to fifteen operators over each [rows, vocab] block (a division, topk,
// a comparison and a fill, softmax, the top-p mask, a fill, a sum and a division, amax, a
// product, a comparison, a fill, a sum and a division): 350 µs for a verification's five rows
// of 4,096 under all four cuts on the 2-core CPU, where the softmax alone costs 12. Here the
// elementwise steps run in one loop per row; the kth largest value comes from a min-heap of
// the k largest (topk's value, ties included); the softmax and both renormalising sums stay torch's own
// operators, so that every bit is as the chain leaves it: a division by a float32 temperature
// and a comparison with a float32 product are exactly rounded either way.
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "kernels.h"

namespace {

// the kth largest of a row's values, ties counted (torch.topk's last value): a min-heap of
// the k largest so far, which most values of a row pass by at one comparison
float kth_largest(const float* x, int64_t vocab, int64_t k, std::vector<float>& heap) {
  heap.assign(x, x + k);
  std::make_heap(heap.begin(), heap.end(), std::greater<float>());
  for (int64_t v = k; v < vocab; v++) {
    if (x[v] > heap.front()) {
      std::pop_heap(heap.begin(), heap.end(), std::greater<float>());
      heap.back() = x[v];
      std::push_heap(heap.begin(), heap.end(), std::greater<float>());
    }
  }
  return heap.front();
}

// x / temperature into out, then −∞ below the kth largest value (0 < k < vocab: a cut)
void temper_and_cut(const float* x, float* out, int64_t vocab, float temperature, bool divide, int64_t top_k,
                    std::vector<float>& scratch) {
  if (divide)
    for (int64_t v = 0; v < vocab; v++) out[v] = x[v] / temperature;
  else
    std::memcpy(out, x, vocab * sizeof(float));
  if (top_k <= 0 || top_k >= vocab) return;
  const float kth = kth_largest(out, vocab, top_k, scratch);
  const float minus_inf = -std::numeric_limits<float>::infinity();
  for (int64_t v = 0; v < vocab; v++)
    if (out[v] < kth) out[v] = minus_inf;
}

// rows / their sums, as `probs / probs.sum(-1, keepdim=True)`
void renormalise(torch::Tensor& probs) { probs.div_(probs.sum(-1, true)); }

}  // namespace

torch::Tensor law_rows(torch::Tensor logits, double temperature, int64_t top_k, double top_p, double min_p) {
  TORCH_CHECK(logits.dim() >= 1 && logits.scalar_type() == torch::kFloat32 && logits.device().is_cpu(),
              "law_rows: logits must be a float32 CPU tensor [..., vocab]");
  TORCH_CHECK(temperature > 0.0, "law_rows: a sampled law needs a temperature above 0 (greedy is not a law here)");
  TORCH_CHECK(top_p > 0.0 && top_p <= 1.0, "law_rows: top_p must lie in (0, 1]");
  TORCH_CHECK(min_p >= 0.0 && min_p <= 1.0, "law_rows: min_p must lie in [0, 1]");
  const int64_t vocab = logits.size(-1);
  TORCH_CHECK(vocab > 0, "law_rows: an empty vocabulary");
  logits = logits.contiguous();
  const int64_t rows = logits.numel() / vocab;
  const bool divide = temperature != 1.0;  // x / 1 is x: the chain skips the operator
  const bool cuts = top_k > 0 && top_k < vocab;
  auto tempered = divide || cuts ? torch::empty(logits.sizes(), logits.options()) : logits;
  if (divide || cuts) {
    const float* x = logits.data_ptr<float>();
    float* out = tempered.data_ptr<float>();
    std::vector<float> scratch;
    for (int64_t r = 0; r < rows; r++)
      temper_and_cut(x + r * vocab, out + r * vocab, vocab, static_cast<float>(temperature), divide, top_k, scratch);
  }
  auto probs = torch::softmax(tempered, -1);
  if (top_p < 1.0) {
    top_p_zero_(probs, top_p);  // as masked_fill with top_p_drop's mask, without its slow fill
    renormalise(probs);
  }
  if (min_p > 0.0) {
    float* p = probs.data_ptr<float>();
    const float ratio = static_cast<float>(min_p);  // as torch multiplies a float32 tensor by it
    for (int64_t r = 0; r < rows; r++, p += vocab) {
      const float threshold = *std::max_element(p, p + vocab) * ratio;
      for (int64_t v = 0; v < vocab; v++)
        if (p[v] < threshold) p[v] = 0.0f;
    }
    renormalise(probs);
  }
  return probs;
}
