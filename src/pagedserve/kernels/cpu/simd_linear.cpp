// Linear layers on AVX-512 and AVX2: y = x @ W^T (+ bias) with W packed once, at load, into
// 32-column panels that a call streams in order, each weight byte read from memory once per call.
// fp32 weights (fp32_*) in fp32 math, on AVX-512 or (avx2_fp32_*) AVX2 with FMA; bf16 weights on
// AVX-512 in fp32 math for CPUs without bf16 dot products (bf16_*), or with AVX512-BF16's dot
// product over bf16 pairs (bf16_dot_*: CPUs with it but without AMX, whose amx_linear.cpp is
// faster still).
//
// Why not MKL / oneDNN for fp32: at decode sizes (a few to 64 rows) MKL's sgemm reached about half
// of this host's fp32 FMA peak on SmolLM2's projections (147 of ~300 GFLOP/s over W64's decode
// steps): the weights are cold on every call (430 MB per step, far beyond L2), and reading them and
// computing on them do not overlap. Here the next panel is prefetched into L2 while the current
// one is multiplied with every row, so the stream hides behind the FMAs; the block asks for its
// own panel a few steps ahead into L1 (fp32_gemm.h: Prefetch::streamed).
//
// Why bf16 here: on a CPU with AVX-512F but neither AVX512-BF16 nor AMX, oneDNN's bf16 matmul
// runs an emulation (a W64 run spent 103 of 126 s in it, 3.5x the fp32 run). Widening bf16 to
// fp32 is a shift or a mask per 16 values, so the same block runs bf16 weights at fp32 speed while
// streaming half the bytes. Outputs are rounded to bf16 once, from the fp32 sums, as oneDNN does.
// With AVX512-BF16, vdpbf16ps multiplies x and W in bf16 pairs into the same fp32 sums: twice the
// multiply-adds per instruction of fp32 math, over weights streamed as amx_linear.cpp streams them
// (on the AMX host, oneDNN's bf16 matmul read cold weights at about half the memory's rate).
//
// Packed layout. W [N, K] (out_features x in_features) is cut into panels of 32 output columns;
// a panel is K/kK steps of 128 bytes, each the 32 columns' values at kK consecutive k
// (fp32_gemm.h: Fp32Panel, one k per step; Bf16PairPanel, two). Panels follow one another, so a
// thread reading its panels reads one sequential stream, in transparent huge pages
// (huge_pages.cpp). N must be a multiple of 32 and, for bf16, K even (the Python side checks and
// keeps torch's matmul otherwise).
//
// Compute. Blocks of up to 12 rows times one panel (fp32_gemm.h: 24 zmm accumulators, blocked
// fp32 sums; `block`, or `pair_block` for the dot product; on AVX2, ymm_rows_block's slices of 6
// rows x 16 columns or 3 x 32 in 12 ymm accumulators, each sum taken as on AVX-512), then the bias. Rows are taken in
// chunks of 96, so a chunk's rows of x stay in L2 while every panel passes. Panels are split
// across threads.

#include <ATen/Parallel.h>

#include <type_traits>
#include <vector>

#include "fp32_gemm.h"
#include "huge_pages.h"
#include "ops.h"
#include "row_argmax.h"
#include "work_share.h"

