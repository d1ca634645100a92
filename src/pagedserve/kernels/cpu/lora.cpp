// Multi-LoRA's per-row adapter update, y[t] += (x[t] @ A[s].T) @ B[s] for s = token_slots[t] >= 0
// (kernels/reference/lora.py is the definition and the oracle). One call per projection does every
// row: the reference's gather, two batched matmuls, mask and scatter-add cost ~20 us of op overhead
// each on small decode batches, several times the arithmetic (a rank-16 update is ~5% of a layer's
// multiply-adds). Here a row's shrink (S*R dot products over `in`) lands in a scratch vector in
// fp32, and its expand walks each part of a fused projection with only that part's R ranks of B
// (B is block diagonal: q's outputs read ranks [0, R), k's [R, 2R), ...), 64 outputs at a time in
// four zmm accumulators. Rows are split across threads; A and B of the few resident adapters stay
// in L2 across rows. bf16 tensors are widened to fp32 for the math and y rounded once at the end.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace pagedserve {
namespace {

PAGEDSERVE_INLINE v16sf load16(const float* p) { return loadv<v16sf>(p); }
PAGEDSERVE_INLINE v16sf load16(const uint16_t* p) { return bf16x16_to_float(p); }
PAGEDSERVE_INLINE float load1(const float* p) { return *p; }
PAGEDSERVE_INLINE float load1(const uint16_t* p) { return bf16_to_float(*p); }
PAGEDSERVE_INLINE void store16(float* p, v16sf v) { storev(p, v); }
PAGEDSERVE_INLINE void store16(uint16_t* p, v16sf v) { float_to_bf16x16(v, p); }
PAGEDSERVE_INLINE void store1(float* p, float v) { *p = v; }
PAGEDSERVE_INLINE void store1(uint16_t* p, float v) { *p = float_to_bf16(v); }

// shrunk[j] = A[j, :] . x for j < ranks, four rows of A per pass over x.
template <class T>
PAGEDSERVE_INLINE void shrink(const T* x, const T* a, int64_t n_in, int64_t ranks, float* shrunk) {
  int64_t j = 0;
  for (; j + 4 <= ranks; j += 4) {
    const T* a0 = a + j * n_in;
    v16sf s0 = {}, s1 = {}, s2 = {}, s3 = {};
    int64_t i = 0;
    for (; i + 16 <= n_in; i += 16) {
      const v16sf xv = load16(x + i);
      s0 += load16(a0 + i) * xv;
      s1 += load16(a0 + n_in + i) * xv;
      s2 += load16(a0 + 2 * n_in + i) * xv;
      s3 += load16(a0 + 3 * n_in + i) * xv;
    }
    float t[4] = {hsum16(s0), hsum16(s1), hsum16(s2), hsum16(s3)};
    for (; i < n_in; ++i) {
      const float xv = load1(x + i);
      for (int q = 0; q < 4; ++q) t[q] += load1(a0 + q * n_in + i) * xv;
    }
    for (int q = 0; q < 4; ++q) shrunk[j + q] = t[q];
  }
  for (; j < ranks; ++j) {
    float t = 0.f;
    for (int64_t i = 0; i < n_in; ++i) t += load1(a + j * n_in + i) * load1(x + i);
    shrunk[j] = t;
  }
}

// y[o] += sum_k shrunk[k] * B[k, o] for o in [o0, o1) and the part's ranks k in [k0, k0 + r).
template <class T>
PAGEDSERVE_INLINE void expand(const float* shrunk, const T* b, int64_t n_out, int64_t k0, int64_t r, int64_t o0,
                              int64_t o1, T* y) {
  int64_t o = o0;
  for (; o + 64 <= o1; o += 64) {
    v16sf acc0 = {}, acc1 = {}, acc2 = {}, acc3 = {};
    for (int64_t k = k0; k < k0 + r; ++k) {
      const T* row = b + k * n_out + o;
      const float s = shrunk[k];
      acc0 += s * load16(row);
      acc1 += s * load16(row + 16);
      acc2 += s * load16(row + 32);
      acc3 += s * load16(row + 48);
    }
    store16(y + o, load16(y + o) + acc0);
    store16(y + o + 16, load16(y + o + 16) + acc1);
    store16(y + o + 32, load16(y + o + 32) + acc2);
    store16(y + o + 48, load16(y + o + 48) + acc3);
  }
  for (; o + 16 <= o1; o += 16) {
    v16sf acc = {};
    for (int64_t k = k0; k < k0 + r; ++k) acc += shrunk[k] * load16(b + k * n_out + o);
    store16(y + o, load16(y + o) + acc);
  }
  for (; o < o1; ++o) {
    float acc = 0.f;
    for (int64_t k = k0; k < k0 + r; ++k) acc += shrunk[k] * load1(b + k * n_out + o);
    store1(y + o, load1(y + o) + acc);
  }
}

template <class T>
PAGEDSERVE_INLINE void lora_rows(
    T* y, const T* x, const T* a, const T* b, const int32_t* token_slots, const int64_t* out_slices, int64_t parts,
    int64_t t0, int64_t t1, int64_t n_in, int64_t n_out, int64_t ranks) {
  const int64_t r = ranks / parts;
  std::vector<float> shrunk(ranks);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t s = token_slots[t];
    if (s < 0) continue;
    shrink(x + t * n_in, a + s * ranks * n_in, n_in, ranks, shrunk.data());
    for (int64_t p = 0; p < parts; ++p) {
      expand(shrunk.data(), b + s * ranks * n_out, n_out, p * r, r, out_slices[p], out_slices[p + 1], y + t * n_out);
    }
  }
}

