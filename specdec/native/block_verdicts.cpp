// The block rule's verdicts for a batch of sampled sessions in one call: what
// target_service.engine.TargetEngine decides with specdec.sampling's row functions
// (block_weights_row, residual_mass, block_prefix_row, next_tokens), to the bit, without
// their two dozen operator dispatches and list conversions (about 0.26 ms for one session at
// γ = 4 on the 2-core CPU, a sixth of the target's time a round at temperature 1).
//
// Per session, with its rows of target probabilities p (float32, already at its law) and
// its draft distributions q (float64):
// - the weights w_0 = 1, w_i = min(1, w_{i−1} · p(x_i) / q(x_i)) in the same double
//   operations in the same order as block_weights_row;
// - the kept prefix, longest first (block_prefix_row): all γ when η_γ < w_γ, else the
//   longest inner i with η_i < m_i / (m_i + 1 − w_i), the residual mass m_i summed in
//   sampling.residual_mass's order; a mass is computed only when the scan reaches it;
// - after a stop short of the draft, the recovery token drawn from max(0, w_n p − q) (or p
//   itself where that has no mass) by sample_rows' inverse-CDF draw at the resample
//   stream's uniform. A session that keeps its whole draft gets −1: its bonus is drawn in
//   Python by the exponential race (sampling.race_argmax), whose noise the draft shares.
// The uniforms are sampling.uniform's counter-based hash (splitmix64), in integers, so the
// same numbers. No fused multiply-adds: each product is rounded before its difference, as
// torch's separate operators round it.
#pragma GCC optimize("fp-contract=off")
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include "kernels.h"

namespace {

constexpr int64_t kStreamAccept = 2, kStreamResample = 3;  // specdec.sampling.STREAM_*

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

double uniform(uint64_t seed, int64_t position, int64_t stream) {
  const uint64_t h = splitmix64(seed ^ splitmix64(static_cast<uint64_t>(position) * 4 + stream));
  return static_cast<double>(h >> 11) * (1.0 / 9007199254740992.0);  // 2^53
}

// max(0, w · p(v) − q(v)) for every token v into out (q null: no draft law, subtract nothing)
// → whether any of it is positive
bool residual_row(const float* p, const double* q, double w, int64_t vocab, double* out) {
  bool any = false;
  for (int64_t v = 0; v < vocab; v++) {
    double x = static_cast<double>(p[v]) * w;
    x = x - (q ? q[v] : 0.0);
    out[v] = x > 0.0 ? x : 0.0;
    any |= x > 0.0;
  }
  return any;
}

// Σ_v max(0, w · p(v) − q(v)) in sampling.residual_mass's order: lane k sums the tokens
// v ≡ k (mod kMassLanes) in token order, then the lanes are added in order. Independent chains
// of adds, which vectorise, where one chain of the whole vocabulary would wait on every add.
template <typename P>
double residual_mass(const P* p, const double* q, double w, int64_t vocab) {
  double lane[kMassLanes] = {};
  int64_t v = 0;
  for (; v + kMassLanes <= vocab; v += kMassLanes)
    for (int k = 0; k < kMassLanes; k++) {
      double x = static_cast<double>(p[v + k]) * w;
      x = x - q[v + k];
      lane[k] += x > 0.0 ? x : 0.0;
    }
  for (int k = 0; v + k < vocab; k++) {
    double x = static_cast<double>(p[v + k]) * w;
    x = x - q[v + k];
    lane[k] += x > 0.0 ? x : 0.0;
  }
  double sum = 0.0;
  for (int k = 0; k < kMassLanes; k++) sum += lane[k];
  return sum;
}

}  // namespace