namespace pagedserve {
namespace {

using fp32_gemm::Bf16PairPanel;
using fp32_gemm::Fp32Panel;
using fp32_gemm::kBlockRows;
using fp32_gemm::kPanel;
constexpr int64_t kChunkRows = 96;  // rows whose x stays in L2 while all panels pass (at most)

// Rows per chunk for M rows: as few chunks as kChunkRows allows, of about equal size in whole
// blocks, so no chunk streams every panel for a handful of rows (128 rows as 96 + 32 took 1.5x
// the time of 96 on AVX2).
inline int64_t chunk_rows(int64_t M) {
  const int64_t chunks = (M + kChunkRows - 1) / kChunkRows;
  const int64_t rows = (M + chunks - 1) / chunks;
  return (rows + kBlockRows - 1) / kBlockRows * kBlockRows;
}

// Per panel kind: the tensors' dtype and the entry points' name prefix, for checks and messages.
// (The panel kinds are plain structs, so they exist on every build.)
template <class Panel>
struct Kind;
template <>
struct Kind<Fp32Panel> {
  static constexpr c10::ScalarType dtype = torch::kFloat;
  static constexpr const char* name = "fp32";
};
template <>
struct Kind<Bf16PairPanel> {
  static constexpr c10::ScalarType dtype = torch::kBFloat16;
  static constexpr const char* name = "bf16";
};

template <class Panel>
const typename Panel::T* values(const torch::Tensor& t) {
  return reinterpret_cast<const typename Panel::T*>(t.data_ptr());
}

// How a kernel multiplies x by a panel, and how it wants x packed: fp32 math over x widened to fp32
// and interleaved (FmaMath on AVX-512, Avx2FmaMath), or bf16 dot products over x in interleaved
// pairs (DotMath). `name` prefixes the entry points' errors, `isa` names what `available` checks.
template <class P>
struct FmaMath {
  using Panel = P;
  using X = float;
  static constexpr int64_t kKPerX = 1;  // k values per packed X value
  static constexpr const char* name = Kind<P>::name;
  static constexpr const char* isa = "AVX-512";
  static bool available() { return fp32_gemm::available(); }
#ifdef PAGEDSERVE_HAVE_AVX512_GEMM
  static void pack(const typename P::T* x, int64_t rows, int64_t K, X* out) { fp32_gemm::pack_rows(x, rows, K, out); }
  static void block(int64_t rows, const X* xp, const typename P::T* panel, int64_t K, float* y, int64_t ldy,
                    fp32_gemm::Prefetch<P> pf) {
    fp32_gemm::packed_rows_block<P>(rows, xp, panel, P::kStep, K, y, ldy, pf);
  }
#endif
};

struct Avx2FmaMath : FmaMath<Fp32Panel> {
  static constexpr const char* name = "avx2_fp32";
  static constexpr const char* isa = "AVX2 with FMA";
  static bool available() { return fp32_gemm::avx2_available(); }
#ifdef PAGEDSERVE_HAVE_AVX512_GEMM
  static void block(int64_t rows, const X* xp, const float* panel, int64_t K, float* y, int64_t ldy,
                    fp32_gemm::Prefetch<Panel> pf) {
    fp32_gemm::ymm_rows_block<true>(rows, xp, rows, panel, Fp32Panel::kStep, K, y, ldy, pf);
  }
#endif
};

template <class Dot>
struct DotMath {
  using Panel = Bf16PairPanel;
  using X = uint32_t;
  static constexpr int64_t kKPerX = 2;
  static constexpr const char* name = "bf16_dot";
  static constexpr const char* isa = "AVX-512";
  static bool available() { return fp32_gemm::available(); }
#ifdef PAGEDSERVE_HAVE_AVX512_GEMM
  static void pack(const uint16_t* x, int64_t rows, int64_t K, X* out) { fp32_gemm::pack_row_pairs(x, rows, K, out); }
  static void block(int64_t rows, const X* xp, const uint16_t* panel, int64_t K, float* y, int64_t ldy,
                    fp32_gemm::Prefetch<Panel> pf) {
    fp32_gemm::pair_rows_block<Dot>(rows, xp, panel, K, y, ldy, pf);
  }
#endif
};

#ifdef PAGEDSERVE_HAVE_AVX512_GEMM

// 16 fp32 values rounded to bf16 as c10::BFloat16 rounds them (to nearest even, NaN a quiet NaN),
// each in the low 16 bits of its lane.
PAGEDSERVE_AVX512 inline __m512i bf16_bits(const float* src) {
  const __m512 f = _mm512_loadu_ps(src);
  const __m512i bits = _mm512_castps_si512(f);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7fff));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
}

PAGEDSERVE_AVX512 inline void store_bf16(const float* src, uint16_t* dst) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(bf16_bits(src)));
}

// The same values widened back to fp32 (fp32_out: what .float() of the bf16 result gives).
PAGEDSERVE_AVX512 inline void store_bf16_widened(const float* src, float* dst) {
  _mm512_storeu_ps(dst, _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(src), 16)));
}

// Rows [0, rows) of one panel's 32 sums (row stride ld), bias added, folded into best[0 .. rows)
// (row_argmax.h), as stored: fp32, or (kRound) rounded to bf16.
template <bool kRound>
PAGEDSERVE_AVX512 void fold_panel(const float* sums, int64_t ld, int64_t rows, int64_t col0, row_argmax::Best* best) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = sums + r * ld;
    if constexpr (kRound) {
      row_argmax::fold32(best[r], _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(row), 16)),
                         _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(row + 16), 16)), col0);
    } else {
      row_argmax::fold32(best[r], _mm512_loadu_ps(row), _mm512_loadu_ps(row + 16), col0);
    }
  }
}

