// Multi-LoRA's per-row adapter update, y[t] += (x[t] @ A[s].T) @ B[s] for s = token_slots[t] >= 0
// (kernels/reference/lora.py is the definition and the oracle). One call per projection does every
// row: the reference's gather, two batched matmuls, mask and scatter-add cost ~20 us of op overhead
// each on small decode batches, several times the arithmetic (a rank-16 update is ~5% of a layer's
// multiply-adds). Here the rows of one adapter go in blocks of up to 4: their shrink (S*R dot
// products over `in`) lands in a scratch block in fp32, and their expand walks each part of a
// fused projection with only that part's R ranks of B (B is block diagonal: q's outputs read ranks
// [0, R), k's [R, 2R), ...), 64 outputs at a time; every vector of A and B loaded serves the
// block's 4 rows. Rows are split across threads. bf16 tensors are widened to fp32 for the math
// and y rounded once at the end.

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

// shrunk[n][j] = A[j, :] . x_n for the N rows x_n (one adapter) and j < ranks: four rows of A per
// pass, so each vector of x and of A is loaded once for 4 (or N) multiply-adds.
template <int N, class T>
PAGEDSERVE_INLINE void shrink(const T* const* x, const T* a, int64_t n_in, int64_t ranks, float* shrunk) {
  int64_t j = 0;
  for (; j + 4 <= ranks; j += 4) {
    const T* a0 = a + j * n_in;
    v16sf acc[N][4] = {};
    int64_t i = 0;
    for (; i + 16 <= n_in; i += 16) {
      const v16sf av[4] = {load16(a0 + i), load16(a0 + n_in + i), load16(a0 + 2 * n_in + i),
                           load16(a0 + 3 * n_in + i)};
      for (int n = 0; n < N; ++n) {
        const v16sf xv = load16(x[n] + i);
        for (int q = 0; q < 4; ++q) acc[n][q] += av[q] * xv;
      }
    }
    for (int n = 0; n < N; ++n) {
      for (int q = 0; q < 4; ++q) {
        float t = hsum16(acc[n][q]);
        for (int64_t k = i; k < n_in; ++k) t += load1(a0 + q * n_in + k) * load1(x[n] + k);
        shrunk[n * ranks + j + q] = t;
      }
    }
  }
  for (; j < ranks; ++j) {
    for (int n = 0; n < N; ++n) {
      float t = 0.f;
      for (int64_t k = 0; k < n_in; ++k) t += load1(a + j * n_in + k) * load1(x[n] + k);
      shrunk[n * ranks + j] = t;
    }
  }
}

// y_n[o] += sum_k shrunk[n][k] * B[k, o] for o in [o0, o1) and the part's ranks k in [k0, k0 + r),
// 64 outputs of the N rows at a time: each vector of B is loaded once for N multiply-adds.
template <int N, class T>
PAGEDSERVE_INLINE void expand(const float* shrunk, int64_t ranks, const T* b, int64_t n_out, int64_t k0, int64_t r,
                              int64_t o0, int64_t o1, T* const* y) {
  int64_t o = o0;
  for (; o + 64 <= o1; o += 64) {
    v16sf acc[N][4] = {};
    for (int64_t k = k0; k < k0 + r; ++k) {
      const T* row = b + k * n_out + o;
      const v16sf bv[4] = {load16(row), load16(row + 16), load16(row + 32), load16(row + 48)};
      for (int n = 0; n < N; ++n) {
        const float s = shrunk[n * ranks + k];
        for (int q = 0; q < 4; ++q) acc[n][q] += s * bv[q];
      }
    }
    for (int n = 0; n < N; ++n) {
      for (int q = 0; q < 4; ++q) store16(y[n] + o + 16 * q, load16(y[n] + o + 16 * q) + acc[n][q]);
    }
  }
  for (; o < o1; ++o) {
    for (int n = 0; n < N; ++n) {
      float acc = 0.f;
      for (int64_t k = k0; k < k0 + r; ++k) acc += shrunk[n * ranks + k] * load1(b + k * n_out + o);
      store1(y[n] + o, load1(y[n] + o) + acc);
    }
  }
}

template <int N, class T>
PAGEDSERVE_INLINE void lora_block(T* const* y, const T* const* x, const T* a, const T* b, const int64_t* out_slices,
                                  int64_t parts, int64_t n_in, int64_t n_out, int64_t ranks, float* shrunk) {
  const int64_t r = ranks / parts;
  shrink<N>(x, a, n_in, ranks, shrunk);
  for (int64_t p = 0; p < parts; ++p) {
    expand<N>(shrunk, ranks, b, n_out, p * r, r, out_slices[p], out_slices[p + 1], y);
  }
}

