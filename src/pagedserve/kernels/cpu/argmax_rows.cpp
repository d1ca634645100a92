// Greedy sampling's row-wise argmax over fp32 logits, as torch's max(dim=-1).indices defines it:
// the first of equal maxima, and in a row holding a NaN its first NaN. torch tracks the index lane
// by lane in scalar code: 2.5 ms for 56 rows of SmolLM2's 49,152 logits on a 2-core AVX-512 Xeon,
// where its amax (no index) takes 0.27 ms; this pass keeps, per vector lane, the lane's first
// maximum and where it was, then picks the smallest index among the lanes holding the row's maximum.

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "ops.h"
#include "vec.h"

namespace pagedserve {
namespace {

// The definition, one value at a time; also taken for rows the vector pass found a NaN in.
int64_t argmax_scalar(const float* x, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > x[best]) best = i;
  }
  return best;
}

// Cloned for AVX-512 and the baseline only: without AVX-512, GCC compiles v16sf comparisons and
// selects to scalar code (vec_avx2.h), and kernels/cpu/sampling.py leaves those CPUs to torch.
__attribute__((target_clones("arch=x86-64-v4", "default"))) int64_t argmax_row(const float* x, int64_t n) {
  if (n < 32) return argmax_scalar(x, n);
  const v16si lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  v16sf best = loadv<v16sf>(x);
  v16si where = lane;
  v16si nan = best != best;
  int64_t i = 16;
  for (; i + 16 <= n; i += 16) {
    const v16sf v = loadv<v16sf>(x + i);
    const v16si greater = v > best;  // strict: a lane keeps its first maximum
    best = greater ? v : best;
    where = greater ? lane + static_cast<int32_t>(i) : where;
    nan |= v != v;
  }
  for (int l = 0; l < 16; ++l) {
    if (nan[l] != 0) return argmax_scalar(x, n);
  }
  float top = hmax16(best);
  int64_t index = std::numeric_limits<int64_t>::max();
  for (int l = 0; l < 16; ++l) {
    if (best[l] == top) index = std::min<int64_t>(index, where[l]);
  }
  for (; i < n; ++i) {  // the tail comes after every lane's values: only a strictly larger one wins
    if (std::isnan(x[i])) return i;
    if (x[i] > top) {
      top = x[i];
      index = i;
    }
  }
  return index;
}

}  // namespace

torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.scalar_type() == torch::kFloat32 && logits.dim() == 2 && logits.is_contiguous(),
              "argmax_rows: logits must be contiguous float32 [rows, vocab], got ", logits.scalar_type(), " ",
              logits.sizes());
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(n >= 1 && n < std::numeric_limits<int32_t>::max(), "argmax_rows: vocab size ", n,
              " must be in [1, 2^31 - 1)");
  torch::Tensor out = torch::empty({rows}, logits.options().dtype(torch::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) o[r] = argmax_row(x + r * n, n);
  });
  return out;
}

}  // namespace pagedserve