// Panels [p0, p1) of y for rows [0, M), from x packed by pack_x, plus the bias. fp32 outputs are
// summed in place; bf16 outputs in a chunk-sized fp32 buffer, then rounded once into y (kWiden:
// into fp32 y, widened back from bf16). Out = row_argmax::Best: y is best[0 .. M), each row's
// values folded into it from the buffer instead of stored.
template <class Math, class Out, bool kWiden = false>
void panels(const typename Math::X* xp, const typename Math::Panel::T* w, const float* bias, Out* y, int64_t M,
            int64_t K, int64_t N, int64_t p0, int64_t p1) {
  using Panel = typename Math::Panel;
  static_assert(!kWiden || std::is_same<Out, float>::value, "widened bf16 results are stored as fp32");
  constexpr bool kInPlace = std::is_same<Out, float>::value && !kWiden;
  constexpr bool kFold = std::is_same<Out, row_argmax::Best>::value;
  const int64_t panel_values = K / Panel::kK * Panel::kStep;
  const int64_t chunk = chunk_rows(M);
  std::vector<float> sums(kInPlace ? 0 : static_cast<size_t>(chunk * kPanel));
  for (int64_t c0 = 0; c0 < M; c0 += chunk) {
    const int64_t c1 = std::min(M, c0 + chunk);
    const int64_t num_blocks = (c1 - c0 + kBlockRows - 1) / kBlockRows;
    for (int64_t p = p0; p < p1; ++p) {
      const typename Panel::T* panel = w + p * panel_values;
      const typename Panel::T* next = p + 1 < p1 ? panel + panel_values : nullptr;
      // Row r of the chunk's 32 sums: fp32 y in place, or row r - c0 of the buffer.
      float* first = kInPlace ? reinterpret_cast<float*>(y) + c0 * N + p * kPanel : sums.data();
      const int64_t ld = kInPlace ? N : kPanel;
      for (int64_t i = 0; i < num_blocks; ++i) {
        const int64_t r0 = i * kBlockRows, rows = std::min(kBlockRows, c1 - c0 - r0);
        const fp32_gemm::Prefetch<Panel> pf{next, i, num_blocks, /*streamed=*/true};
        Math::block(rows, xp + (c0 + r0) * K / Math::kKPerX, panel, K, first + r0 * ld, ld, pf);
      }
      for (int64_t r = 0; r < c1 - c0; ++r) {
        float* row = first + r * ld;
        if (bias != nullptr) {
          for (int64_t c = 0; c < kPanel; ++c) row[c] += bias[p * kPanel + c];
        }
        if constexpr (kFold) {
          continue;  // the whole chunk at once, below
        } else if constexpr (kWiden) {
          float* out = y + (c0 + r) * N + p * kPanel;
          store_bf16_widened(row, out);
          store_bf16_widened(row + 16, out + 16);
        } else if constexpr (!kInPlace) {
          auto* out = reinterpret_cast<uint16_t*>(y + (c0 + r) * N + p * kPanel);
          store_bf16(row, out);
          store_bf16(row + 16, out + 16);
        }
      }
      if constexpr (kFold) {
        fold_panel<!std::is_same<Panel, Fp32Panel>::value>(first, ld, c1 - c0, p * kPanel, y + c0);
      }
    }
  }
}

// x [M, K] as Math's block reads it, each 12-row block interleaved, blocks in row order: block i
// starts at row 12 i's offset, i * 12 * K / Math::kKPerX X values.
template <class Math>
torch::Tensor pack_x(const torch::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), per_row = K / Math::kKPerX;
  static_assert(sizeof(typename Math::X) == 4, "packed x values are 32 bits");
  torch::Tensor packed = torch::empty({M, per_row}, x.options().dtype(torch::kFloat));  // 32-bit storage
  const auto* src = reinterpret_cast<const typename Math::Panel::T*>(x.data_ptr());
  auto* dst = reinterpret_cast<typename Math::X*>(packed.data_ptr());
  at::parallel_for(0, (M + kBlockRows - 1) / kBlockRows, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r0 = b * kBlockRows;
      Math::pack(src + r0 * K, std::min(kBlockRows, M - r0), K, dst + r0 * per_row);
    }
  });
  return packed;
}
#endif

