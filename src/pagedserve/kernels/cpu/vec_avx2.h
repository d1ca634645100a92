// Sixteen floats as two AVX2 registers, for kernels whose AVX2 build must not use vec.h's v16sf.
//
// Why: GCC compiles arithmetic on a 64-byte generic vector (v16sf) to two ymm operations when the
// target has no AVX-512, but comparisons, selects, shuffles and lane access to scalar code through
// the stack: the decode attention kernel's AVX2 clone ran 4x (fp32 cache) to 6x (bf16) slower than
// its AVX-512 clone on the same machine. F8x2 offers what the kernels use of v16sf (arithmetic,
// loads and stores, reduce16, the horizontal max and sum, exp_nonpositive16, the bf16 even/odd
// split, a tail fill) with the same lane order and the same operations, on pairs of 32-byte vectors
// (only reduce's additions run in another order: results agree to fp32 rounding); the kernels are
// written once as templates over the vector type, through Vec16.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "isa.h"
#include "vec.h"

namespace pagedserve {

// What the kernels call for either vector type: Vec16<v16sf> (vec.h's generic vector, for the
// AVX-512 and baseline builds) or Vec16<F8x2> (AVX2).
template <class V>
struct Vec16;

template <>
struct Vec16<v16sf> {
  static PAGEDSERVE_INLINE v16sf zero() { return v16sf{}; }
  // A broadcast written as a shuffle: GCC 12 built `v16sf{} + x` in the decode kernel's V loop
  // (one score per query head and position) lane by lane, from 16 masked loads.
  static PAGEDSERVE_INLINE v16sf splat(float x) {
    const v16sf one = {x};
    return __builtin_shufflevector(one, one, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  }
  static PAGEDSERVE_INLINE v16sf load(const float* p) { return loadv<v16sf>(p); }
  static PAGEDSERVE_INLINE void store(float* p, v16sf v) { storev(p, v); }
  static PAGEDSERVE_INLINE v16sf fmadd(v16sf a, v16sf b, v16sf c) { return a * b + c; }
  static PAGEDSERVE_INLINE v16sf max(v16sf a, v16sf b) { return a > b ? a : b; }
  // Lanes [from, 16) replaced by x.
  static PAGEDSERVE_INLINE v16sf fill_from(v16sf v, int64_t from, float x) {
    const v16si index = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    return index >= static_cast<int32_t>(from) ? splat(x) : v;  // a lane loop compiled to memset
  }
  static PAGEDSERVE_INLINE v16sf reduce(const v16sf* a) { return reduce16(a); }
  static PAGEDSERVE_INLINE float hmax(v16sf v) { return hmax16(v); }
  static PAGEDSERVE_INLINE float hsum(v16sf v) { return hsum16(v); }
  static PAGEDSERVE_INLINE v16sf exp(v16sf x) { return exp_nonpositive16(x); }
  static PAGEDSERVE_INLINE void bf16_even_odd(const uint16_t* p, v16sf& even, v16sf& odd) {
    bf16x32_to_float_even_odd(p, even, odd);
  }
};

}  // namespace pagedserve

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PAGEDSERVE_HAVE_F8X2 1

namespace pagedserve {

// 32-byte generic vectors (v8sf: vec.h): one AVX2 register each, which GCC compiles well for AVX2 (and, with
// no target attribute needed, they inline into the AVX2-built entries from shared templates).
typedef int32_t v8si __attribute__((vector_size(32)));
typedef uint32_t v8su __attribute__((vector_size(32)));

struct F8x2 {
  v8sf lo, hi;  // lanes 0-7 and 8-15
};

PAGEDSERVE_INLINE F8x2 operator+(F8x2 a, F8x2 b) { return {a.lo + b.lo, a.hi + b.hi}; }
PAGEDSERVE_INLINE F8x2 operator-(F8x2 a, F8x2 b) { return {a.lo - b.lo, a.hi - b.hi}; }
PAGEDSERVE_INLINE F8x2 operator*(F8x2 a, F8x2 b) { return {a.lo * b.lo, a.hi * b.hi}; }
PAGEDSERVE_INLINE F8x2 operator*(F8x2 a, float s) { return {a.lo * s, a.hi * s}; }
PAGEDSERVE_INLINE F8x2 operator-(F8x2 a, float s) { return {a.lo - s, a.hi - s}; }
PAGEDSERVE_INLINE F8x2& operator+=(F8x2& a, F8x2 b) { return a = a + b; }

// Whether the kernels' AVX2 builds run wherever they can (force_avx2_vector_code, for tests), not
// only on CPUs with AVX2 and FMA but no AVX-512.
inline std::atomic<bool>& avx2_builds_forced() {
  static std::atomic<bool> forced{false};
  return forced;
}

// Whether the kernels take their AVX2 builds (over F8x2 / v8sf) here.
inline bool use_avx2_builds() {
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && isa_allowed(Isa::kAvx2);
  static const bool avx512 = __builtin_cpu_supports("avx512f") && isa_allowed(Isa::kAvx512);
  return avx2 && (!avx512 || avx2_builds_forced().load(std::memory_order_relaxed));
}

template <>
struct Vec16<F8x2> {
  static PAGEDSERVE_INLINE F8x2 zero() { return {v8sf{}, v8sf{}}; }
  static PAGEDSERVE_INLINE F8x2 splat(float x) { return {v8sf{} + x, v8sf{} + x}; }
  static PAGEDSERVE_INLINE F8x2 load(const float* p) { return {loadv<v8sf>(p), loadv<v8sf>(p + 8)}; }
  static PAGEDSERVE_INLINE void store(float* p, F8x2 v) {
    storev(p, v.lo);
    storev(p + 8, v.hi);
  }
  static PAGEDSERVE_INLINE F8x2 fmadd(F8x2 a, F8x2 b, F8x2 c) { return {a.lo * b.lo + c.lo, a.hi * b.hi + c.hi}; }
  static PAGEDSERVE_INLINE F8x2 max(F8x2 a, F8x2 b) {
    return {a.lo > b.lo ? a.lo : b.lo, a.hi > b.hi ? a.hi : b.hi};
  }
  static PAGEDSERVE_INLINE F8x2 fill_from(F8x2 v, int64_t from, float x) {
    const v8si index = {0, 1, 2, 3, 4, 5, 6, 7};
    const v8si limit = v8si{} + static_cast<int32_t>(from);
    const v8sf fill = v8sf{} + x;
    return {index >= limit ? fill : v.lo, index + 8 >= limit ? fill : v.hi};
  }
  // Lanes 0-7: the sums of b[0..8) (vhaddps twice, then the two 128-bit halves added).
  static PAGEDSERVE_INLINE v8sf hadd(v8sf a, v8sf b) {
    return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
           __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
  }
  static PAGEDSERVE_INLINE v8sf sums8(const v8sf* b) {
    const v8sf u0 = hadd(hadd(b[0], b[1]), hadd(b[2], b[3]));
    const v8sf u1 = hadd(hadd(b[4], b[5]), hadd(b[6], b[7]));
    return __builtin_shufflevector(u0, u1, 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(u0, u1, 4, 5, 6, 7, 12, 13, 14, 15);
  }
  // Lane i: the sum of a[i]'s 16 lanes.
  static PAGEDSERVE_INLINE F8x2 reduce(const F8x2* a) {
    v8sf b[16];
    for (int i = 0; i < 16; ++i) b[i] = a[i].lo + a[i].hi;
    return {sums8(b), sums8(b + 8)};
  }
  // hmax16 and hsum16's order: the halves combined, then fold8.
  static PAGEDSERVE_INLINE float hmax(F8x2 v) { return fold8(kMaxLanes(v.lo, v.hi), kMaxLanes); }
  static PAGEDSERVE_INLINE float hsum(F8x2 v) { return fold8(v.lo + v.hi, kAddLanes); }
  static PAGEDSERVE_INLINE F8x2 exp(F8x2 x) {
    return {exp_nonpositive_lanes<v8sf, v8si>(x.lo), exp_nonpositive_lanes<v8sf, v8si>(x.hi)};
  }
  // bf16x32_to_float_even_odd: values 0, 2, .., 30 and 1, 3, .., 31 of 32 bf16 values.
  static PAGEDSERVE_INLINE void bf16_even_odd(const uint16_t* p, F8x2& even, F8x2& odd) {
    bf16_pairs_to_float(loadv<v8su>(p), even.lo, odd.lo);
    bf16_pairs_to_float(loadv<v8su>(p + 16), even.hi, odd.hi);
  }
};

}  // namespace pagedserve
#endif
