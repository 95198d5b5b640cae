// Shaping a session's logits rows in place: specdec/shaping.py's `shaped` to the bit (the
// logit bias, the tokens banned before min_tokens, then the repetition, presence and
// frequency penalties), without its dozen numpy and torch operators a call (70–190 µs a
// session on the 2-core CPU; this: a few µs).
//
// Row r of a call predicts position first + r and has seen ids[0 .. first + r). The counts
// of the tokens seen are kept in two scratch tables of the vocabulary's size (per thread,
// reset token by token after the call, so a call costs its prefix and its touched tokens,
// never the vocabulary): one pass over the common prefix, then each row adds the token
// before it. The arithmetic is the reference's: the bias and the repetition penalty in
// float32, presence and frequency in float64 (numpy promotes the counts) rounded back.
#include <torch/extension.h>

#include <limits>
#include <vector>

#include "kernels.h"

namespace {

struct Counts {
  std::vector<int32_t> whole, answer;  // per token id: occurrences in the prefix, and in its answer part
  std::vector<int64_t> seen;           // the distinct tokens counted, in first-seen order

  void begin(int64_t vocab) {
    if (static_cast<int64_t>(whole.size()) < vocab) {
      whole.assign(vocab, 0);
      answer.assign(vocab, 0);
    }
  }
  void add(int64_t token, bool in_answer) {
    if (whole[token] == 0) seen.push_back(token);
    whole[token]++;
    answer[token] += in_answer;
  }
  void clear() {
    for (int64_t t : seen) whole[t] = answer[t] = 0;
    seen.clear();
  }
};

Counts& scratch() {
  thread_local Counts counts;
  return counts;
}

void penalise_row(float* row, const Counts& c, const Shaping& s) {
  const bool repeat = s.repetition != 1.0f, additive = s.presence != 0.0f || s.frequency != 0.0f;
  for (int64_t t : c.seen) {
    float v = row[t];
    if (repeat) v = v > 0 ? v / s.repetition : v * s.repetition;
    if (additive && c.answer[t] > 0)
      v = static_cast<float>(static_cast<double>(v) - static_cast<double>(s.frequency) * c.answer[t] -
                             static_cast<double>(s.presence));
    row[t] = v;
  }
}

}  // namespace

bool Shaping::active() const {
  return !bias_ids.empty() || (!banned.empty() && banned_until > 0) || penalises();
}

bool Shaping::penalises() const { return repetition != 1.0f || presence != 0.0f || frequency != 0.0f; }

void shape_logit_rows(float* rows, int64_t n_rows, int64_t vocab, const int64_t* ids, int64_t first,
                      const Shaping& s) {
  for (int64_t r = 0; r < n_rows; r++) {
    float* row = rows + r * vocab;
    for (size_t i = 0; i < s.bias_ids.size(); i++) row[s.bias_ids[i]] += s.bias_values[i];
    if (first + r < s.banned_until)
      for (int64_t t : s.banned) row[t] = -std::numeric_limits<float>::infinity();
  }
  if (!s.penalises() || first + n_rows - 1 <= 0) return;
  Counts& c = scratch();
  c.begin(vocab);
  for (int64_t i = 0; i < first; i++) c.add(ids[i], i >= s.penalty_start);
  for (int64_t r = 0; r < n_rows; r++) {
    if (r > 0) c.add(ids[first + r - 1], first + r - 1 >= s.penalty_start);
    penalise_row(rows + r * vocab, c, s);
  }
  c.clear();
}

void check_shaping_tokens(const Shaping& s, const int64_t* ids, int64_t n, int64_t vocab, const char* who) {
  for (int64_t i = 0; i < n; i++)
    TORCH_CHECK(ids[i] >= 0 && ids[i] < vocab, who, ": id ", ids[i], " at ", i, " is outside 0..", vocab - 1);
  for (int64_t t : s.bias_ids) TORCH_CHECK(t >= 0 && t < vocab, who, ": biased token ", t, " is outside 0..", vocab - 1);
  for (int64_t t : s.banned) TORCH_CHECK(t >= 0 && t < vocab, who, ": banned token ", t, " is outside 0..", vocab - 1);
}

namespace {

// logits [rows, vocab] float32 (contiguous, CPU), shaped in place; ids int64 [≥ first + rows − 1]
void shape_rows(torch::Tensor logits, torch::Tensor ids, int64_t first, const Shaping& s) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.is_contiguous() &&
                  logits.device().is_cpu(),
              "shape_rows: logits must be a contiguous float32 CPU tensor [rows, vocab]");
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kLong && ids.device().is_cpu(),
              "shape_rows: ids must be a 1-D int64 CPU tensor");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(first >= 0, "shape_rows: first must be ≥ 0");
  if (rows == 0) return;
  const int64_t needed = s.penalises() ? first + rows - 1 : 0;
  TORCH_CHECK(ids.size(0) >= needed, "shape_rows: ", ids.size(0), " ids for rows that have seen ", needed);
  ids = ids.contiguous();
  const int64_t* p = ids.data_ptr<int64_t>();
  check_shaping_tokens(s, p, needed, vocab, "shape_rows");
  shape_logit_rows(logits.data_ptr<float>(), rows, vocab, p, first, s);
}

}  // namespace

void bind_shaping(pybind11::module& m) {
  pybind11::class_<Shaping>(m, "Shaping", "one request's logit shaping (specdec.shaping), as the kernels take it")
      .def(pybind11::init([](std::vector<int64_t> bias_ids, std::vector<double> bias_values, std::vector<int64_t> banned,
                             int64_t banned_until, double repetition, double presence, double frequency,
                             int64_t penalty_start) {
             TORCH_CHECK(bias_ids.size() == bias_values.size(), "Shaping: one bias value per biased token");
             Shaping s;
             s.bias_ids = std::move(bias_ids);
             s.bias_values.assign(bias_values.begin(), bias_values.end());  // float32, as torch.tensor makes them
             s.banned = std::move(banned);
             s.banned_until = banned_until;
             s.repetition = static_cast<float>(repetition);
             s.presence = static_cast<float>(presence);
             s.frequency = static_cast<float>(frequency);
             s.penalty_start = penalty_start;
             return s;
           }),
           pybind11::arg("bias_ids"), pybind11::arg("bias_values"), pybind11::arg("banned"),
           pybind11::arg("banned_until"), pybind11::arg("repetition"), pybind11::arg("presence"),
           pybind11::arg("frequency"), pybind11::arg("penalty_start"))
      .def(pybind11::init<>(), "no shaping (an item of a native draft that shapes nothing)")
      .def("active", &Shaping::active);
  m.def("shape_rows", &shape_rows, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "shape a session's logits rows in place, as specdec.shaping.shaped");
}