template <class Panel>
void check_matrix(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == Kind<Panel>::dtype && t.dim() == 2 && t.is_contiguous(), Kind<Panel>::name,
              "_linear: ", name, " must be a contiguous 2-D ", dtype_name(Kind<Panel>::dtype), " tensor, got ",
              dtype_name(t.scalar_type()), " ", t.sizes());
}

// Where W[n][k] lies in the packed layout, in T values.
template <class Panel>
int64_t packed_offset(int64_t n, int64_t k, int64_t K) {
  const int64_t panel = n / kPanel, c = n % kPanel, step = k / Panel::kK, s = k % Panel::kK;
  const int64_t base = (panel * (K / Panel::kK) + step) * Panel::kStep;
  // Fp32Panel: the 32 columns in order. Bf16PairPanel: column c in 32-bit lane c % 16 of half
  // c / 16, k's value in the lane's low 16 bits, k + 1's in its high 16 bits.
  return Panel::kK == 1 ? base + c : base + (c / 16) * 32 + (c % 16) * 2 + s;
}

template <class Panel>
torch::Tensor pack_weight(const torch::Tensor& weight) {
  check_matrix<Panel>(weight, "weight");
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(N % kPanel == 0 && K > 0 && K % Panel::kK == 0, Kind<Panel>::name,
              "_pack_weight: out_features must be a multiple of ", kPanel, " and in_features of ", Panel::kK,
              ", got ", weight.sizes());
  torch::Tensor packed = huge_page_empty(N * K, weight.options());
  const auto* w = values<Panel>(weight);
  auto* p = const_cast<typename Panel::T*>(values<Panel>(packed));
  at::parallel_for(0, N / kPanel, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t n = g0 * kPanel; n < g1 * kPanel; ++n) {
      for (int64_t k = 0; k < K; ++k) p[packed_offset<Panel>(n, k, K)] = w[n * K + k];
    }
  });
  return packed;
}

// The checks linear and linear_argmax share (`entry`: the entry point's name after Math's, for
// messages); the bias widened to fp32 (undefined: none).
template <class Math>
torch::Tensor checked_bias32(const torch::Tensor& x, const torch::Tensor& packed,
                             const c10::optional<torch::Tensor>& bias, int64_t N, const char* entry) {
  using Panel = typename Math::Panel;
  const char* name = Math::name;
  TORCH_CHECK(x.scalar_type() == Kind<Panel>::dtype && x.dim() == 2 && x.is_contiguous(), name, entry,
              ": x must be a contiguous 2-D ", dtype_name(Kind<Panel>::dtype), " tensor, got ",
              dtype_name(x.scalar_type()), " ", x.sizes());
  TORCH_CHECK(Math::available(), name, entry, ": this CPU (or build) offers no ", Math::isa);
  const int64_t K = x.size(1);
  TORCH_CHECK(packed.scalar_type() == Kind<Panel>::dtype && packed.is_contiguous() && packed.numel() == N * K &&
                  N % kPanel == 0 && K % Panel::kK == 0,
              name, entry, ": packed must be ", Kind<Panel>::name, "_pack_weight's result for a [", N, ", ", K,
              "] weight");
  if (!bias.has_value()) return torch::Tensor();
  TORCH_CHECK(bias->scalar_type() == Kind<Panel>::dtype && bias->is_contiguous() && bias->numel() == N, name, entry,
              ": bias must be contiguous ", dtype_name(Kind<Panel>::dtype), " [out_features]");
  return bias->to(torch::kFloat);
}

