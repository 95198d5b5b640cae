// Which instruction set specdec's kernels run: the best this CPU has, chosen when the
// module loads, and lowered by set_isa for tests that check every path on one machine.
#pragma once
#include <string>

namespace specdec {

enum class Isa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

Isa detected_isa();  // AVX-512F; else AVX2 with FMA and F16C; else plain C++
Isa& current_isa();
std::string isa_name(Isa isa);

}  // namespace specdec
