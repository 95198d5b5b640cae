// Which tokens top-p (nucleus) truncation drops, without sorting the vocabulary:
// specdec.sampling.top_p_drop_torch's mask to the bit (a stable descending sort, the float32
// cumsum accumulated in float64 as torch's CPU cumsum does, the mass strictly above each
// token, dropped where it reaches top_p), for about a tenth of its cost at one row and far
// less at many (torch's sort of [5, 4096] rows took 1.1 ms on the 2-core CPU, and a
// verification sorts γ + 1 of them).
//
// Only the head of the order is sorted. One pass sums the probabilities into 1,024 buckets by
// their float bits' top (the exponent and three mantissa bits: a bucket's values all exceed a
// lower one's; four histograms, summed after, so that the additions into one bucket do not
// wait on each other); walking down from the largest, the bucket where the mass reaches top_p plus a
// margin (1e-6, beyond any float32 rounding of torch's cumsums) ends the candidates: every
// token below it has at least that mass above it and is dropped, as the full sort drops it.
// The candidates, a prefix of the sorted order, are sorted by a stable radix sort of their
// float bits (collected in id order: ties stay in id order, as the stable sort keeps them),
// and their cumsum taken in that order, exactly as torch's. The small models' nuclei at
// top_p 0.95 hold 300–1,300 of 4,096 tokens: a comparison sort of those costs 50–70 µs a row.
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "kernels.h"

namespace {

constexpr double kMargin = 1e-6;
constexpr int kBucketShift = 20;  // a non-negative float's bits 30..20: its exponent and 3 mantissa bits
constexpr int kMassBuckets = 1 << 10;  // those of values below 2 (a probability's), the rest in the top one
constexpr int kMassLanes = 4;  // histograms summed apart: a row's many tiny values, which share a few
                               // buckets, would otherwise wait on each other's additions
constexpr int kBuckets = 1 << 11;  // the radix sort's digits: 11 bits
constexpr int64_t kComparisonSortBelow = 96;  // fewer candidates than this: std::sort

struct Scratch {
  std::vector<double> mass;
  std::vector<uint64_t> keys, spare;
  std::vector<int64_t> counts;
};

uint32_t bits_of(float p) {
  uint32_t bits;
  std::memcpy(&bits, &p, sizeof bits);  // a non-negative float's bits order as the float does
  return bits & 0x7FFFFFFFu;            // (−0 as 0; probabilities are never negative)
}

// keys: (0xFFFFFFFF − float bits) << 32 | token, in token order → sorted ascending (by
// probability descending, then token), stably by three 11-bit digits of the high half
void radix_sort(std::vector<uint64_t>& keys, std::vector<uint64_t>& spare, std::vector<int64_t>& counts) {
  spare.resize(keys.size());
  for (int shift = 32; shift < 64; shift += 11) {
    counts.assign(kBuckets + 1, 0);
    for (uint64_t k : keys) counts[((k >> shift) & (kBuckets - 1)) + 1]++;
    for (int b = 0; b < kBuckets; b++) counts[b + 1] += counts[b];
    for (uint64_t k : keys) spare[counts[(k >> shift) & (kBuckets - 1)]++] = k;
    keys.swap(spare);
  }
}

int bucket_of(float p) { return std::min(static_cast<int>(bits_of(p) >> kBucketShift), kMassBuckets - 1); }

void drop_row(const float* p, int64_t vocab, float top_p, bool* drop, Scratch& s) {
  s.mass.assign(kMassLanes * kMassBuckets, 0.0);
  double* lanes = s.mass.data();
  int64_t v = 0;
  for (; v + kMassLanes <= vocab; v += kMassLanes)
    for (int l = 0; l < kMassLanes; l++) lanes[l * kMassBuckets + bucket_of(p[v + l])] += static_cast<double>(p[v + l]);
  for (; v < vocab; v++) lanes[bucket_of(p[v])] += static_cast<double>(p[v]);
  int first = 0;  // the lowest bucket of the candidates
  double above = 0.0;
  for (int b = kMassBuckets - 1; b >= 0; b--) {
    for (int l = 0; l < kMassLanes; l++) above += lanes[l * kMassBuckets + b];
    if (above >= static_cast<double>(top_p) + kMargin) {
      first = b;
      break;
    }
  }
  s.keys.clear();
  for (int64_t v = 0; v < vocab; v++) {
    const uint32_t bits = bits_of(p[v]);
    drop[v] = true;
    if (bucket_of(p[v]) >= first)
      s.keys.push_back((static_cast<uint64_t>(0xFFFFFFFFu - bits) << 32) | static_cast<uint64_t>(v));
  }
  if (static_cast<int64_t>(s.keys.size()) < kComparisonSortBelow) std::sort(s.keys.begin(), s.keys.end());
  else radix_sort(s.keys, s.spare, s.counts);
  double running = 0.0;
  for (uint64_t k : s.keys) {
    const int64_t token = static_cast<int64_t>(k & 0xFFFFFFFFu);
    running += static_cast<double>(p[token]);
    const float before = static_cast<float>(running) - p[token];  // torch: cumsum (float32) − p
    drop[token] = before >= top_p;
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
  Scratch scratch;
  for (int64_t r = 0; r < rows; r++) drop_row(p + r * vocab, vocab, threshold, d + r * vocab, scratch);
  return out;
}

void top_p_zero_(torch::Tensor probs, double top_p) {
  TORCH_CHECK(probs.dim() >= 1 && probs.scalar_type() == torch::kFloat32 && probs.device().is_cpu() &&
                  probs.is_contiguous(),
              "top_p_zero_: probs must be a contiguous float32 CPU tensor [..., vocab]");
  const int64_t vocab = probs.size(-1);
  TORCH_CHECK(vocab > 0 && vocab <= 0xFFFFFFFFll, "top_p_zero_: a vocabulary of 1 .. 2³² tokens");
  const int64_t rows = probs.numel() / vocab;
  float* p = probs.data_ptr<float>();
  std::unique_ptr<bool[]> drop(new bool[vocab]);
  Scratch scratch;
  for (int64_t r = 0; r < rows; r++, p += vocab) {
    drop_row(p, vocab, static_cast<float>(top_p), drop.get(), scratch);
    for (int64_t v = 0; v < vocab; v++)
      if (drop[v]) p[v] = 0.0f;
  }
}