// fp32_out (bf16 kernels): the bf16-rounded results stored widened to fp32 (amx_linear.cpp says why).
template <class Math>
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                     int64_t out_features, bool fp32_out = false,
                     const c10::optional<torch::Tensor>& out = c10::nullopt) {
  using Panel = typename Math::Panel;
  const int64_t N = out_features;
  const torch::Tensor bias32 = checked_bias32<Math>(x, packed, bias, N, "_linear");
  const int64_t M = x.size(0), K = x.size(1);
  constexpr bool kFp32 = std::is_same<Panel, Fp32Panel>::value;
  const bool widen = fp32_out && !kFp32;
  torch::Tensor y = output_for(x, N, widen ? torch::kFloat : x.scalar_type(), out, Math::name);
  if (M == 0) return y;
#ifdef PAGEDSERVE_HAVE_AVX512_GEMM
  const torch::Tensor x_packed = pack_x<Math>(x);
  const auto* xp = reinterpret_cast<const typename Math::X*>(x_packed.data_ptr());
  const float* b = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  const auto* w = values<Panel>(packed);
  using Out = std::conditional_t<kFp32, float, c10::BFloat16>;
  // By value, x's packed copy, the weights and the bias with it: under work_share.h the helper
  // may run it after this call returned.
  auto columns = [x_packed, packed, bias32, xp, w, b, widen, M, K, N](int64_t p0, int64_t p1, void* dst) {
    if (widen) {
      panels<Math, float, !kFp32>(xp, w, b, static_cast<float*>(dst), M, K, N, p0, p1);
    } else {
      panels<Math>(xp, w, b, static_cast<Out*>(dst), M, K, N, p0, p1);
    }
  };
  if (work_share::sharing()) {
    work_share::run_columns(N / kPanel, kPanel, y.data_ptr(), M, N, y.element_size(), columns);
    return y;
  }
  void* dst = y.data_ptr();
  at::parallel_for(0, N / kPanel, 1, [&](int64_t p0, int64_t p1) { columns(p0, p1, dst); });
#endif
  return y;
}

// Each row's argmax over what linear returns (row_argmax.h), without storing it.
template <class Math>
torch::Tensor linear_argmax(const torch::Tensor& x, const torch::Tensor& packed,
                            const c10::optional<torch::Tensor>& bias, int64_t out_features) {
  const int64_t N = out_features;
  const torch::Tensor bias32 = checked_bias32<Math>(x, packed, bias, N, "_linear_argmax");
  const int64_t M = x.size(0), K = x.size(1);
  if (M == 0) return torch::empty({0}, x.options().dtype(torch::kLong));
#ifdef PAGEDSERVE_HAVE_AVX512_GEMM
  const torch::Tensor x_packed = pack_x<Math>(x);
  const auto* xp = reinterpret_cast<const typename Math::X*>(x_packed.data_ptr());
  const float* b = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  const auto* w = values<typename Math::Panel>(packed);
  // By value (x's packed copy, weights, bias): under work_share.h the helper may run it late.
  return row_argmax::argmax_over_ranges(
      M, N / kPanel, x.options(),
      [x_packed, packed, bias32, xp, w, b, M, K, N](int64_t p0, int64_t p1, row_argmax::Best* best) {
        panels<Math>(xp, w, b, best, M, K, N, p0, p1);
      });
#else
  return torch::empty({0}, x.options().dtype(torch::kLong));
#endif
}

// Rows of W read back from pack_weight's layout (one value per 128-byte step). A tied embedding is
// looked up here, so the model need not keep its plain copy beside the packed LM head.
template <class Panel>
torch::Tensor packed_rows(const torch::Tensor& packed, const torch::Tensor& ids, int64_t in_features) {
  const int64_t K = in_features;
  TORCH_CHECK(packed.scalar_type() == Kind<Panel>::dtype && packed.is_contiguous() && K > 0 &&
                  K % Panel::kK == 0 && packed.numel() % (K * kPanel) == 0,
              Kind<Panel>::name, "_packed_rows: packed must be ", Kind<Panel>::name,
              "_pack_weight's result for a weight of ", K, " input features");
  TORCH_CHECK(ids.scalar_type() == torch::kLong && ids.dim() == 1, Kind<Panel>::name,
              "_packed_rows: ids must be 1-D int64");
  const int64_t N = packed.numel() / K, M = ids.numel();
  const torch::Tensor idc = ids.contiguous();
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t i = 0; i < M; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < N, Kind<Panel>::name, "_packed_rows: id ", id[i], " is out of range [0, ", N,
                ")");
  }
  torch::Tensor rows = torch::empty({M, K}, packed.options());
  const auto* p = values<Panel>(packed);
  auto* out = const_cast<typename Panel::T*>(values<Panel>(rows));
  at::parallel_for(0, M, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      for (int64_t k = 0; k < K; ++k) out[i * K + k] = p[packed_offset<Panel>(id[i], k, K)];
    }
  });
  return rows;
}

}  // namespace