// probs [rows, vocab] float32: every session's γ_b + 1 rows from starts[b]; tokens: the
// drafts laid end to end; qs[b]: [γ_b, vocab] float64 (any tensor where γ_b = 0); seeds and
// firsts (the position of each first draft token) for the uniforms
// → (kept lengths, next tokens or −1 for a bonus, weights w_0..w_γb per session)
std::tuple<std::vector<int64_t>, std::vector<int64_t>, std::vector<std::vector<double>>> block_verdicts(
    torch::Tensor probs, std::vector<int64_t> starts, std::vector<int64_t> gammas, std::vector<int64_t> tokens,
    std::vector<torch::Tensor> qs, std::vector<uint64_t> seeds, std::vector<int64_t> firsts) {
  const size_t B = gammas.size();
  TORCH_CHECK(probs.dim() == 2 && probs.device().is_cpu() && probs.scalar_type() == torch::kFloat32,
              "block_verdicts: probs must be a [rows, vocab] float32 CPU tensor");
  TORCH_CHECK(starts.size() == B && qs.size() == B && seeds.size() == B && firsts.size() == B,
              "block_verdicts: one start, q, seed and first position per session");
  probs = probs.contiguous();
  const int64_t rows = probs.size(0), vocab = probs.size(1);
  const float* P = probs.data_ptr<float>();
  std::vector<torch::Tensor> q_rows(B);
  int64_t drafted = 0;
  for (size_t b = 0; b < B; b++) {
    const int64_t g = gammas[b];
    TORCH_CHECK(g >= 0 && starts[b] >= 0 && starts[b] + g < rows, "block_verdicts: session ", b,
                "'s rows lie outside probs");
    if (g > 0) {
      TORCH_CHECK(qs[b].device().is_cpu() && qs[b].scalar_type() == torch::kFloat64 && qs[b].dim() == 2 &&
                      qs[b].size(0) == g && qs[b].size(1) == vocab,
                  "block_verdicts: session ", b, "'s q must be a [γ, vocab] float64 CPU tensor");
      q_rows[b] = qs[b].contiguous();
    }
    drafted += g;
  }
  TORCH_CHECK(static_cast<int64_t>(tokens.size()) == drafted, "block_verdicts: ", drafted,
              " draft tokens expected, got ", tokens.size());
  for (int64_t t : tokens) TORCH_CHECK(0 <= t && t < vocab, "block_verdicts: a draft token outside the vocabulary");

  std::vector<int64_t> kept(B), next(B);
  std::vector<std::vector<double>> weights(B);
  std::vector<double> residual(vocab), cdf(vocab);
  const int64_t* x = tokens.data();
  for (size_t b = 0; b < B; b++) {
    const int64_t g = gammas[b];
    const float* p = P + starts[b] * vocab;
    const double* q = g > 0 ? q_rows[b].data_ptr<double>() : nullptr;
    std::vector<double>& w = weights[b];
    w.assign(1, 1.0);
    for (int64_t i = 0; i < g; i++) {
      const double px = static_cast<double>(p[i * vocab + x[i]]), qx = q[i * vocab + x[i]];
      w.push_back(std::min(w.back() * (qx > 0 ? px / qx : 0.0), 1.0));
    }
    int64_t n = 0;
    if (g > 0 && uniform(seeds[b], firsts[b] + g - 1, kStreamAccept) < w[g]) {
      n = g;
    } else {
      for (int64_t i = g - 1; i >= 1; i--) {
        const double m = residual_mass(p + i * vocab, q + i * vocab, w[i], vocab);
        const double denominator = m + 1.0 - w[i];
        if (uniform(seeds[b], firsts[b] + i - 1, kStreamAccept) < (denominator > 0 ? m / denominator : 0.0)) {
          n = i;
          break;
        }
      }
    }
    kept[b] = n;
    if (g > 0 && n == g) {
      next[b] = -1;  // the bonus: by the exponential race, in Python
    } else {
      const float* pn = p + n * vocab;
      const double u = uniform(seeds[b], firsts[b] + n, kStreamResample);
      const double wn = g > 0 ? w[n] : 1.0;
      next[b] = residual_row(pn, q ? q + n * vocab : nullptr, wn, vocab, residual.data())
                    ? draw_probability_row(residual.data(), vocab, u, cdf)
                    : draw_probability_row(pn, vocab, u, cdf);  // p == q to rounding: p itself
    }
    x += g;
  }
  return {kept, next, weights};
}

// w [R] float64, p [R, vocab] float32 or float64, q [R, vocab] float64 → [R] residual masses,
// exactly as block_verdicts sums them (sampling.residual_mass calls this on a CPU)
torch::Tensor residual_masses(torch::Tensor w, torch::Tensor p, torch::Tensor q) {
  TORCH_CHECK(p.dim() == 2 && q.sizes() == p.sizes() && w.dim() == 1 && w.size(0) == p.size(0),
              "residual_masses: w [R], p and q [R, vocab]");
  TORCH_CHECK(p.device().is_cpu() && q.device().is_cpu() && w.device().is_cpu(), "residual_masses: CPU tensors");
  TORCH_CHECK(p.scalar_type() == torch::kFloat32 || p.scalar_type() == torch::kFloat64,
              "residual_masses: p must be float32 or float64");
  p = p.contiguous();
  q = q.to(torch::kFloat64).contiguous();
  w = w.to(torch::kFloat64).contiguous();
  const int64_t rows = p.size(0), vocab = p.size(1);
  auto out = torch::empty({rows}, w.options());
  double* o = out.data_ptr<double>();
  const double *ws = w.data_ptr<double>(), *qs = q.data_ptr<double>();
  for (int64_t r = 0; r < rows; r++)
    o[r] = p.scalar_type() == torch::kFloat32
               ? residual_mass(p.data_ptr<float>() + r * vocab, qs + r * vocab, ws[r], vocab)
               : residual_mass(p.data_ptr<double>() + r * vocab, qs + r * vocab, ws[r], vocab);
  return out;
}