// The clones: AVX-512 (kernels/cpu/lora.py calls the extension only where it runs) and a baseline.
__attribute__((target_clones("arch=x86-64-v4", "default"))) void lora_rows_f32(
    float* y, const float* x, const float* a, const float* b, const int32_t* token_slots, const int64_t* out_slices,
    int64_t parts, int64_t t0, int64_t t1, int64_t n_in, int64_t n_out, int64_t ranks) {
  lora_rows(y, x, a, b, token_slots, out_slices, parts, t0, t1, n_in, n_out, ranks);
}

__attribute__((target_clones("arch=x86-64-v4", "default"))) void lora_rows_bf16(
    uint16_t* y, const uint16_t* x, const uint16_t* a, const uint16_t* b, const int32_t* token_slots,
    const int64_t* out_slices, int64_t parts, int64_t t0, int64_t t1, int64_t n_in, int64_t n_out, int64_t ranks) {
  lora_rows(y, x, a, b, token_slots, out_slices, parts, t0, t1, n_in, n_out, ranks);
}

}  // namespace

void lora_add(torch::Tensor y, torch::Tensor x, torch::Tensor lora_a, torch::Tensor lora_b, torch::Tensor token_slots,
              std::vector<int64_t> out_slices) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16, "lora_add: float32 or bfloat16, got ",
              dtype_name(dtype));
  TORCH_CHECK(y.scalar_type() == dtype && lora_a.scalar_type() == dtype && lora_b.scalar_type() == dtype,
              "lora_add: y, x, lora_a, lora_b must share a dtype");
  TORCH_CHECK(token_slots.scalar_type() == torch::kInt32, "lora_add: token_slots must be int32");
  TORCH_CHECK(y.is_contiguous() && x.is_contiguous() && lora_a.is_contiguous() && lora_b.is_contiguous() &&
                  token_slots.is_contiguous(),
              "lora_add: contiguous tensors only");
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && lora_a.dim() == 3 && lora_b.dim() == 3, "lora_add: bad ranks");
  const int64_t rows = x.size(0), n_in = x.size(1), n_out = y.size(1), ranks = lora_a.size(1);
  const int64_t parts = static_cast<int64_t>(out_slices.size()) - 1;
  TORCH_CHECK(y.size(0) == rows && token_slots.numel() == rows, "lora_add: rows of x, y, token_slots differ");
  TORCH_CHECK(lora_a.size(2) == n_in && lora_b.size(2) == n_out && lora_b.size(1) == ranks &&
                  lora_b.size(0) == lora_a.size(0),
              "lora_add: lora_a [L, R, in] / lora_b [L, R, out] do not fit x / y");
  TORCH_CHECK(parts >= 1 && ranks % parts == 0 && out_slices.front() == 0 && out_slices.back() == n_out,
              "lora_add: out_slices must run from 0 to out_features in parts that divide the rank");
  const int64_t num_slots = lora_a.size(0);
  const int32_t* slots = token_slots.data_ptr<int32_t>();
  for (int64_t t = 0; t < rows; ++t) {
    TORCH_CHECK(slots[t] >= -1 && slots[t] < num_slots, "lora_add: token_slots[", t, "]=", slots[t], " outside [-1, ",
                num_slots, ")");
  }
  // A row costs ~ (in + out) * ranks multiply-adds: a few rows per task keep 2..N threads busy.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, (n_in + n_out) * ranks / 64));
  at::parallel_for(0, rows, grain, [&](int64_t t0, int64_t t1) {
    if (dtype == torch::kFloat32) {
      lora_rows_f32(y.data_ptr<float>(), x.data_ptr<float>(), lora_a.data_ptr<float>(), lora_b.data_ptr<float>(),
                       slots, out_slices.data(), parts, t0, t1, n_in, n_out, ranks);
    } else {
      lora_rows_bf16(reinterpret_cast<uint16_t*>(y.data_ptr()), reinterpret_cast<const uint16_t*>(x.data_ptr()),
                          reinterpret_cast<const uint16_t*>(lora_a.data_ptr()),
                          reinterpret_cast<const uint16_t*>(lora_b.data_ptr()), slots, out_slices.data(), parts, t0,
                          t1, n_in, n_out, ranks);
    }
  });
}

}  // namespace pagedserve