torch::Tensor output_for(const torch::Tensor& x, int64_t n, c10::ScalarType dtype,
                         const c10::optional<torch::Tensor>& out, const char* name) {
  if (!out.has_value()) return torch::empty({x.size(0), n}, x.options().dtype(dtype));
  TORCH_CHECK(out->scalar_type() == dtype && out->dim() == 2 && out->size(0) == x.size(0) && out->size(1) == n &&
                  out->is_contiguous() && out->device() == x.device(),
              name, ": out must be a contiguous ", dtype_name(dtype), " [", x.size(0), ", ", n, "] tensor, got ",
              dtype_name(out->scalar_type()), " ", out->sizes());
  return *out;
}

bool avx512_kernels_available() { return fp32_gemm::available(); }
bool avx512_bf16_dot_native() { return fp32_gemm::native_bf16_dot(); }
bool avx2_kernels_available() { return fp32_gemm::avx2_available(); }

torch::Tensor fp32_pack_weight(torch::Tensor weight) { return pack_weight<Fp32Panel>(weight); }
// From fp32_amx_min_rows() rows on, where AMX runs, the same product on AMX's tile unit
// (amx_fp32_linear.cpp): prefill chunks, compute-bound here; fewer rows stream the weights here.
torch::Tensor fp32_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                          int64_t out_features, c10::optional<torch::Tensor> out) {
  if (x.dim() == 2 && x.size(0) >= fp32_amx_min_rows() && amx_linear_available()) {
    return fp32_amx_linear(x.contiguous(), packed, bias, out_features, out);
  }
  return fp32_fma_linear(x, packed, bias, out_features, out);
}
torch::Tensor fp32_fma_linear(const torch::Tensor& x, const torch::Tensor& packed,
                              const c10::optional<torch::Tensor>& bias, int64_t out_features,
                              const c10::optional<torch::Tensor>& out) {
  return linear<FmaMath<Fp32Panel>>(x, packed, bias, out_features, false, out);
}
torch::Tensor avx2_fp32_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                               int64_t out_features, c10::optional<torch::Tensor> out) {
  return linear<Avx2FmaMath>(x, packed, bias, out_features, false, out);
}
torch::Tensor fp32_packed_rows(torch::Tensor packed, torch::Tensor ids, int64_t in_features) {
  return packed_rows<Fp32Panel>(packed, ids, in_features);
}

torch::Tensor bf16_pack_weight(torch::Tensor weight) { return pack_weight<Bf16PairPanel>(weight); }
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                          int64_t out_features, bool fp32_out, c10::optional<torch::Tensor> out) {
  return linear<FmaMath<Bf16PairPanel>>(x, packed, bias, out_features, fp32_out, out);
}
// vdpbf16ps where the CPU has it, else its emulation (fp32_gemm::EmulatedDot: for tests).
torch::Tensor bf16_dot_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                              int64_t out_features, bool fp32_out, c10::optional<torch::Tensor> out) {
  if (fp32_gemm::native_bf16_dot()) {
    return linear<DotMath<fp32_gemm::NativeDot>>(x, packed, bias, out_features, fp32_out, out);
  }
  return linear<DotMath<fp32_gemm::EmulatedDot>>(x, packed, bias, out_features, fp32_out, out);
}
torch::Tensor bf16_packed_rows(torch::Tensor packed, torch::Tensor ids, int64_t in_features) {
  return packed_rows<Bf16PairPanel>(packed, ids, in_features);
}

torch::Tensor fp32_linear_argmax(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                                 int64_t out_features) {
  return linear_argmax<FmaMath<Fp32Panel>>(x, packed, bias, out_features);
}
torch::Tensor bf16_linear_argmax(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                                 int64_t out_features) {
  return linear_argmax<FmaMath<Bf16PairPanel>>(x, packed, bias, out_features);
}
torch::Tensor bf16_dot_linear_argmax(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                                     int64_t out_features) {
  if (fp32_gemm::native_bf16_dot()) return linear_argmax<DotMath<fp32_gemm::NativeDot>>(x, packed, bias, out_features);
  return linear_argmax<DotMath<fp32_gemm::EmulatedDot>>(x, packed, bias, out_features);
}

}  // namespace pagedserve
