// A whole forward of the fused case as one call: the embedding's rows, every decoder layer
// (decoder_layer.cpp), the final norm of the rows that want logits, and the LM head.
//
// Why: at one row the bundled draft's step was 69 µs, of which its layer took 23 and its head
// 17; about 20 µs went to the Python between them (the rotary tables' rows and their views,
// the embedding, the rows' slices, the norm's and the head's calls). A PackedModel holds the
// weights once (the runner's own tensors, no copies), so a call passes only what changes:
// the tokens, the caches and where each session's rows start.
#include <torch/extension.h>
#include <algorithm>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

#include "kernels.h"

namespace {

// rows [start, start + n) of each item's `table` ([positions, width], contiguous float32),
// one after the other: [Σ n, width]
torch::Tensor gather_rows(const torch::Tensor& table, const std::vector<int64_t>& starts,
                          const std::vector<int64_t>& counts) {
  const int64_t width = table.size(1);
  int64_t total = 0;
  for (int64_t n : counts) total += n;
  auto out = torch::empty({total, width}, table.options());
  const float* src = table.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for (size_t i = 0; i < starts.size(); i++) {
    std::memcpy(dst, src + starts[i] * width, counts[i] * width * sizeof(float));
    dst += counts[i] * width;
  }
  return out;
}

}  // namespace

class PackedModel {
 public:
  // layers: per layer [norm1, qkv, o, norm2, gate_up, down] (the products packed for
  // half_linear), with the column counts of qkv and gate_up; cos/sin the runner's tables
  PackedModel(torch::Tensor embed, torch::Tensor cos, torch::Tensor sin, std::vector<std::vector<torch::Tensor>> layers,
              std::vector<int64_t> qkv_out, std::vector<int64_t> gate_up_out, torch::Tensor final_norm,
              torch::Tensor head, int64_t vocab, int64_t heads, int64_t kv_heads, double scale, double eps)
      : embed_(embed), cos_(cos), sin_(sin), layers_(std::move(layers)), qkv_out_(std::move(qkv_out)),
        gate_up_out_(std::move(gate_up_out)), final_norm_(final_norm), head_(head), vocab_(vocab), heads_(heads),
        kv_heads_(kv_heads), scale_(scale), eps_(eps) {
    TORCH_CHECK(embed.dim() == 2 && embed.scalar_type() == torch::kFloat32, "PackedModel: the embedding must be float32 [vocab, hidden]");
    TORCH_CHECK(cos.dim() == 2 && cos.is_contiguous() && sin.sizes() == cos.sizes() && sin.is_contiguous() &&
                    cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32,
                "PackedModel: the rotary tables must be contiguous float32 [positions, head_dim]");
    TORCH_CHECK(!layers_.empty() && qkv_out_.size() == layers_.size() && gate_up_out_.size() == layers_.size(),
                "PackedModel: every layer needs its weights and its q/k/v and gate/up column counts");
    for (const auto& layer : layers_) TORCH_CHECK(layer.size() == 6, "PackedModel: a layer is six tensors");
  }

