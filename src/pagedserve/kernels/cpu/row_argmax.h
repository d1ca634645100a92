// Greedy decoding's argmax taken inside the LM head (amx_linear.cpp, simd_linear.cpp: the
// *_linear_argmax entry points): each thread folds the logits of its own column range into a
// running best per row as they leave the register tiles, so the [rows, vocab] logits are never
// written or read back. At 64 rows Gemma 3's 262,144-word logits are 67 MB of fp32: its LM head
// plus argmax_rows took 23.5 ms (bf16, AMX) and 82.3 ms (fp32) on a 2-core AMX Xeon, the fold 19.3
// and 70.9 ms.
//
// The rule is argmax_rows.cpp's, torch's max(dim=-1).indices: the first of equal maxima, and in a
// row holding a NaN its first NaN. Values are folded exactly as the plain kernel would have stored
// them (bias added, bf16 layers' sums rounded to bf16), so the token is the one argmax_rows picks
// from the stored logits. Column ranges are folded in increasing order within a thread and merged
// in column order across threads, which keeps "first" exact.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "work_share.h"

namespace pagedserve {
namespace row_argmax {

// One row's best column among the columns folded so far.
struct Best {
  float value = -std::numeric_limits<float>::infinity();
  int64_t index = -1;  // -1: no column folded yet
  bool nan = false;    // index is the row's first NaN
};

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
// Folds columns col0 .. col0 + 31 (values lo, then hi). Most calls end at the first test: once a
// row's maximum is found, later values rarely pass it.
__attribute__((target("avx512f"))) inline void fold32(Best& b, __m512 lo, __m512 hi, int64_t col0) {
  if (b.nan) return;
  const __mmask16 nan_lo = _mm512_cmp_ps_mask(lo, lo, _CMP_UNORD_Q), nan_hi = _mm512_cmp_ps_mask(hi, hi, _CMP_UNORD_Q);
  if ((nan_lo | nan_hi) != 0) {
    b.nan = true;
    b.index = col0 + (nan_lo != 0 ? __builtin_ctz(nan_lo) : 16 + __builtin_ctz(nan_hi));
    return;
  }
  const __m512 best = _mm512_set1_ps(b.value);
  if ((_mm512_cmp_ps_mask(lo, best, _CMP_GT_OQ) | _mm512_cmp_ps_mask(hi, best, _CMP_GT_OQ)) == 0) {
    if (b.index < 0) b.index = col0;  // all -inf so far: the first column
    return;
  }
  const float top = _mm512_reduce_max_ps(_mm512_max_ps(lo, hi));
  const __m512 t = _mm512_set1_ps(top);
  const __mmask16 at_lo = _mm512_cmp_ps_mask(lo, t, _CMP_EQ_OQ), at_hi = _mm512_cmp_ps_mask(hi, t, _CMP_EQ_OQ);
  b.value = top;
  b.index = col0 + (at_lo != 0 ? __builtin_ctz(at_lo) : 16 + __builtin_ctz(at_hi));
}
#endif

// `later`'s columns all come after `into`'s.
inline void merge(Best& into, const Best& later) {
  if (into.nan || later.index < 0) return;
  if (into.index < 0 || later.nan || later.value > into.value) into = later;
}

// Token ids int64 [M]: fold(u0, u1, best) folds column units [u0, u1) (the kernel's 32-column
// groups, in order) into best[0 .. M); the units are cut into one contiguous range per thread, or
// shared with the helper thread in chunks (work_share.h: fold then holds by value what it reads).
template <class Fold>
torch::Tensor argmax_over_ranges(int64_t M, int64_t units, const torch::TensorOptions& options, const Fold& fold) {
  const bool shared = work_share::sharing();
  const int64_t grain = shared ? work_share::grain_for(units) : 1;
  const int64_t ranges =
      shared ? (units + grain - 1) / grain : std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), units));
  // One row of M bests per range, owned by the task too: the helper may write after the call.
  auto bests = std::make_shared<std::vector<Best>>(static_cast<size_t>(ranges * M));
  if (shared) {
    const size_t bytes = static_cast<size_t>(M) * sizeof(Best);
    work_share::run(
        units, grain, bytes,
        [fold, bests, grain, M](int64_t u0, int64_t u1, void* scratch) {
          Best* b = scratch != nullptr ? static_cast<Best*>(scratch) : bests->data() + (u0 / grain) * M;
          std::fill(b, b + M, Best());
          fold(u0, u1, b);
        },
        [bests, grain, M, bytes](int64_t u0, int64_t, const void* scratch) {
          std::memcpy(static_cast<void*>(bests->data() + (u0 / grain) * M), scratch, bytes);
        });
  } else {
    at::parallel_for(0, ranges, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) fold(units * t / ranges, units * (t + 1) / ranges, bests->data() + t * M);
    });
  }
  torch::Tensor out = torch::empty({M}, options.dtype(torch::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  const Best* all = bests->data();
  for (int64_t r = 0; r < M; ++r) {
    Best b = all[r];
    for (int64_t t = 1; t < ranges; ++t) merge(b, all[t * M + r]);
    o[r] = b.index;
  }
  return out;
}

}  // namespace row_argmax
}  // namespace pagedserve
