// The instruction sets the kernels may choose: what the CPU has, capped by the environment variable
// PAGEDSERVE_CPU_ISA (avx2, avx512, avx512_bf16, amx, any case; unset: no cap). With a cap, every choice the
// kernels make between their own builds (AMX or AVX-512 linear layers, vdpbf16ps, the AVX2 builds)
// is the one a CPU without the higher sets makes, so one machine can run what another kind of host
// runs (tests, a kernel suspected of a fault). kernels/cpu/isa.py checks the value before the
// extension loads; an unknown one here means no cap. GCC's load-time clones (target_clones in vec.h)
// still pick by the CPU itself: they compute the same thing in other instructions.
#pragma once

#include <cstdlib>
#include <strings.h>

namespace pagedserve {

enum class Isa { kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3, kAmx = 4 };

inline int isa_cap_level() {
  static const int level = [] {
    const char* cap = std::getenv("PAGEDSERVE_CPU_ISA");
    if (cap == nullptr || *cap == '\0') return 99;
    const char* names[] = {"avx2", "avx512", "avx512_bf16", "amx"};
    for (int i = 0; i < 4; ++i) {
      if (strcasecmp(cap, names[i]) == 0) return i + 1;
    }
    return 99;
  }();
  return level;
}

// Whether the cap lets the kernels use `isa` (the CPU must still have it).
inline bool isa_allowed(Isa isa) { return static_cast<int>(isa) <= isa_cap_level(); }

}  // namespace pagedserve
