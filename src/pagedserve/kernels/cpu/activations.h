// The gated MLPs' activations and the exp they use, shared by the fused elementwise ops
// (fused_ops.cpp: silu_and_mul, gelu_tanh_and_mul) and the AMX gate_up projection that applies
// them in its epilogue (amx_linear.cpp: amx_gated_linear), so both give the same bits.
#pragma once

#include <cmath>

#include "vec.h"

namespace pagedserve {

// e^x for any float x (clamped to [-87, 88], where it under/overflows anyway); n = round(x / ln2)
// by truncating t -/+ 1/2 by the sign of t. On every lane of VF (VI: the int32 vector of as many
// lanes): v16sf here, v8sf in the AVX2 build of silu_and_mul.
template <class VF, class VI>
PAGEDSERVE_INLINE VF exp_lanes(VF x) {
  const VF hi = VF{} + 88.0f, lo = VF{} - 87.0f;
  x = x > hi ? hi : x;
  x = x < lo ? lo : x;
  const VF t = x * 1.4426950408889634f;
  const VI n = __builtin_convertvector(t + (t < 0.f ? VF{} - 0.5f : VF{} + 0.5f), VI);
  const VF f = (t - __builtin_convertvector(n, VF)) * 0.6931471805599453f;
  const VF p = 1.f + f * (1.f + f * (0.5f + f * (1.f / 6 + f * (1.f / 24 + f * (1.f / 120 + f * (1.f / 720 + f * (1.f / 5040)))))));
  const VI bits = (n + 127) << 23;
  return p * reinterpret_cast<const VF&>(bits);
}

PAGEDSERVE_INLINE v16sf exp16(v16sf x) { return exp_lanes<v16sf, v16si>(x); }

// The gated MLPs' activations, each g * sigmoid(z(g)) in fp32:
// silu(g) = g / (1 + e^-g) (F.silu); gelu_tanh(g) = 0.5 g (1 + tanh(c (g + 0.044715 g^3))) (F.gelu
// with approximate="tanh", Gemma's), written as g / (1 + e^(-2 c (g + 0.044715 g^3))), which is the
// same function without tanh's cancellation near -1 (c = sqrt(2 / pi)). Large |g| saturate through
// exp's clamp: g, or a zero of g's sign.
struct Silu {
  static PAGEDSERVE_INLINE v16sf vec(v16sf x) { return x / (1.f + exp16(-x)); }
  static PAGEDSERVE_INLINE float one(float x) { return x / (1.f + std::exp(-x)); }
};
struct GeluTanh {
  static constexpr float k1 = 1.5957691216057308f;       // 2 sqrt(2 / pi)
  static constexpr float k3 = 1.5957691216057308f * 0.044715f;
  static PAGEDSERVE_INLINE v16sf vec(v16sf x) { return x / (1.f + exp16(-(x * (k1 + k3 * x * x)))); }
  static PAGEDSERVE_INLINE float one(float x) { return x / (1.f + std::exp(-(x * (k1 + k3 * x * x)))); }
};

}  // namespace pagedserve
