// Which tokens top-p (nucleus) truncation drops, without sorting the vocabulary:
// specdec.sampling.top_p_drop_torch's mask to the bit (a stable descending sort, the float32
// cumsum accumulated in float64 as torch's CPU cumsum does, the mass strictly above each
// token, dropped where it reaches top_p), for about a tenth of its cost at one row and far
// less at many (torch's sort of [5, 4096] rows took 1.1 ms on the 2-core CPU, and a
// verification sorts γ + 1 of them).
//
// Only the head of the order is sorted: the most likely 32 tokens (std::nth_element, then a
// sort of those), then 4× more, until the mass above the next token clears top_p by a margin
// (1e-6) that no float32 rounding of the later cumsums can take back; every token past that
// point has at least that much mass above it and is dropped, as the full sort would drop it.
// Keys pack (probability descending, token id ascending) into one uint64: a plain integer
// order, ties taken by the lower id as the stable sort takes them.
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace {

constexpr double kMargin = 1e-6;

uint64_t key_of(float p, int64_t token) {
  uint32_t bits;
  std::memcpy(&bits, &p, sizeof bits);  // a non-negative float's bits order as the float does
  return (static_cast<uint64_t>(0xFFFFFFFFu - bits) << 32) | static_cast<uint64_t>(token);
}

void drop_row(const float* p, int64_t vocab, float top_p, bool* drop, std::vector<uint64_t>& keys) {
  keys.resize(vocab);
  for (int64_t v = 0; v < vocab; v++) keys[v] = key_of(p[v], v);
  std::fill(drop, drop + vocab, true);
  double running = 0.0;
  int64_t done = 0;
  for (int64_t head = std::min<int64_t>(32, vocab);; head = std::min(vocab, head * 4)) {
    if (head < vocab) std::nth_element(keys.begin() + done, keys.begin() + head, keys.end());
    std::sort(keys.begin() + done, keys.begin() + head);
    for (; done < head; done++) {
      const int64_t token = static_cast<int64_t>(keys[done] & 0xFFFFFFFFu);
      running += static_cast<double>(p[token]);
      const float before = static_cast<float>(running) - p[token];  // torch: cumsum (float32) − p
      drop[token] = before >= top_p;
    }
    if (done == vocab || running >= static_cast<double>(top_p) + kMargin) return;
  }
}

}  // namespace

torch::Tensor top_p_drop(torch::Tensor probs, double top_p) {
  TORCH_CHECK(probs.dim() >= 1 && probs.scalar_type() == torch::kFloat32 && probs.device().is_cpu(),
              "top_p_drop: probs must be a float32 CPU tensor [..., vocab]");
  const int64_t vocab = probs.size(-1);
  TORCH_CHECK(vocab > 0 && vocab <= 0xFFFFFFFFll, "top_p_drop: a vocabulary of 1 .. 2³² tokens");
  probs = probs.contiguous();
  auto out = torch::empty(probs.sizes(), probs.options().dtype(torch::kBool));
  const int64_t rows = probs.numel() / vocab;
  const float* p = probs.data_ptr<float>();
  bool* d = out.data_ptr<bool>();
  const float threshold = static_cast<float>(top_p);  // as torch compares a float32 tensor with it
  std::vector<uint64_t> keys;
  for (int64_t r = 0; r < rows; r++) drop_row(p + r * vocab, vocab, threshold, d + r * vocab, keys);
  return out;
}
