// The fp32 register blocks shared by the linear layers (simd_linear.cpp) and the prefill attention
// (paged_prefill_attention.cpp): y[R rows, 32 columns] = x[R, K] @ panel[K, 32] on AVX-512,
// R = 1 .. 12, in 24 zmm accumulators (two per row); on AVX2, ymm_rows_block does the same in
// slices of up to 6 rows (ymm_block: 12 ymm accumulators, sums in the same order). In `block`, x is fp32 and the panel
// fp32 (Fp32Panel) or bf16 (Bf16PairPanel) widened to fp32 on load: the math is fp32 either way. In
// `pair_block`, x and the panel are both bf16 in pairs of k, each pair's two products added to the
// sums by AVX512-BF16's dot product (twice the multiply-adds per instruction).
//
// Each output is a single fp32 sum of fused multiply-adds over k in order (pair_block: each pair's
// k + 1 before its k, as vdpbf16ps adds them), taken in blocks of kSumBlock whose partial sums are
// then added up (two-level summation: the error grows with K / 128 + 128 rather than K; measured
// below MKL's on SmolLM2's shapes). A caller streaming cold
// panels can have the block prefetch the next one into L2 while it computes (Prefetch).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

#include "isa.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PAGEDSERVE_AVX512 __attribute__((target("avx512f")))
#define PAGEDSERVE_AVX512_BF16 __attribute__((target("avx512f,avx512bf16")))
#define PAGEDSERVE_AVX2 __attribute__((target("avx2,fma")))
#define PAGEDSERVE_HAVE_AVX512_GEMM 1
#endif

