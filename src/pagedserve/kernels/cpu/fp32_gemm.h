// The fp32 register block shared by the fp32 linear layers (fp32_linear.cpp) and the prefill
// attention (paged_prefill_attention.cpp): y[R rows, 32 columns] = x[R, K] @ panel[K, 32] on
// AVX-512, R = 1 .. 12, in 24 zmm accumulators (two per row).
//
// Each output is a single fp32 sum of fused multiply-adds over k in order, taken in blocks of
// kSumBlock whose partial sums are then added up (two-level summation: the error grows with
// K / 128 + 128 rather than K; measured below MKL's on SmolLM2's shapes). A caller streaming cold
// panels can have the block prefetch the next one into L2 while it computes (Prefetch).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PAGEDSERVE_AVX512 __attribute__((target("avx512f")))
#define PAGEDSERVE_HAVE_AVX512_GEMM 1
#endif

namespace pagedserve {
namespace fp32_gemm {

constexpr int64_t kPanel = 32;      // columns of a panel: two zmm registers
constexpr int64_t kBlockRows = 12;  // rows per register block: 24 accumulators
constexpr int64_t kSumBlock = 128;  // k values summed apart before their sum joins the total

// Whether the block runs here (built for x86-64 by GCC, and the CPU has AVX-512F): the one answer
// for every kernel built on it.
inline bool available() {
#ifdef PAGEDSERVE_HAVE_AVX512_GEMM
  static const bool ok = __builtin_cpu_supports("avx512f");
  return ok;
#else
  return false;
#endif
}

#ifdef PAGEDSERVE_HAVE_AVX512_GEMM

// Rows k of `next` (row stride ldp) with k % every == phase are prefetched into L2 during the
// block, so `every` blocks over one panel prefetch the next panel once, evenly spread.
struct Prefetch {
  const float* next = nullptr;
  int64_t phase = 0, every = 1;
};

// y[r * ldy + c] = sum_k x(r, k) * panel[k * ldp + c], r < R, c < 32, where x(r, k) is
// x[r * ldx + k] (rows as they lie) or, PackedX, x[k * R + r] (rows interleaved by pack_rows: one
// pointer and constant offsets, fewer instructions per k than 12 row pointers).
template <int R, bool PackedX>
PAGEDSERVE_AVX512 void block(const float* x, int64_t ldx, const float* panel, int64_t ldp, int64_t K, float* y,
                             int64_t ldy, Prefetch pf) {
  __m512 lo[R], hi[R];
  int64_t prefetch_k = pf.next != nullptr ? pf.phase : K;
  for (int64_t k0 = 0; k0 < K; k0 += kSumBlock) {
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
    const int64_t k1 = std::min(K, k0 + kSumBlock);
    for (int64_t k = k0; k < k1; ++k) {
      const float* wk = panel + k * ldp;
      if (k == prefetch_k) {
        _mm_prefetch(reinterpret_cast<const char*>(pf.next + k * ldp), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(pf.next + k * ldp + 16), _MM_HINT_T1);
        prefetch_k += pf.every;
      }
      const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16);
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) {
        const __m512 xr = _mm512_set1_ps(PackedX ? x[k * R + r] : x[r * ldx + k]);
        lo[r] = _mm512_fmadd_ps(xr, w0, lo[r]);
        hi[r] = _mm512_fmadd_ps(xr, w1, hi[r]);
      }
    }
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      float* yr = y + r * ldy;
      if (k0 > 0) {
        lo[r] = _mm512_add_ps(_mm512_loadu_ps(yr), lo[r]);
        hi[r] = _mm512_add_ps(_mm512_loadu_ps(yr + 16), hi[r]);
      }
      _mm512_storeu_ps(yr, lo[r]);
      _mm512_storeu_ps(yr + 16, hi[r]);
    }
  }
  if (K == 0) {
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(y + r * ldy, _mm512_setzero_ps());
      _mm512_storeu_ps(y + r * ldy + 16, _mm512_setzero_ps());
    }
  }
}

using BlockFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t, Prefetch);

template <bool PackedX, int... R>
constexpr std::array<BlockFn, sizeof...(R)> block_table(std::integer_sequence<int, R...>) {
  return {&block<R + 1, PackedX>...};
}

// block<rows> for rows = 1 .. kBlockRows, x's rows as they lie (row stride ldx).
inline void rows_block(int64_t rows, const float* x, int64_t ldx, const float* panel, int64_t ldp, int64_t K,
                       float* y, int64_t ldy, Prefetch pf = {}) {
  static constexpr auto table = block_table<false>(std::make_integer_sequence<int, kBlockRows>{});
  table[rows - 1](x, ldx, panel, ldp, K, y, ldy, pf);
}

// The same over rows packed by pack_rows.
inline void packed_rows_block(int64_t rows, const float* packed, const float* panel, int64_t ldp, int64_t K,
                              float* y, int64_t ldy, Prefetch pf = {}) {
  static constexpr auto table = block_table<true>(std::make_integer_sequence<int, kBlockRows>{});
  table[rows - 1](packed, 0, panel, ldp, K, y, ldy, pf);
}

// Rows [0, rows) of x [.., K] (row stride K) interleaved for packed_rows_block: out[k * rows + r].
inline void pack_rows(const float* x, int64_t rows, int64_t K, float* out) {
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t r = 0; r < rows; ++r) out[k * rows + r] = x[r * K + k];
  }
}

#endif  // PAGEDSERVE_HAVE_AVX512_GEMM

}  // namespace fp32_gemm
}  // namespace pagedserve
