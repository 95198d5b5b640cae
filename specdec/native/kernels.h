// The kernels one source file of specdec's extension calls in another, declared once
// (bindings.cpp exports them all to Python).
#pragma once
#include <torch/extension.h>
#include <vector>

// half_linear.cpp: x · Wᵀ over 16-bit or int8 weight panels (or int8_dot.cpp's, by dtype)
torch::Tensor half_linear(torch::Tensor x, torch::Tensor packed, int64_t out, c10::optional<torch::Tensor> bias);
int64_t panel_width();
// int8_dot.cpp: int8 weights times int8-rounded rows by 8-bit dot products
torch::Tensor int8_dot_linear(torch::Tensor x, torch::Tensor packed, int64_t out, c10::optional<torch::Tensor> bias);
bool has_int8_dot();
// packed_attention.cpp
torch::Tensor packed_attention(torch::Tensor qkv, int64_t heads, int64_t kv_heads, std::vector<torch::Tensor> caches,
                               std::vector<int64_t> starts, std::vector<int64_t> lengths, int64_t layer, double scale);
// decoder_layer.cpp
torch::Tensor decoder_layer(torch::Tensor x, torch::Tensor norm1, torch::Tensor qkv_w, int64_t qkv_out,
                            torch::Tensor o_w, torch::Tensor norm2, torch::Tensor gate_up_w, int64_t gate_up_out,
                            torch::Tensor down_w, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t kv_heads,
                            std::vector<torch::Tensor> caches, std::vector<int64_t> starts, std::vector<int64_t> lengths,
                            int64_t layer, double scale, double eps);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
// top_p.cpp: the tokens top-p truncation drops, [..., vocab] bool (specdec.sampling.top_p_drop)
torch::Tensor top_p_drop(torch::Tensor probs, double top_p);
// and those tokens' probabilities set to 0 in place (probs contiguous)
void top_p_zero_(torch::Tensor probs, double top_p);
// law_rows.cpp: a sampled law over rows of float32 logits (specdec.sampling.logits_to_probs)
torch::Tensor law_rows(torch::Tensor logits, double temperature, int64_t top_k, double top_p, double min_p);
// shape_rows.cpp: one request's logit shaping (specdec.shaping), and its application to a
// session's rows, row r predicting position first + r after ids[0 .. first + r)
struct Shaping {
  std::vector<int64_t> bias_ids;
  std::vector<float> bias_values;
  std::vector<int64_t> banned;  // at positions < banned_until
  int64_t banned_until = 0;
  float repetition = 1.0f, presence = 0.0f, frequency = 0.0f;
  int64_t penalty_start = 0;  // where the answer starts (presence and frequency count from here)
  bool active() const;
  bool penalises() const;
};
void shape_logit_rows(float* rows, int64_t n_rows, int64_t vocab, const int64_t* ids, int64_t first, const Shaping& s);
// TORCH_CHECK that ids[0 .. n) and the shaping's biased and banned tokens lie in 0 .. vocab − 1
void check_shaping_tokens(const Shaping& s, const int64_t* ids, int64_t n, int64_t vocab, const char* who);
void bind_shaping(pybind11::module& m);
// packed_model.cpp: the PackedModel class
void bind_packed_model(pybind11::module& m);
// sample_rows.cpp
torch::Tensor sample_rows(torch::Tensor probs, torch::Tensor u);
// one row's inverse-CDF draw, as sample_rows draws each (cdf: scratch of at least vocab)
int64_t draw_probability_row(const float* p, int64_t vocab, double u, std::vector<double>& cdf);
int64_t draw_probability_row(const double* p, int64_t vocab, double u, std::vector<double>& cdf);
// the order both block_verdicts.cpp and decode_rows.cpp sum a row in: lane k adds the values
// v ≡ k (mod kMassLanes) in order, then the lanes are added in order (specdec.sampling.lane_sums)
constexpr int kMassLanes = 16;  // specdec.sampling.MASS_LANES
// block_verdicts.cpp: the block rule's verdicts for a batch of sampled sessions
std::tuple<std::vector<int64_t>, std::vector<int64_t>, std::vector<std::vector<double>>> block_verdicts(
    torch::Tensor probs, std::vector<int64_t> starts, std::vector<int64_t> gammas, std::vector<int64_t> tokens,
    std::vector<torch::Tensor> qs, std::vector<uint64_t> seeds, std::vector<int64_t> firsts);
torch::Tensor residual_masses(torch::Tensor w, torch::Tensor p, torch::Tensor q);
// decode_rows.cpp: dense fp16 draft distributions → normalised float64 rows (specdec.wire.decode)
torch::Tensor decode_fp16_rows(pybind11::bytes data, int64_t rows, int64_t vocab);
// and quantised float32 rows → (their dense fp16 bytes, each row's count of positive values) (specdec.wire.encode)
std::tuple<pybind11::bytes, std::vector<int64_t>> encode_fp16_rows(torch::Tensor q);
// and each row's sum of [rows, vocab] fp16 values alone, in sampling.lane_sums' order, with
// decode's refusals (specdec.wire.decode_half)
torch::Tensor fp16_row_sums(torch::Tensor values);