namespace pagedserve {
namespace fp32_gemm {

constexpr int64_t kPanel = 32;      // columns of a panel: two zmm registers
constexpr int64_t kBlockRows = 12;  // rows per register block: 24 accumulators
constexpr int64_t kSumBlock = 128;  // k values summed apart before their sum joins the total

// Whether the blocks run here (built for x86-64 by GCC, and the CPU has AVX-512 F and BW, as every
// AVX-512 CPU since Skylake): the one answer for every kernel built on them. (pair_block is
// compiled for AVX512-BF16, which implies BW, and only emulates the dot product without it.)
inline bool available() {
#ifdef PAGEDSERVE_HAVE_AVX512_GEMM
  static const bool ok =
      __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && isa_allowed(Isa::kAvx512);
  return ok;
#else
  return false;
#endif
}

// Whether the CPU has AVX512-BF16's dot product (vdpbf16ps), which pair_block then uses.
inline bool native_bf16_dot() {
#ifdef PAGEDSERVE_HAVE_AVX512_GEMM
  static const bool ok = available() && __builtin_cpu_supports("avx512bf16") && isa_allowed(Isa::kAvx512Bf16);
  return ok;
#else
  return false;
#endif
}

// Whether ymm_rows_block runs here (AVX2 with FMA: every x86-64 CPU since Haswell / Zen 1).
inline bool avx2_available() {
#ifdef PAGEDSERVE_HAVE_AVX512_GEMM
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && isa_allowed(Isa::kAvx2);
  return ok;
#else
  return false;
#endif
}

// A panel is read in steps of 128 bytes (two cache lines), each holding kK consecutive k values
// of the 32 columns; load() widens a step to 2 kK fp32 vectors: w[2s], w[2s + 1] = columns 0-15,
// 16-31 of k value s.
struct Fp32Panel {
  using T = float;
  static constexpr int kK = 1;
  static constexpr int64_t kStep = 32;  // T values per step
#ifdef PAGEDSERVE_HAVE_AVX512_GEMM
  static PAGEDSERVE_AVX512 inline void load(const T* step, __m512* w) {
    w[0] = _mm512_loadu_ps(step);
    w[1] = _mm512_loadu_ps(step + 16);
  }
  // Columns 8 j .. 8 j + 7 of a step, for ymm_block.
  static PAGEDSERVE_AVX2 inline __m256 load8(const T* step, int j) { return _mm256_loadu_ps(step + 8 * j); }
#endif
};

// bf16 values in pairs: 32-bit lane c of a step's first (second) 64 bytes holds column c (16 + c)
// at k in its low half and at k + 1 in its high half, the layout AVX512-BF16's dot product reads.
// bf16 is the top half of an fp32, so widening is a shift (k) and a mask (k + 1).
#ifdef PAGEDSERVE_HAVE_AVX512_GEMM
// 16 lanes of bf16 pairs as fp32: the low halves (k: x << 16) and the high halves (k + 1: x with
// its low half cleared), both exact.
PAGEDSERVE_AVX512 inline void widen_pairs(__m512i x, __m512& k, __m512& k1) {
  k = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  k1 = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
}
#endif

struct Bf16PairPanel {
  using T = uint16_t;
  static constexpr int kK = 2;
  static constexpr int64_t kStep = 64;
#ifdef PAGEDSERVE_HAVE_AVX512_GEMM
  static PAGEDSERVE_AVX512 inline void load(const T* step, __m512* w) {
    widen_pairs(_mm512_loadu_si512(step), w[0], w[2]);
    widen_pairs(_mm512_loadu_si512(step + 32), w[1], w[3]);
  }
#endif
};

// acc + x.k * w.k + x.(k+1) * w.(k+1) per 32-bit lane, where x and w hold bf16 pairs (k in the low
// half, k + 1 in the high half). NativeDot: vdpbf16ps. EmulatedDot: the same two multiply-adds on
// the widened values, in the instruction's order (k + 1 first), each rounded to nearest even, as
// vdpbf16ps rounds them (which also flushes subnormals to zero): it lets every AVX-512 CPU test the
// block's packing and blocking, and is slower there than `block` over a Bf16PairPanel.
struct NativeDot {
#ifdef PAGEDSERVE_HAVE_AVX512_GEMM
  static PAGEDSERVE_AVX512_BF16 inline __m512 dot(__m512 acc, __m512i x, __m512i w) {
    return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(x), reinterpret_cast<__m512bh>(w));
  }
#endif
};
struct EmulatedDot {
#ifdef PAGEDSERVE_HAVE_AVX512_GEMM
  static PAGEDSERVE_AVX512 inline __m512 dot(__m512 acc, __m512i x, __m512i w) {
    __m512 x_k, x_k1, w_k, w_k1;
    widen_pairs(x, x_k, x_k1);
    widen_pairs(w, w_k, w_k1);
    return _mm512_fmadd_ps(x_k, w_k, _mm512_fmadd_ps(x_k1, w_k1, acc));
  }
#endif
};

#ifdef PAGEDSERVE_HAVE_AVX512_GEMM

// Steps of `next` (step stride ldp, in T values) with step % every == phase are prefetched into
// L2 during the block, so `every` blocks over one panel prefetch the next panel once, evenly
// spread. `streamed`: the panel itself is read from L2 (larger than L1, as the linear layers'
// 73-196 KB panels are), so `block` also asks for its step kL1Ahead steps ahead into L1
// (pair_block and the AVX2 blocks ignore it: not measured there).
template <class Panel>
struct Prefetch {
  const typename Panel::T* next = nullptr;
  int64_t phase = 0, every = 1;
  bool streamed = false;
};

// How far ahead a streamed panel is prefetched into L1, in steps (of 128 bytes). Measured at 512
// rows of SmolLM2's fp32 projections, alternated in one process: 8 steps ahead 1-2% faster than
// none (4 and 12 about the same as 8); unchanged at 8 and 64 rows.
constexpr int64_t kL1Ahead = 8;

// Both cache lines of the 128-byte panel step at `step` into the cache the hint names
// (_MM_HINT_T0: L1, _MM_HINT_T1: L2). A prefetch never faults, so `step` may lie past the panel.
// (SSE only: it inlines into the AVX-512 and the AVX2 blocks alike.)
template <int Hint>
inline void prefetch_step_lines(const void* step) {
  const char* p = static_cast<const char*>(step);
  _mm_prefetch(p, static_cast<_mm_hint>(Hint));
  _mm_prefetch(p + 64, static_cast<_mm_hint>(Hint));
}

// The prefetch of `pf.next`'s step `step` when it is this block's turn (see Prefetch).
template <class Panel>
inline void prefetch_step(const Prefetch<Panel>& pf, int64_t step, int64_t ldp, int64_t& due) {
  if (step == due) {
    prefetch_step_lines<_MM_HINT_T1>(pf.next + step * ldp);
    due += pf.every;
  }
}

// One sum block's partial sums of rows [0, R) into y: stored by the first block (k0 = 0), added to
// what the earlier ones stored by the others.
template <int R>
PAGEDSERVE_AVX512 inline void fold_sums(const __m512* lo, const __m512* hi, bool first, float* y, int64_t ldy) {
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    float* yr = y + r * ldy;
    __m512 a = lo[r], b = hi[r];
    if (!first) {
      a = _mm512_add_ps(_mm512_loadu_ps(yr), a);
      b = _mm512_add_ps(_mm512_loadu_ps(yr + 16), b);
    }
    _mm512_storeu_ps(yr, a);
    _mm512_storeu_ps(yr + 16, b);
  }
}

