// Small vector helpers shared by the CPU kernels: 16-float GCC vectors, bf16 conversions, exp.
//
// The kernels are written once with GCC vector types and compiled per ISA by
// PAGEDSERVE_MULTIVERSION (AVX-512, AVX2+FMA, baseline), picked at load time by the CPU, so a
// build cached on one machine never executes an instruction another machine lacks. A v16sf is one
// AVX-512 register, two AVX2 ones or four SSE ones, whichever the clone has; but without AVX-512
// GCC compiles v16sf comparisons, selects, shuffles and lane writes to scalar code, so code whose
// AVX2 speed matters is written over Vec16<V> and built for AVX2 over F8x2 (vec_avx2.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PAGEDSERVE_MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define PAGEDSERVE_MULTIVERSION
#endif
#define PAGEDSERVE_INLINE __attribute__((always_inline)) inline

namespace pagedserve {

typedef float v16sf __attribute__((vector_size(64)));
typedef int32_t v16si __attribute__((vector_size(64)));
typedef uint32_t v16su __attribute__((vector_size(64)));
typedef uint16_t v16hu __attribute__((vector_size(32)));
typedef float v8sf __attribute__((vector_size(32)));
typedef float v4sf __attribute__((vector_size(16)));
typedef float v2sf __attribute__((vector_size(8)));

template <typename V>
PAGEDSERVE_INLINE V loadv(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

template <typename V>
PAGEDSERVE_INLINE void storev(void* p, V v) {
  std::memcpy(p, &v, sizeof(v));
}

PAGEDSERVE_INLINE float bf16_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

// Round to nearest even, as torch's float -> bfloat16 conversion does (NaN stays NaN).
PAGEDSERVE_INLINE uint16_t float_to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

PAGEDSERVE_INLINE v16sf bf16x16_to_float(const uint16_t* p) {
  const v16si wide = __builtin_convertvector(loadv<v16hu>(p), v16si) << 16;
  return reinterpret_cast<const v16sf&>(wide);
}

// bf16 values in pairs (32-bit lane i: values 2i and 2i + 1) as fp32, split into the even ones
// (x << 16) and the odd ones (x & 0xffff0000), both exact; VU: unsigned 32-bit lanes, VF: the
// float vector of as many lanes.
template <class VU, class VF>
PAGEDSERVE_INLINE void bf16_pairs_to_float(VU x, VF& even, VF& odd) {
  const VU lo = x << 16, hi = x & 0xffff0000u;
  even = reinterpret_cast<const VF&>(lo);
  odd = reinterpret_cast<const VF&>(hi);
}

// 32 bf16 values from one 64-byte load so: two instructions where widening 16 values in order
// takes a shuffle. For loops that do not mind the order (elementwise, sums, or a matching order
// kept).
PAGEDSERVE_INLINE void bf16x32_to_float_even_odd(const uint16_t* p, v16sf& even, v16sf& odd) {
  bf16_pairs_to_float(loadv<v16su>(p), even, odd);
}

// Round to nearest even on 16 lanes; the vector twin of float_to_bf16 (NaN stays NaN).
PAGEDSERVE_INLINE void float_to_bf16x16(v16sf x, uint16_t* out) {
  const v16si bits = reinterpret_cast<const v16si&>(x);
  const v16si rounded = (bits + (0x7fff + ((bits >> 16) & 1))) >> 16;
  const v16si nan = (bits >> 16) | 0x40;
  const v16si is_nan = (bits & 0x7fffffff) > 0x7f800000;
  storev(out, __builtin_convertvector(is_nan ? nan : rounded, v16hu));
}

// x rounded to the nearest bf16 (even on ties) and widened back, in registers: what a torch op
// with a bf16 result does to its fp32 value. NaN stays NaN (quieted, as the conversion does).
PAGEDSERVE_INLINE v16sf round_to_bf16x16(v16sf x) {
  const v16su bits = reinterpret_cast<const v16su&>(x);
  const v16su rounded = (bits + (0x7fffu + ((bits >> 16) & 1u))) & 0xffff0000u;
  const v16su nan = (bits | 0x400000u) & 0xffff0000u;
  const v16su out = (bits & 0x7fffffffu) > 0x7f800000u ? nan : rounded;
  return reinterpret_cast<const v16sf&>(out);
}

// e^x for x <= 0 (a score minus a running maximum), vectorisable where std::exp is a scalar libm
// call: e^x = 2^n * 2^f, n = round(x / ln2), |f| <= 1/2 (in log2 units), 2^f from its degree-7
// Taylor polynomial (relative error below 1e-7, float rounding level).
PAGEDSERVE_INLINE float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // below this e^x underflows anyway; keeps 2^n a normal float
  const float t = x * 1.4426950408889634f;
  const float n = std::floor(t + 0.5f);
  const float f = (t - n) * 0.6931471805599453f;  // the remainder back in natural-log units
  const float p = 1.f + f * (1.f + f * (0.5f + f * (1.f / 6 + f * (1.f / 24 + f * (1.f / 120 + f * (1.f / 720 + f * (1.f / 5040)))))));
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// The same on every lane of a float vector VF (VI: the int32 vector of as many lanes; 16 lanes
// below, 8 in vec_avx2.h). n comes from truncating t - 1/2, which rounds for t <= 0 (the kernels
// build with -fassociative-math, which would fold the usual (t + 1.5 * 2^23) - 1.5 * 2^23).
template <class VF, class VI>
PAGEDSERVE_INLINE VF exp_nonpositive_lanes(VF x) {
  const VF lo = VF{} - 87.0f;
  x = x < lo ? lo : x;
  const VF t = x * 1.4426950408889634f;
  const VI n = __builtin_convertvector(t - 0.5f, VI);
  const VF f = (t - __builtin_convertvector(n, VF)) * 0.6931471805599453f;
  const VF p = 1.f + f * (1.f + f * (0.5f + f * (1.f / 6 + f * (1.f / 24 + f * (1.f / 120 + f * (1.f / 720 + f * (1.f / 5040)))))));
  const VI bits = (n + 127) << 23;
  return p * reinterpret_cast<const VF&>(bits);
}

PAGEDSERVE_INLINE v16sf exp_nonpositive16(v16sf x) { return exp_nonpositive_lanes<v16sf, v16si>(x); }

// tanh(x) within 2 ulp (libm's and torch's: about 1), vectorisable where std::tanh is a scalar
// libm call (scalar tanh doubled the prefill kernel's time under a softcap). Below |x| = 0.625 the
// odd Taylor series to x^19 (terms shrink ~6x each there); above, (1 - e) / (1 + e) with
// e = e^(-2|x|), where 1 - e >= 0.71 loses no digits. Measured at most 1.9 ulp from float64 tanh
// over [-12, 12]; tests/kernels/test_cpu_attention_softcap.py holds the kernels to the reference.
PAGEDSERVE_INLINE float tanh_vectorisable(float x) {
  const float a = std::fabs(x), a2 = a * a;
  const float small = a * (1.f + a2 * (-1.f / 3 + a2 * (2.f / 15 + a2 * (-17.f / 315 + a2 * (62.f / 2835 + a2 * (
      -1382.f / 155925 + a2 * (21844.f / 6081075 + a2 * (-929569.f / 638512875 + a2 * (
      6404582.f / 10854718875.f + a2 * (-443861162.f / 1856156927625.f))))))))));
  const float e = exp_nonpositive(-2.f * a);
  const float large = (1.f - e) / (1.f + e);
  return std::copysign(a < 0.625f ? small : large, x);
}

// Attention logit softcapping (Gemma 2): s[i] = tanh(s[i] * scale / cap) * cap for the n scores of
// a row, in the order transformers' eager attention computes it (scale, divide, tanh, multiply).
PAGEDSERVE_INLINE void softcap_scores(float* s, int64_t n, float scale, float cap) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) s[i] = tanh_vectorisable(s[i] * scale / cap) * cap;
}

