// Weight-only int8 linear layers: y = x @ (q * scale)^T (+ bias) with q int8 [N, K] and fp32 scales
// per output column and group of k ([K / group, N]; one group of K: per-output-channel scales, as
// `quantization: int8` makes them at load; groups of 32: GGUF Q8_0's block scales, kept as they are).
// The weights stay int8 in memory (half of bf16's bytes, a quarter of fp32's), widened in registers:
//
// * int8_dot_linear (AVX-512 with AVX512-BF16): x in bf16; each int8 weight becomes a bf16 in
//   registers (exact: every int8 is a bf16) and the pair dot product vdpbf16ps multiplies it with x
//   into fp32 sums, as bf16_dot_linear does over bf16 weights. Measured on a 2-core Zen 4, SmolLM2's
//   121 projections (LM head included) with cold weights: 1 row 3.1 vs 6.4 ms for bf16_dot_linear
//   (half the bytes), 8 rows 3.8 vs 6.5, 64 rows 23.5 vs 21.2 (compute-bound there: the widening
//   costs ~10%; widening each panel once into an L2 buffer for all of a chunk's row blocks
//   measured the same, 23.3-24.2, so it is not done). Chosen over vpdpbusd (VNNI, u8 x s8
//   into int32), which would need x quantized to int8 per row as well, and with it an error on
//   activations (SmolLM2's down projection inputs have outlier channels) that weight-only int8 avoids.
// * int8_avx2_linear (AVX2 with FMA): x widened to fp32, the weights widened to fp32, FMA.
//
// Each group's sums (or each 128 k for per-channel scales) are multiplied by their scales and added
// up in fp32, so the result equals the fp32 product of x and the dequantized weight up to the order
// of the sums (kernels/reference/int8_linear.py is the oracle).
//
// Packed layout (int8_pack_weight): W cut into panels of 32 output columns; a panel is K rows of 32
// bytes (k's 32 columns in order), panels one after another in transparent huge pages, so a thread
// streams its panels in order; a cache line holds two k. N must be a multiple of 32 and K even
// (the Python side checks and keeps the reference otherwise).

#include <ATen/Parallel.h>

#include <vector>

#include "fp32_gemm.h"
#include "huge_pages.h"
#include "ops.h"