template <int R>
PAGEDSERVE_AVX512 inline void zero_rows(float* y, int64_t ldy) {
#pragma GCC unroll 12
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(y + r * ldy, _mm512_setzero_ps());
    _mm512_storeu_ps(y + r * ldy + 16, _mm512_setzero_ps());
  }
}

// y[r * ldy + c] = sum_k x(r, k) * panel(k, c), r < R, c < 32, where panel(k, c) is column c of
// the k-th value of the panel's steps (ldp T values apart), and x(r, k) is x[r * ldx + k] (rows as
// they lie) or, PackedX, x[k * R + r] (rows interleaved by pack_rows: one pointer and constant
// offsets, fewer instructions per k than 12 row pointers). K is a multiple of Panel::kK.
template <int R, bool PackedX, class Panel>
PAGEDSERVE_AVX512 void block(const float* x, int64_t ldx, const typename Panel::T* panel, int64_t ldp, int64_t K,
                             float* y, int64_t ldy, Prefetch<Panel> pf) {
  constexpr int kK = Panel::kK;
  static_assert(kSumBlock % kK == 0, "a sum block holds whole steps");
  __m512 lo[R], hi[R];
  int64_t due = pf.next != nullptr ? pf.phase : K;
  for (int64_t k0 = 0; k0 < K; k0 += kSumBlock) {
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
    const int64_t k1 = std::min(K, k0 + kSumBlock);
    for (int64_t k = k0; k < k1; k += kK) {
      const int64_t step = k / kK;
      prefetch_step(pf, step, ldp, due);
      if (pf.streamed) prefetch_step_lines<_MM_HINT_T0>(panel + (step + kL1Ahead) * ldp);
      __m512 w[2 * kK];
      Panel::load(panel + step * ldp, w);
#pragma GCC unroll 2
      for (int s = 0; s < kK; ++s) {
#pragma GCC unroll 12
        for (int r = 0; r < R; ++r) {
          const __m512 xr = _mm512_set1_ps(PackedX ? x[(k + s) * R + r] : x[r * ldx + k + s]);
          lo[r] = _mm512_fmadd_ps(xr, w[2 * s], lo[r]);
          hi[r] = _mm512_fmadd_ps(xr, w[2 * s + 1], hi[r]);
        }
      }
    }
    fold_sums<R>(lo, hi, k0 == 0, y, ldy);
  }
  if (K == 0) zero_rows<R>(y, ldy);
}

// y[r * ldy + c] = sum_k x(r, k) * panel(k, c) as `block` computes it, over a Bf16PairPanel and x
// in bf16 pairs interleaved by pack_row_pairs (x[s * R + r]: row r's k = 2s and 2s + 1), one Dot
// per pair and 32 columns. The sums are blocked as in `block`. K is even.
template <int R, class Dot>
PAGEDSERVE_AVX512_BF16 void pair_block(const uint32_t* x, const uint16_t* panel, int64_t K, float* y, int64_t ldy,
                                       Prefetch<Bf16PairPanel> pf) {
  constexpr int64_t ldp = Bf16PairPanel::kStep;
  __m512 lo[R], hi[R];
  int64_t due = pf.next != nullptr ? pf.phase : K;
  for (int64_t k0 = 0; k0 < K; k0 += kSumBlock) {
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
    const int64_t s1 = std::min(K, k0 + kSumBlock) / 2;
    for (int64_t s = k0 / 2; s < s1; ++s) {
      prefetch_step(pf, s, ldp, due);
      const __m512i w0 = _mm512_loadu_si512(panel + s * ldp), w1 = _mm512_loadu_si512(panel + s * ldp + 32);
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) {
        const __m512i xr = _mm512_set1_epi32(static_cast<int>(x[s * R + r]));
        lo[r] = Dot::dot(lo[r], xr, w0);
        hi[r] = Dot::dot(hi[r], xr, w1);
      }
    }
    fold_sums<R>(lo, hi, k0 == 0, y, ldy);
  }
  if (K == 0) zero_rows<R>(y, ldy);
}