  // ids [N] int64, the items' tokens one after the other; → [Σ logits_rows, vocab] float32,
  // the logits of each item's last logits_rows positions, in item order
  torch::Tensor forward(torch::Tensor ids, std::vector<torch::Tensor> caches, std::vector<int64_t> starts,
                        std::vector<int64_t> lengths, std::vector<int64_t> logits_rows) {
    TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kLong, "PackedModel.forward: ids must be 1-D int64");
    TORCH_CHECK(starts.size() == lengths.size() && lengths.size() == logits_rows.size() && caches.size() == lengths.size(),
                "PackedModel.forward: one cache, start, length and logits_rows per item");
    int64_t total = 0;
    for (size_t i = 0; i < lengths.size(); i++) {
      TORCH_CHECK(lengths[i] >= 1 && logits_rows[i] >= 1 && logits_rows[i] <= lengths[i],
                  "PackedModel.forward: an item feeds at least one token and wants logits for 1 .. its tokens");
      TORCH_CHECK(starts[i] >= 0 && starts[i] + lengths[i] <= cos_.size(0), "PackedModel.forward: positions ",
                  starts[i], "..", starts[i] + lengths[i], " exceed the rotary table's ", cos_.size(0));
      total += lengths[i];
    }
    TORCH_CHECK(ids.size(0) == total, "PackedModel.forward: ", ids.size(0), " ids for ", total, " tokens");
    auto x = embed_.index_select(0, ids).contiguous();  // [N, hidden]
    const auto cos = gather_rows(cos_, starts, lengths), sin = gather_rows(sin_, starts, lengths);
    for (size_t l = 0; l < layers_.size(); l++) {
      const auto& w = layers_[l];
      x = decoder_layer(x, w[0], w[1], qkv_out_[l], w[2], w[3], w[4], gate_up_out_[l], w[5], cos, sin, heads_, kv_heads_,
                        caches, starts, lengths, static_cast<int64_t>(l), scale_, eps_);
    }
    std::vector<int64_t> last_starts(lengths.size());
    int64_t end = 0;
    for (size_t i = 0; i < lengths.size(); i++) {
      end += lengths[i];
      last_starts[i] = end - logits_rows[i];
    }
    auto last = gather_rows(x, last_starts, logits_rows);  // [R, hidden]
    return half_linear(rms_norm(last, final_norm_, eps_), head_, vocab_, c10::nullopt);
  }

  // A sampled draft of gammas[b] tokens per item, all steps in this one call, as DraftEngine's
  // step loop draws under one law: each step's logits through `law_rows` (temperature, top-k,
  // top-p, min-p), rounded to fp16 (wire.quantize: what the target will be sent), and the
  // token drawn from those values with uniforms[b, step] (sampling.sample_from's draw). The
  // same operators on the same rows, and the same draw, so the tokens and q are the loop's
  // to the bit. Caches as `draft_greedy` leaves them. → ([B, max γ] int64 tokens,
  // [B, max γ, vocab] float32 q), row b's first gammas[b].
  std::tuple<torch::Tensor, torch::Tensor> draft_sampled(torch::Tensor ids, std::vector<torch::Tensor> caches,
                                                         std::vector<int64_t> starts, std::vector<int64_t> lengths,
                                                         std::vector<int64_t> gammas, double temperature,
                                                         int64_t top_k, double top_p, double min_p,
                                                         torch::Tensor uniforms, std::vector<Shaping> shapings,
                                                         std::vector<torch::Tensor> prefixes) {
    TORCH_CHECK(temperature > 0, "PackedModel.draft_sampled: the temperature must be positive");
    TORCH_CHECK(top_k >= 0 && top_p > 0 && top_p <= 1 && min_p >= 0 && min_p <= 1,
                "PackedModel.draft_sampled: top_k ≥ 0, top_p in (0, 1] and min_p in [0, 1]");
    const int64_t B = static_cast<int64_t>(caches.size()), G = longest_draft(gammas, B, "draft_sampled");
    TORCH_CHECK(uniforms.dim() == 2 && uniforms.size(0) == B && uniforms.size(1) >= G &&
                    uniforms.scalar_type() == torch::kFloat64,
                "PackedModel.draft_sampled: uniforms must be float64 [items, max γ]");
    uniforms = uniforms.contiguous();
    const double* us = uniforms.data_ptr<double>();
    const int64_t ustride = uniforms.size(1);
    auto q_out = torch::zeros({B, G, vocab_}, torch::kFloat32);
    float* q = q_out.data_ptr<float>();
    std::vector<double> cdf(vocab_);
    auto tokens = draft_steps(ids, caches, starts, lengths, gammas, G, shapings, prefixes,
                              [&](torch::Tensor logits, const std::vector<int64_t>& live, int64_t step) {
      const auto law = law_rows(logits.to(torch::kFloat32), temperature, top_k, top_p, min_p);
      const auto q16 = law.to(torch::kHalf).to(torch::kFloat).contiguous();
      const float* rows = q16.data_ptr<float>();
      std::vector<int64_t> drawn(live.size());
      for (size_t r = 0; r < live.size(); r++) {
        const float* row = rows + r * vocab_;
        std::memcpy(q + (live[r] * G + step) * vocab_, row, vocab_ * sizeof(float));
        drawn[r] = draw_probability_row(row, vocab_, us[live[r] * ustride + step], cdf);
      }
      return drawn;
    });
    return {tokens, q_out};
  }

  // A greedy draft of gammas[b] tokens per item, all steps in this one call: step 0 feeds
  // each item's ids (as `forward`), every later step the argmax of the step before, while
  // the item has tokens left to draft (its last token is not fed: the draft's cache then
  // holds starts[b] + lengths[b] + gammas[b] − 1 positions, as the Python loop leaves it).
  // The caches must have room for that already. → [B, max γ] int64, row b's first gammas[b]
  // entries its tokens, each a row's first maximum (numpy's and torch's argmax).
  torch::Tensor draft_greedy(torch::Tensor ids, std::vector<torch::Tensor> caches, std::vector<int64_t> starts,
                             std::vector<int64_t> lengths, std::vector<int64_t> gammas, std::vector<Shaping> shapings,
                             std::vector<torch::Tensor> prefixes) {
    const int64_t G = longest_draft(gammas, static_cast<int64_t>(caches.size()), "draft_greedy");
    return draft_steps(ids, caches, starts, lengths, gammas, G, shapings, prefixes,
                       [&](torch::Tensor logits, const std::vector<int64_t>& live, int64_t) {
      const float* l = logits.data_ptr<float>();
      std::vector<int64_t> best(live.size(), 0);
      for (size_t r = 0; r < live.size(); r++) {
        const float* row = l + r * vocab_;
        for (int64_t v = 1; v < vocab_; v++)
          if (row[v] > row[best[r]]) best[r] = v;
      }
      return best;
    });
  }

 private:
  static int64_t longest_draft(const std::vector<int64_t>& gammas, int64_t items, const char* name) {
    TORCH_CHECK(static_cast<int64_t>(gammas.size()) == items, "PackedModel.", name, ": one γ per item");
    int64_t G = 0;
    for (int64_t g : gammas) {
      TORCH_CHECK(g >= 1, "PackedModel.", name, ": every item drafts at least one token");
      G = std::max(G, g);
    }
    return G;
  }

  // The steps of a draft: step 0 feeds each item's ids, every later step the token `pick`
  // chose for it (pick(logits [live, vocab], live items, step) → one token per live row),
  // while the item has tokens left to draft. → [B, G] int64 tokens.
  //
  // shapings: none, or one per item (an inactive one for an item that shapes nothing); an
  // active item's rows are shaped before `pick` sees them (shape_rows.cpp), by its tokens:
  // prefixes[b], its ids at positions 0 .. starts[b] + lengths[b] (the cache's, then the fed
  // ones), then the tokens drafted so far; as DraftEngine's step loop shapes them.
  template <typename Pick>
  torch::Tensor draft_steps(torch::Tensor ids, const std::vector<torch::Tensor>& caches, std::vector<int64_t> starts,
                            std::vector<int64_t> lengths, const std::vector<int64_t>& gammas, int64_t G,
                            const std::vector<Shaping>& shapings, const std::vector<torch::Tensor>& prefixes,
                            Pick pick) {
    const int64_t B = static_cast<int64_t>(caches.size());
    auto seqs = shaped_sequences(shapings, prefixes, starts, lengths, B);
    auto out = torch::zeros({B, G}, torch::kLong);
    int64_t* tokens = out.data_ptr<int64_t>();
    std::vector<int64_t> live(B);
    for (int64_t b = 0; b < B; b++) live[b] = b;
    for (int64_t step = 0; step < G && !live.empty(); step++) {
      std::vector<torch::Tensor> step_caches;
      for (int64_t b : live) step_caches.push_back(caches[b]);
      const auto logits = forward(ids, step_caches, starts, lengths, std::vector<int64_t>(live.size(), 1));
      for (size_t r = 0; r < live.size() && !seqs.empty(); r++) {
        auto& seq = seqs[live[r]];
        if (shapings[live[r]].active())
          shape_logit_rows(logits.data_ptr<float>() + r * vocab_, 1, vocab_, seq.data(),
                           static_cast<int64_t>(seq.size()), shapings[live[r]]);
      }
      const auto chosen = pick(logits, live, step);
      for (size_t r = 0; r < live.size() && !seqs.empty(); r++)
        if (shapings[live[r]].active()) seqs[live[r]].push_back(chosen[r]);
      std::vector<int64_t> next_live, next_starts, next_tokens;
      for (size_t r = 0; r < live.size(); r++) {
        const int64_t b = live[r];
        tokens[b * G + step] = chosen[r];
        if (step + 1 < gammas[b]) {
          next_live.push_back(b);
          next_starts.push_back(starts[r] + lengths[r]);
          next_tokens.push_back(chosen[r]);
        }
      }
      live = std::move(next_live);
      starts = std::move(next_starts);
      lengths.assign(live.size(), 1);
      ids = torch::tensor(next_tokens, torch::kLong);
    }
    return out;
  }

  // each shaping item's ids so far (its prefix, checked), to which its drafted tokens are
  // appended step by step; empty where no item shapes
  std::vector<std::vector<int64_t>> shaped_sequences(const std::vector<Shaping>& shapings,
                                                     const std::vector<torch::Tensor>& prefixes,
                                                     const std::vector<int64_t>& starts,
                                                     const std::vector<int64_t>& lengths, int64_t B) const {
    std::vector<std::vector<int64_t>> seqs;
    if (shapings.empty()) return seqs;
    TORCH_CHECK(static_cast<int64_t>(shapings.size()) == B && static_cast<int64_t>(prefixes.size()) == B,
                "PackedModel: one shaping and one prefix per item, or none");
    seqs.resize(B);
    for (int64_t b = 0; b < B; b++) {
      if (!shapings[b].active()) continue;
      const auto prefix = prefixes[b].contiguous();
      TORCH_CHECK(prefix.dim() == 1 && prefix.scalar_type() == torch::kLong && prefix.size(0) == starts[b] + lengths[b],
                  "PackedModel: item ", b, "'s prefix must be its ", starts[b] + lengths[b], " ids (int64)");
      const int64_t* p = prefix.data_ptr<int64_t>();
      check_shaping_tokens(shapings[b], p, prefix.size(0), vocab_, "PackedModel (shaping)");
      seqs[b].assign(p, p + prefix.size(0));
    }
    return seqs;
  }

  torch::Tensor embed_, cos_, sin_;
  std::vector<std::vector<torch::Tensor>> layers_;
  std::vector<int64_t> qkv_out_, gate_up_out_;
  torch::Tensor final_norm_, head_;
  int64_t vocab_, heads_, kv_heads_;
  double scale_, eps_;
};

void bind_packed_model(pybind11::module& m) {
  pybind11::class_<PackedModel>(m, "PackedModel", "a whole fused forward as one call (specdec.model_runner)")
      .def(pybind11::init<torch::Tensor, torch::Tensor, torch::Tensor, std::vector<std::vector<torch::Tensor>>,
                          std::vector<int64_t>, std::vector<int64_t>, torch::Tensor, torch::Tensor, int64_t, int64_t,
                          int64_t, double, double>())
      .def("forward", &PackedModel::forward, pybind11::call_guard<pybind11::gil_scoped_release>(),
           "the items' tokens through the model → their logits rows (without the GIL, as bindings.cpp's kernels)")
      .def("draft_greedy", &PackedModel::draft_greedy, pybind11::call_guard<pybind11::gil_scoped_release>(),
           "a greedy draft of γ tokens per item, every step in this call → [B, max γ] tokens")
      .def("draft_sampled", &PackedModel::draft_sampled, pybind11::call_guard<pybind11::gil_scoped_release>(),
           "a sampled draft of γ tokens per item under one law, every step in this call → "
           "([B, max γ] tokens, [B, max γ, vocab] fp16-rounded q)");
}
