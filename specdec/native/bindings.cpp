// The Python module of specdec's CPU kernels (specdec/native/__init__.py builds and loads
// it), and the instruction set they run.
#include <torch/extension.h>

#include "isa.h"
#include "kernels.h"

namespace specdec {

Isa detected_isa() {
  static const Isa best = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return Isa::kAvx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
      return Isa::kAvx2;
    return Isa::kScalar;
  }();
  return best;
}

Isa& current_isa() {
  static Isa isa = detected_isa();
  return isa;
}

std::string isa_name(Isa isa) {
  return isa == Isa::kAvx512 ? "avx512" : (isa == Isa::kAvx2 ? "avx2" : "scalar");
}

}  // namespace specdec

namespace {

// Run `name` (scalar, avx2 or avx512) from now on, if this CPU has it; → the one before.
std::string set_isa(const std::string& name) {
  using specdec::Isa;
  const Isa wanted = name == "avx512" ? Isa::kAvx512 : (name == "avx2" ? Isa::kAvx2 : Isa::kScalar);
  TORCH_CHECK(name == "avx512" || name == "avx2" || name == "scalar", "set_isa: unknown instruction set ", name);
  TORCH_CHECK(static_cast<int>(wanted) <= static_cast<int>(specdec::detected_isa()), "set_isa: this CPU has no ", name);
  const std::string before = specdec::isa_name(specdec::current_isa());
  specdec::current_isa() = wanted;
  return before;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The compute kernels run without the GIL (their tensors are taken before it is let go and
  // the result handed back after it is retaken): a replica computes in its engine thread,
  // and its event loop should meanwhile read, decode and batch the next requests on the
  // other core rather than wait out a whole forward (a batch of 16 × 5 rows: about 20 ms).
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("half_linear", &half_linear, nogil, "x · Wᵀ (+ bias) over a 16-bit weight packed in panels");
  m.def("int8_dot_linear", &int8_dot_linear, nogil, "x · Wᵀ (+ bias) with int8 weights and per-row int8 activations");
  m.def("has_int8_dot", &has_int8_dot, "whether int8_dot_linear runs on 8-bit dot products (AVX-512 VNNI) here");
  m.def("panel_width", &panel_width, "the panel width half_linear wants on the instruction set in use");
  m.def("packed_attention", &packed_attention, nogil, "causal attention of many sessions' new rows against their caches");
  m.def("decoder_layer", &decoder_layer, nogil, "one Llama decoder layer over 16-bit weights and the packed attention");
  m.def("rms_norm", &rms_norm, nogil, "x / rms(x) · weight per row, as the decoder layer normalises");
  m.def("sample_rows", &sample_rows, nogil, "inverse-CDF draws of rows of probabilities, as specdec.sampling.sample_from");
  m.def("block_verdicts", &block_verdicts, nogil,
        "the block rule's kept lengths, recovery tokens and weights, as target_service's sampled verdicts");
  m.def("top_p_drop", &top_p_drop, nogil, "the tokens top-p truncation drops, as specdec.sampling.top_p_drop_torch");
  m.def("law_rows", &law_rows, nogil,
        "temperature, top-k, top-p and min-p over rows of logits, as specdec.sampling.logits_to_probs_torch");
  m.def("residual_masses", &residual_masses, nogil, "the block rule's residual masses, as specdec.sampling.residual_mass");
  m.def("decode_fp16_rows", &decode_fp16_rows, "dense fp16 draft distributions as normalised float64 rows, as specdec.wire.decode");
  m.def("fp16_row_sums", &fp16_row_sums, "each fp16 draft row's float64 sum, as specdec.wire.decode_half takes them");
  m.def("encode_fp16_rows", &encode_fp16_rows,
        "quantised float32 draft distributions as dense fp16 bytes and each row's count of positive values, as specdec.wire.encode");
  bind_shaping(m);
  bind_packed_model(m);
  m.def("isa", [] { return specdec::isa_name(specdec::current_isa()); }, "the instruction set in use");
  m.def("best_isa", [] { return specdec::isa_name(specdec::detected_isa()); }, "the best instruction set of this CPU");
  m.def("set_isa", &set_isa, "use another instruction set this CPU has (tests); returns the one before");
}