// x(r, k): x[k * ld + r] for rows packed by pack_rows (ld: that packed block's rows), else
// x[r * ld + k] (rows as they lie).
template <bool PackedX>
inline const float* x_at(const float* x, int64_t ld, int r, int64_t k) {
  return PackedX ? x + k * ld + r : x + r * ld + k;
}

template <int R, int C, bool PackedX>
PAGEDSERVE_AVX2 inline void ymm_step(const float* x, int64_t ld, const float* step, int64_t k, __m256 (&acc)[R][C]) {
  __m256 w[C];
#pragma GCC unroll 4
  for (int j = 0; j < C; ++j) w[j] = Fp32Panel::load8(step, j);
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    const __m256 xr = _mm256_broadcast_ss(x_at<PackedX>(x, ld, r, k));
#pragma GCC unroll 4
    for (int j = 0; j < C; ++j) acc[r][j] = _mm256_fmadd_ps(xr, w[j], acc[r][j]);
  }
}

// The AVX2 block over fp32 panels: y[r * ldy + c] = sum_k x(r, k) * panel(k, c) for r < R,
// c < 8 C (the panel's steps ldp floats apart, from its column 0 as given), in R x C ymm
// accumulators (R x C = 12 at most, of 16 registers), each sum taken as `block` takes it.
// k runs in groups of 4 with the prefetch checked once per group: with half as many FMAs per k as
// `block`, the loop's bookkeeping would otherwise cost a 4-wide front end about a fifth.
template <int R, int C, bool PackedX>
PAGEDSERVE_AVX2 void ymm_block(const float* x, int64_t ld, const float* panel, int64_t ldp, int64_t K, float* y,
                               int64_t ldy, Prefetch<Fp32Panel> pf) {
  __m256 acc[R][C];
  int64_t due = pf.next != nullptr ? pf.phase : K;
  auto prefetch_until = [&](int64_t end) {  // every due step before `end`
    for (; due < end; due += pf.every) prefetch_step_lines<_MM_HINT_T1>(pf.next + due * ldp);
  };
  for (int64_t k0 = 0; k0 < K; k0 += kSumBlock) {
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (int j = 0; j < C; ++j) acc[r][j] = _mm256_setzero_ps();
    }
    const int64_t k1 = std::min(K, k0 + kSumBlock);
    int64_t k = k0;
    for (; k + 4 <= k1; k += 4) {
      prefetch_until(k + 4);
#pragma GCC unroll 4
      for (int s = 0; s < 4; ++s) ymm_step<R, C, PackedX>(x, ld, panel + (k + s) * ldp, k + s, acc);
    }
    for (; k < k1; ++k) {
      prefetch_until(k + 1);
      ymm_step<R, C, PackedX>(x, ld, panel + k * ldp, k, acc);
    }
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
      for (int j = 0; j < C; ++j) {
        float* out = y + r * ldy + 8 * j;
        _mm256_storeu_ps(out, k0 == 0 ? acc[r][j] : _mm256_add_ps(_mm256_loadu_ps(out), acc[r][j]));
      }
    }
  }
  if (K == 0) {
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < C; ++j) _mm256_storeu_ps(y + r * ldy + 8 * j, _mm256_setzero_ps());
    }
  }
}

template <class Panel>
using BlockFn = void (*)(const float*, int64_t, const typename Panel::T*, int64_t, int64_t, float*, int64_t,
                         Prefetch<Panel>);

template <bool PackedX, class Panel, int... R>
constexpr std::array<BlockFn<Panel>, sizeof...(R)> block_table(std::integer_sequence<int, R...>) {
  return {&block<R + 1, PackedX, Panel>...};
}

// block<rows> for rows = 1 .. kBlockRows, x's rows as they lie (row stride ldx), over fp32 panels.
inline void rows_block(int64_t rows, const float* x, int64_t ldx, const float* panel, int64_t ldp, int64_t K,
                       float* y, int64_t ldy) {
  static constexpr auto table = block_table<false, Fp32Panel>(std::make_integer_sequence<int, kBlockRows>{});
  table[rows - 1](x, ldx, panel, ldp, K, y, ldy, {});
}