namespace pagedserve {
namespace {

using fp32_gemm::kBlockRows;
using fp32_gemm::kPanel;
using fp32_gemm::kSumBlock;
constexpr int64_t kChunkRows = 96;  // rows whose x stays in L2 while every panel passes (at most)
constexpr int64_t kLine = 64;       // bytes per cache line: two k of a panel

// The k values summed apart before scaling: a Q8_0 block (the group), or kSumBlock for one group.
inline int64_t sum_block(int64_t group, int64_t K) { return group >= K ? kSumBlock : group; }

// Lines of the next panel a block prefetches into L2: line l when l % every == phase, so `every`
// blocks over one panel prefetch the next panel once, spread evenly.
struct NextPanel {
  const int8_t* next = nullptr;
  int64_t phase = 0, every = 1;
};

inline void prefetch_line(const NextPanel& pf, int64_t line, int64_t& due) {
  if (line == due) {
    _mm_prefetch(reinterpret_cast<const char*>(pf.next + line * kLine), _MM_HINT_T1);
    due += pf.every;
  }
}

#ifdef PAGEDSERVE_HAVE_AVX512_GEMM

// 16 int8 as fp32 (exact).
PAGEDSERVE_AVX512 inline __m512 widen16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Two k's 16 columns as bf16 pairs (k in each lane's low half, k + 1 in its high half): the fp32
// values' top halves, which hold all of an int8's bits.
PAGEDSERVE_AVX512 inline __m512i bf16_pairs(const int8_t* k, const int8_t* k1) {
  const __m512i lo = _mm512_srli_epi32(_mm512_castps_si512(widen16(k)), 16);
  const __m512i hi = _mm512_castps_si512(widen16(k1));
  // lo | (hi & 0xffff0000)
  return _mm512_ternarylogic_epi32(lo, hi, _mm512_set1_epi32(static_cast<int>(0xffff0000u)), 0xF8);
}

// y[r * ldy + c] (+)= scale(k, c) * sum_k x(r, k) * q(k, c) for r < R, c < 32: x in bf16 pairs
// interleaved by pack_row_pairs (x[s * R + r]: row r's k = 2s, 2s + 1), the panel in int8, the
// scales of this panel's columns one row of lds floats per group.
template <int R, class Dot>
PAGEDSERVE_AVX512_BF16 void pair_block(const uint32_t* x, const int8_t* panel, int64_t K, const float* scales,
                                       int64_t lds, int64_t group, float* y, int64_t ldy, NextPanel pf) {
  const int64_t sb = sum_block(group, K);
  __m512 lo[R], hi[R];
  int64_t due = pf.next != nullptr ? pf.phase : K;
  for (int64_t k0 = 0; k0 < K; k0 += sb) {
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
    const int64_t s1 = std::min(K, k0 + sb) / 2;
    for (int64_t s = k0 / 2; s < s1; ++s) {
      prefetch_line(pf, s, due);
      const int8_t* line = panel + s * kLine;
      const __m512i w0 = bf16_pairs(line, line + kPanel), w1 = bf16_pairs(line + 16, line + kPanel + 16);
#pragma GCC unroll 12
      for (int r = 0; r < R; ++r) {
        const __m512i xr = _mm512_set1_epi32(static_cast<int>(x[s * R + r]));
        lo[r] = Dot::dot(lo[r], xr, w0);
        hi[r] = Dot::dot(hi[r], xr, w1);
      }
    }
    const float* sc = scales + (k0 / group) * lds;
    const __m512 s0 = _mm512_loadu_ps(sc), s16 = _mm512_loadu_ps(sc + 16);
#pragma GCC unroll 12
    for (int r = 0; r < R; ++r) {
      float* yr = y + r * ldy;
      const __m512 a = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(yr);
      const __m512 b = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(yr + 16);
      _mm512_storeu_ps(yr, _mm512_fmadd_ps(lo[r], s0, a));
      _mm512_storeu_ps(yr + 16, _mm512_fmadd_ps(hi[r], s16, b));
    }
  }
}

using PairFn = void (*)(const uint32_t*, const int8_t*, int64_t, const float*, int64_t, int64_t, float*, int64_t,
                        NextPanel);
template <class Dot, int... R>
constexpr std::array<PairFn, sizeof...(R)> pair_table(std::integer_sequence<int, R...>) {
  return {&pair_block<R + 1, Dot>...};
}

// 8 int8 as fp32 (exact).
PAGEDSERVE_AVX2 inline __m256 widen8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// The AVX2 block: y[r * ldy + c] (+)= scale(k, c) * sum_k x(r, k) * q(k, c) for r < R, c < 16,
// x(r, k) = x[k * ldx + r] (rows interleaved by pack_rows), the panel's columns from `panel` on
// (a panel row is 32 bytes), 2 R ymm accumulators.
template <int R>
PAGEDSERVE_AVX2 void ymm_block(const float* x, int64_t ldx, const int8_t* panel, int64_t K, const float* scales,
                               int64_t lds, int64_t group, float* y, int64_t ldy, NextPanel pf) {
  const int64_t sb = sum_block(group, K);
  __m256 acc[R][2];
  int64_t due = pf.next != nullptr ? pf.phase : K;
  for (int64_t k0 = 0; k0 < K; k0 += sb) {
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const int64_t k1 = std::min(K, k0 + sb);
    for (int64_t k = k0; k < k1; ++k) {
      if ((k & 1) == 0) prefetch_line(pf, k / 2, due);
      const __m256 w0 = widen8(panel + k * kPanel), w1 = widen8(panel + k * kPanel + 8);
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        const __m256 xr = _mm256_broadcast_ss(x + k * ldx + r);
        acc[r][0] = _mm256_fmadd_ps(xr, w0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(xr, w1, acc[r][1]);
      }
    }
    const float* sc = scales + (k0 / group) * lds;
    const __m256 s0 = _mm256_loadu_ps(sc), s8 = _mm256_loadu_ps(sc + 8);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      float* yr = y + r * ldy;
      const __m256 a = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(yr);
      const __m256 b = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(yr + 8);
      _mm256_storeu_ps(yr, _mm256_fmadd_ps(acc[r][0], s0, a));
      _mm256_storeu_ps(yr + 8, _mm256_fmadd_ps(acc[r][1], s8, b));
    }
  }
}

constexpr int64_t kYmmRows = 6;  // rows per ymm_block (12 accumulators of 16 registers)
using YmmFn = void (*)(const float*, int64_t, const int8_t*, int64_t, const float*, int64_t, int64_t, float*, int64_t,
                       NextPanel);
template <int... R>
constexpr std::array<YmmFn, sizeof...(R)> ymm_table(std::integer_sequence<int, R...>) {
  return {&ymm_block<R + 1>...};
}

#endif  // PAGEDSERVE_HAVE_AVX512_GEMM