// Lane i of the result is the sum of the 16 lanes of a[i]. A transpose-and-add tree: each level
// halves the partial sums per vector and doubles the vectors per register (after level 1, b[i]
// holds 8 partials of a[i] and 8 of a[i + 8]), 15 shuffle pairs for 16 sums instead of four
// shuffle levels for every one.
PAGEDSERVE_INLINE v16sf reduce16(const v16sf* a) {
  v16sf b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = __builtin_shufflevector(a[i], a[i + 8], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(a[i], a[i + 8], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    c[i] = __builtin_shufflevector(b[i], b[i + 4], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(b[i], b[i + 4], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    d[i] = __builtin_shufflevector(c[i], c[i + 2], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(c[i], c[i + 2], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  return __builtin_shufflevector(d[0], d[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         __builtin_shufflevector(d[0], d[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}

// Horizontal sums and maxima as trees (the halves combined, 8 + 4 + 2 + 1 lanes): four dependent
// operations where a lane-by-lane loop makes a chain of sixteen (the decode kernel's softmax takes
// one of each per query head and chunk of 32 positions). Vec16<F8x2> (vec_avx2.h) combines its two halves first and
// then takes the same fold8, so both builds sum in the same order.
template <class Op>
PAGEDSERVE_INLINE float fold8(v8sf v, Op op) {
  const v4sf a = op(__builtin_shufflevector(v, v, 0, 1, 2, 3), __builtin_shufflevector(v, v, 4, 5, 6, 7));
  const v2sf b = op(__builtin_shufflevector(a, a, 0, 1), __builtin_shufflevector(a, a, 2, 3));
  return op(b, __builtin_shufflevector(b, b, 1, 0))[0];
}

PAGEDSERVE_INLINE v8sf low8(v16sf v) { return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7); }
PAGEDSERVE_INLINE v8sf high8(v16sf v) { return __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15); }

constexpr auto kAddLanes = [](auto a, auto b) { return a + b; };
constexpr auto kMaxLanes = [](auto a, auto b) { return a > b ? a : b; };

PAGEDSERVE_INLINE float hsum16(v16sf v) { return fold8(low8(v) + high8(v), kAddLanes); }

PAGEDSERVE_INLINE float hmax16(v16sf v) { return fold8(kMaxLanes(low8(v), high8(v)), kMaxLanes); }

}  // namespace pagedserve