// The same over rows packed by pack_rows and a panel of either kind.
template <class Panel>
inline void packed_rows_block(int64_t rows, const float* packed, const typename Panel::T* panel, int64_t ldp,
                              int64_t K, float* y, int64_t ldy, Prefetch<Panel> pf = {}) {
  static constexpr auto table = block_table<true, Panel>(std::make_integer_sequence<int, kBlockRows>{});
  table[rows - 1](packed, 0, panel, ldp, K, y, ldy, pf);
}

using YmmBlockFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t,
                            Prefetch<Fp32Panel>);

template <int C, bool PackedX, int... R>
constexpr std::array<YmmBlockFn, sizeof...(R)> ymm_block_table(std::integer_sequence<int, R...>) {
  return {&ymm_block<R + 1, C, PackedX>...};
}

constexpr int64_t kYmmRows = 6;  // rows per ymm_block over half a panel (12 accumulators)

// What packed_rows_block (PackedX: x packed by pack_rows, ld its row count) and rows_block (x's
// rows ld floats apart) do, on AVX2 over an fp32 panel: up to kBlockRows rows in slices of up to
// kYmmRows, each over the whole panel (up to 3 rows) or the panel's two halves (4-6 rows); the
// first slice prefetches.
template <bool PackedX>
inline void ymm_rows_block(int64_t rows, const float* x, int64_t ld, const float* panel, int64_t ldp, int64_t K,
                           float* y, int64_t ldy, Prefetch<Fp32Panel> pf = {}) {
  static constexpr auto whole = ymm_block_table<4, PackedX>(std::make_integer_sequence<int, kYmmRows / 2>{});
  static constexpr auto halves = ymm_block_table<2, PackedX>(std::make_integer_sequence<int, kYmmRows>{});
  for (int64_t r0 = 0; r0 < rows; r0 += kYmmRows) {
    const int64_t n = std::min(kYmmRows, rows - r0);
    const float* xs = PackedX ? x + r0 : x + r0 * ld;
    const Prefetch<Fp32Panel> first = r0 == 0 ? pf : Prefetch<Fp32Panel>{};
    if (n <= kYmmRows / 2) {
      whole[n - 1](xs, ld, panel, ldp, K, y + r0 * ldy, ldy, first);
    } else {
      halves[n - 1](xs, ld, panel, ldp, K, y + r0 * ldy, ldy, first);
      halves[n - 1](xs, ld, panel + 16, ldp, K, y + r0 * ldy + 16, ldy, {});
    }
  }
}

using PairBlockFn = void (*)(const uint32_t*, const uint16_t*, int64_t, float*, int64_t, Prefetch<Bf16PairPanel>);

template <class Dot, int... R>
constexpr std::array<PairBlockFn, sizeof...(R)> pair_block_table(std::integer_sequence<int, R...>) {
  return {&pair_block<R + 1, Dot>...};
}

// pair_block<rows> for rows = 1 .. kBlockRows over rows packed by pack_row_pairs.
template <class Dot>
inline void pair_rows_block(int64_t rows, const uint32_t* packed, const uint16_t* panel, int64_t K, float* y,
                            int64_t ldy, Prefetch<Bf16PairPanel> pf = {}) {
  static constexpr auto table = pair_block_table<Dot>(std::make_integer_sequence<int, kBlockRows>{});
  table[rows - 1](packed, panel, K, y, ldy, pf);
}

inline float widen(float v) { return v; }
inline float widen(uint16_t bf16) {  // bf16 is the top half of an fp32
  const uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

// Rows [0, rows) of x [.., K] (row stride K; fp32, or bf16 as uint16_t) interleaved in fp32 for
// packed_rows_block: out[k * rows + r].
template <class X>
inline void pack_rows(const X* x, int64_t rows, int64_t K, float* out) {
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t r = 0; r < rows; ++r) out[k * rows + r] = widen(x[r * K + k]);
  }
}

// Rows [0, rows) of bf16 x [.., K] (row stride K, K even) as pairs of k for pair_rows_block:
// out[s * rows + r] holds x[r][2s] in its low half and x[r][2s + 1] in its high half.
inline void pack_row_pairs(const uint16_t* x, int64_t rows, int64_t K, uint32_t* out) {
  for (int64_t s = 0; s < K / 2; ++s) {
    for (int64_t r = 0; r < rows; ++r) std::memcpy(out + s * rows + r, x + r * K + 2 * s, sizeof(uint32_t));
  }
}

#endif  // PAGEDSERVE_HAVE_AVX512_GEMM

}  // namespace fp32_gemm
}  // namespace pagedserve