// How a kernel packs x and multiplies a block of up to kBlockRows rows by one panel.

template <class Dot>
struct PairMath {
  using X = uint32_t;
  static constexpr int64_t kKPerX = 2;
  static constexpr const char* name = "int8_dot";
  static constexpr const char* isa = "AVX-512";
  static bool available() { return fp32_gemm::available(); }
  static bool takes(c10::ScalarType t) { return t == torch::kBFloat16; }
#ifdef PAGEDSERVE_HAVE_AVX512_GEMM
  static void pack(const torch::Tensor& x, int64_t r0, int64_t rows, X* out) {
    const int64_t K = x.size(1);
    fp32_gemm::pack_row_pairs(reinterpret_cast<const uint16_t*>(x.data_ptr()) + r0 * K, rows, K, out);
  }
  static void block(int64_t rows, const X* xp, const int8_t* panel, int64_t K, const float* scales, int64_t lds,
                    int64_t group, float* y, int64_t ldy, NextPanel pf) {
    static constexpr auto table = pair_table<Dot>(std::make_integer_sequence<int, kBlockRows>{});
    table[rows - 1](xp, panel, K, scales, lds, group, y, ldy, pf);
  }
#endif
};

struct Avx2Math {
  using X = float;
  static constexpr int64_t kKPerX = 1;
  static constexpr const char* name = "int8_avx2";
  static constexpr const char* isa = "AVX2 with FMA";
  static bool available() { return fp32_gemm::avx2_available(); }
  static bool takes(c10::ScalarType t) { return t == torch::kBFloat16 || t == torch::kFloat; }
#ifdef PAGEDSERVE_HAVE_AVX512_GEMM
  static void pack(const torch::Tensor& x, int64_t r0, int64_t rows, X* out) {
    const int64_t K = x.size(1);
    if (x.scalar_type() == torch::kFloat) {
      fp32_gemm::pack_rows(x.data_ptr<float>() + r0 * K, rows, K, out);
    } else {
      fp32_gemm::pack_rows(reinterpret_cast<const uint16_t*>(x.data_ptr()) + r0 * K, rows, K, out);
    }
  }
  // Slices of up to kYmmRows rows, each over the panel's two halves; the first slice prefetches.
  static void block(int64_t rows, const X* xp, const int8_t* panel, int64_t K, const float* scales, int64_t lds,
                    int64_t group, float* y, int64_t ldy, NextPanel pf) {
    static constexpr auto table = ymm_table(std::make_integer_sequence<int, kYmmRows>{});
    for (int64_t r0 = 0; r0 < rows; r0 += kYmmRows) {
      const auto fn = table[std::min(kYmmRows, rows - r0) - 1];
      fn(xp + r0, rows, panel, K, scales, lds, group, y + r0 * ldy, ldy, r0 == 0 ? pf : NextPanel{});
      fn(xp + r0, rows, panel + 16, K, scales + 16, lds, group, y + r0 * ldy + 16, ldy, NextPanel{});
    }
  }
#endif
};

// Rows per chunk for M rows: as few chunks as kChunkRows allows, of about equal size in whole blocks.
inline int64_t chunk_rows(int64_t M) {
  const int64_t chunks = (M + kChunkRows - 1) / kChunkRows;
  const int64_t rows = (M + chunks - 1) / chunks;
  return (rows + kBlockRows - 1) / kBlockRows * kBlockRows;
}

template <class Math>
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                     const c10::optional<torch::Tensor>& bias, int64_t out_features, int64_t group) {
  const char* name = Math::name;
  TORCH_CHECK(Math::takes(x.scalar_type()) && x.dim() == 2 && x.is_contiguous(), name,
              "_linear: x must be a contiguous 2-D tensor of a dtype this kernel takes, got ",
              dtype_name(x.scalar_type()), " ", x.sizes());
  TORCH_CHECK(Math::available(), name, "_linear: this CPU (or build) offers no ", Math::isa);
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(packed.scalar_type() == torch::kChar && packed.is_contiguous() && packed.numel() == N * K &&
                  N % kPanel == 0 && K % 2 == 0,
              name, "_linear: packed must be int8_pack_weight's result for a [", N, ", ", K, "] weight");
  TORCH_CHECK(group > 0 && group % 2 == 0 && (group == K || K % group == 0), name, "_linear: group_size ", group,
              " must be even and K (", K, ") or a divisor of it");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == K / group && scales.size(1) == N,
              name, "_linear: scales must be contiguous float32 [", K / group, ", ", N, "], got ", scales.sizes());
  torch::Tensor bias32;
  if (bias.has_value()) {
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == N, name, "_linear: bias must be contiguous [out_features]");
    bias32 = bias->to(torch::kFloat);
  }
  torch::Tensor y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