// Rows [t0, t1), taken adapter by adapter in blocks of up to 4 rows of the same adapter.
template <class T>
PAGEDSERVE_INLINE void lora_rows(T* y, const T* x, const T* a, const T* b, const int32_t* token_slots,
                                 const int64_t* out_slices, int64_t parts, int64_t num_slots, int64_t t0, int64_t t1,
                                 int64_t n_in, int64_t n_out, int64_t ranks) {
  std::vector<float> shrunk(4 * ranks);
  std::vector<int64_t> rows;
  for (int64_t s = 0; s < num_slots; ++s) {
    rows.clear();
    for (int64_t t = t0; t < t1; ++t) {
      if (token_slots[t] == s) rows.push_back(t);
    }
    const T* as = a + s * ranks * n_in;
    const T* bs = b + s * ranks * n_out;
    for (size_t i = 0; i < rows.size(); i += 4) {
      const int n = static_cast<int>(std::min<size_t>(4, rows.size() - i));
      const T* xs[4];
      T* ys[4];
      for (int m = 0; m < n; ++m) {
        xs[m] = x + rows[i + m] * n_in;
        ys[m] = y + rows[i + m] * n_out;
      }
      switch (n) {
        case 4: lora_block<4>(ys, xs, as, bs, out_slices, parts, n_in, n_out, ranks, shrunk.data()); break;
        case 3: lora_block<3>(ys, xs, as, bs, out_slices, parts, n_in, n_out, ranks, shrunk.data()); break;
        case 2: lora_block<2>(ys, xs, as, bs, out_slices, parts, n_in, n_out, ranks, shrunk.data()); break;
        default: lora_block<1>(ys, xs, as, bs, out_slices, parts, n_in, n_out, ranks, shrunk.data()); break;
      }
    }
  }
}

// The clones: AVX-512 (kernels/cpu/lora.py calls the extension only where it runs) and a baseline.
__attribute__((target_clones("arch=x86-64-v4", "default"))) void lora_rows_f32(
    float* y, const float* x, const float* a, const float* b, const int32_t* token_slots, const int64_t* out_slices,
    int64_t parts, int64_t num_slots, int64_t t0, int64_t t1, int64_t n_in, int64_t n_out, int64_t ranks) {
  lora_rows(y, x, a, b, token_slots, out_slices, parts, num_slots, t0, t1, n_in, n_out, ranks);
}

__attribute__((target_clones("arch=x86-64-v4", "default"))) void lora_rows_bf16(
    uint16_t* y, const uint16_t* x, const uint16_t* a, const uint16_t* b, const int32_t* token_slots,
    const int64_t* out_slices, int64_t parts, int64_t num_slots, int64_t t0, int64_t t1, int64_t n_in, int64_t n_out,
    int64_t ranks) {
  lora_rows(y, x, a, b, token_slots, out_slices, parts, num_slots, t0, t1, n_in, n_out, ranks);
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
  if (lora_add_amx(y, x, lora_a, lora_b, slots, out_slices)) return;
  // A row costs ~ (in + out) * ranks multiply-adds: a few rows per task keep 2..N threads busy,
  // and enough of them that each adapter's rows come in blocks (4 per adapter).
  const int64_t grain = std::max<int64_t>(
      4 * num_slots, 16384 / std::max<int64_t>(1, (n_in + n_out) * ranks / 64));
  at::parallel_for(0, rows, grain, [&](int64_t t0, int64_t t1) {
    if (dtype == torch::kFloat32) {
      lora_rows_f32(y.data_ptr<float>(), x.data_ptr<float>(), lora_a.data_ptr<float>(), lora_b.data_ptr<float>(),
                    slots, out_slices.data(), parts, num_slots, t0, t1, n_in, n_out, ranks);
    } else {
      lora_rows_bf16(reinterpret_cast<uint16_t*>(y.data_ptr()), reinterpret_cast<const uint16_t*>(x.data_ptr()),
                     reinterpret_cast<const uint16_t*>(lora_a.data_ptr()),
                     reinterpret_cast<const uint16_t*>(lora_b.data_ptr()), slots, out_slices.data(), parts,
                     num_slots, t0, t1, n_in, n_out, ranks);
    }
  });
}

}  // namespace pagedserve