#ifdef PAGEDSERVE_HAVE_AVX512_GEMM
  using X = typename Math::X;
  const int64_t per_row = K / Math::kKPerX;
  torch::Tensor x_packed = torch::empty({M, per_row}, x.options().dtype(torch::kFloat));  // 32-bit storage
  X* xp = reinterpret_cast<X*>(x_packed.data_ptr());
  at::parallel_for(0, (M + kBlockRows - 1) / kBlockRows, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r0 = b * kBlockRows;
      Math::pack(x, r0, std::min(kBlockRows, M - r0), xp + r0 * per_row);
    }
  });
  const int8_t* w = packed.data_ptr<int8_t>();
  const float* sc = scales.data_ptr<float>();
  const float* b = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  const bool fp32_out = x.scalar_type() == torch::kFloat;
  const int64_t chunk = chunk_rows(M);
  at::parallel_for(0, N / kPanel, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> sums(static_cast<size_t>(chunk * kPanel));
    for (int64_t c0 = 0; c0 < M; c0 += chunk) {
      const int64_t c1 = std::min(M, c0 + chunk);
      const int64_t num_blocks = (c1 - c0 + kBlockRows - 1) / kBlockRows;
      for (int64_t p = p0; p < p1; ++p) {
        const int8_t* panel = w + p * K * kPanel;
        const int8_t* next = p + 1 < p1 ? panel + K * kPanel : nullptr;
        for (int64_t i = 0; i < num_blocks; ++i) {
          const int64_t r0 = i * kBlockRows, rows = std::min(kBlockRows, c1 - c0 - r0);
          Math::block(rows, xp + (c0 + r0) * per_row, panel, K, sc + p * kPanel, N, group, sums.data() + r0 * kPanel,
                      kPanel, {next, i, num_blocks});
        }
        for (int64_t r = 0; r < c1 - c0; ++r) {
          float* row = sums.data() + r * kPanel;
          if (b != nullptr) {
            for (int64_t c = 0; c < kPanel; ++c) row[c] += b[p * kPanel + c];
          }
          if (fp32_out) {
            std::memcpy(y.data_ptr<float>() + (c0 + r) * N + p * kPanel, row, kPanel * sizeof(float));
          } else {
            c10::BFloat16* out = y.data_ptr<c10::BFloat16>() + (c0 + r) * N + p * kPanel;
            for (int64_t c = 0; c < kPanel; ++c) out[c] = c10::BFloat16(row[c]);
          }
        }
      }
    }
  });
#endif
  return y;
}

}  // namespace

bool int8_dot_native() { return fp32_gemm::native_bf16_dot(); }

torch::Tensor int8_pack_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.scalar_type() == torch::kChar && weight.dim() == 2 && weight.is_contiguous(),
              "int8_pack_weight: weight must be a contiguous 2-D int8 tensor, got ", dtype_name(weight.scalar_type()),
              " ", weight.sizes());
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % kPanel == 0 && K > 0 && K % 2 == 0, "int8_pack_weight: out_features must be a multiple of ", kPanel,
              " and in_features even, got ", weight.sizes());
  torch::Tensor packed = huge_page_empty(N * K, weight.options());
  const int8_t* src = weight.data_ptr<int8_t>();
  int8_t* dst = packed.data_ptr<int8_t>();
  at::parallel_for(0, N / kPanel, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      for (int64_t c = 0; c < kPanel; ++c) {
        const int8_t* row = src + (p * kPanel + c) * K;
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * kPanel + c] = row[k];
      }
    }
  });
  return packed;
}

// vdpbf16ps where the CPU has it, else its emulation (fp32_gemm::EmulatedDot: for tests).
torch::Tensor int8_dot_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                              c10::optional<torch::Tensor> bias, int64_t out_features, int64_t group_size) {
  if (fp32_gemm::native_bf16_dot()) {
    return linear<PairMath<fp32_gemm::NativeDot>>(x, packed, scales, bias, out_features, group_size);
  }
  return linear<PairMath<fp32_gemm::EmulatedDot>>(x, packed, scales, bias, out_features, group_size);
}

torch::Tensor int8_avx2_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                               c10::optional<torch::Tensor> bias, int64_t out_features, int64_t group_size) {
  return linear<Avx2Math>(x, packed, scales, bias, out_features, group_size);
}

}  // namespace pagedserve
