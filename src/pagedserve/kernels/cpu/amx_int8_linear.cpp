// Weight-only int8 linear layers on Intel AMX: y = x @ (q * scale)^T (+ bias) for bf16 x, int8
// codes q with one fp32 scale per output column (`quantization: int8` made at load), the weights
// kept in int8_pack_weight's panel layout (int8_linear.cpp: a panel of 32 output columns is K rows
// of 32 bytes).
//
// Why: int8_dot_linear (vdpbf16ps on widened codes) beats the bf16 layers where a layer is bound
// by reading its weights (one to a few rows), but at prefill and batched-decode sizes the bf16
// layers run on AMX (amx_linear.cpp) and the vector kernel fell 4x behind: W64 on a 2-core AMX
// Xeon took 47.8 s in int8 against 11.9 s in bf16. Here each panel's codes are widened once per
// call into the VNNI tiles tdpbf16ps takes (exact: every int8 is a bf16), into a buffer that stays
// in L2 while the row blocks pass over it, and the column scales multiply the fp32 sums.
//
// Widening. A k pair of a panel is one 64-byte line (k's 32 codes, then k + 1's); tile row r of
// slice s, half h holds, for columns c = 0..15, the bf16 pair (q[16h + c][2r], q[16h + c][2r + 1]).
// The codes go to fp32 (exact, low 16 bits zero), so a pair is (k's bits >> 16) | (k + 1's bits
// with the low half cleared): six instructions per 32 weights.
//
// While a panel is widened, the next panel's codes (the next K * 32 bytes) are prefetched into L2,
// so that they arrive while the tiles compute and the next widening does not wait on memory
// (without it a third of the kernel's time sat on the codes' loads, W64 on a 2-core AMX Xeon).
//
// Compute as in amx_linear.cpp (tiles 0-3 a 32 x 32 fp32 block of y, 4-5 x's rows, 6-7 the
// panel's tiles); the sums times the column's scale, then what amx_linear does with its block
// (amx_rows.h): plus the bias, rounded once to bf16 and stored; or folded into each row's argmax
// (int8_amx_linear_argmax: the LM head under greedy decoding); or, for a gate_up projection, the
// gate and up panels side by side and act(gate) * up stored (int8_amx_gated_linear).

#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#include "activations.h"
#include "amx.h"
#include "amx_rows.h"
#include "ops.h"
#include "row_argmax.h"
#include "vec.h"

namespace pagedserve {
namespace {

constexpr int64_t kPanel = 32;  // output columns per panel: two 16-column tiles

#ifdef PAGEDSERVE_HAVE_AMX
using amx::kTileRows;
constexpr int64_t kSlice = 32;  // k per tile row pair set (a tile row holds 16 pairs)

// Panel p's codes (K rows of 32 bytes) -> [slice][half][16 rows][16 columns][2] bf16 tiles; the
// next panel's codes (K * 32 bytes on) are prefetched into L2 line by line.
PAGEDSERVE_AMX void widen_panel(const int8_t* panel, int64_t K, uint16_t* tiles) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  const int64_t next = K * kPanel;
  for (int64_t k = 0; k < K; k += 2) {
    const int8_t* line = panel + k * kPanel;  // k's 32 codes, then k + 1's
    _mm_prefetch(reinterpret_cast<const char*>(line + next), _MM_HINT_T1);
    const int64_t s = k / kSlice, r = (k % kSlice) / 2;
    for (int64_t h = 0; h < 2; ++h) {
      const __m512i a = _mm512_castps_si512(_mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(line + 16 * h)))));
      const __m512i b = _mm512_castps_si512(_mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(line + kPanel + 16 * h)))));
      // (a >> 16) | (b & high): 0xF8 is A | (B & C) with A = a >> 16, B = b, C = high.
      const __m512i pair = _mm512_ternarylogic_epi32(_mm512_srli_epi32(a, 16), b, high, 0xF8);
      _mm512_store_si512(tiles + ((s * 2 + h) * kTileRows + r) * 32, pair);
    }
  }
}

// A thread's buffer for `panels` widened panels of K (K x 32 bf16 each: 36 KB at K = 576), aligned
// for the 64-byte stores; kept across calls.
uint16_t* widened_buffer(int64_t K, int64_t panels) {
  thread_local std::vector<uint16_t> storage;
  const size_t need = static_cast<size_t>(panels * K * kPanel + 32);
  if (storage.size() < need) storage.resize(need);
  return reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63});
}

// The 32-row block of x from row r0 times a widened panel, into c (32 x 32 fp32), times the
// panel's column scales; the block's row count.
PAGEDSERVE_AMX int64_t scaled_block(const amx::PaddedRows& x, int64_t M, int64_t K, int64_t r0, const uint16_t* tiles,
                                    const float* scale, float* c) {
  const bool two = r0 + kTileRows < M;
  amx::block_32x32(x.at(r0), two ? x.at(r0 + kTileRows) : nullptr, K * 2, tiles, K / kSlice, 0, c);
  const int64_t rows = std::min<int64_t>(2 * kTileRows, M - r0);
  amx::scale_columns(c, scale, rows);
  return rows;
}

// Panels [p0, p1) of y = x @ (q * scales)^T for x [M, K], into y (bf16 [M, N]); when best is not
// null, folded into best[0 .. M) instead (row_argmax.h).
PAGEDSERVE_AMX void amx_int8_panels(const amx::PaddedRows& x, const int8_t* q, const float* scales,
                                    const uint16_t* bias, uint16_t* y, row_argmax::Best* best, int64_t M, int64_t K,
                                    int64_t N, int64_t p0, int64_t p1) {
  amx::configure_tiles();
  uint16_t* tiles = widened_buffer(K, 1);
  alignas(64) float c[2 * kTileRows * kPanel];
  for (int64_t p = p0; p < p1; ++p) {
    widen_panel(q + p * K * kPanel, K, tiles);
    const uint16_t* bp = bias == nullptr ? nullptr : bias + p * kPanel;
    for (int64_t r0 = 0; r0 < M; r0 += 2 * kTileRows) {
      const int64_t rows = scaled_block(x, M, K, r0, tiles, scales + p * kPanel, c);
      if (best != nullptr) {
        amx::fold_rows(c, bp, best + r0, p * kPanel, rows);
      } else {
        amx::write_rows(c, bp, y + r0 * N + p * kPanel, nullptr, N, rows);
      }
    }
  }
  _tile_release();
}

// Gate panels [p0, p1) of int8_amx_gated_linear (n = N / 2 outputs): gate panel p and the matching
// up panel p + n / 32, widened side by side.
template <class Act>
PAGEDSERVE_AMX void amx_int8_gated_panels(const amx::PaddedRows& x, const int8_t* q, const float* scales,
                                          const uint16_t* bias, uint16_t* y, int64_t M, int64_t K, int64_t n,
                                          int64_t p0, int64_t p1) {
  amx::configure_tiles();
  uint16_t* gate = widened_buffer(K, 2);
  uint16_t* up = gate + K * kPanel;
  alignas(64) float cg[2 * kTileRows * kPanel];
  alignas(64) float cu[2 * kTileRows * kPanel];
  const int64_t up_panels = n / kPanel;
  for (int64_t p = p0; p < p1; ++p) {
    widen_panel(q + p * K * kPanel, K, gate);
    widen_panel(q + (p + up_panels) * K * kPanel, K, up);
    const uint16_t* bg = bias == nullptr ? nullptr : bias + p * kPanel;
    for (int64_t r0 = 0; r0 < M; r0 += 2 * kTileRows) {
      const int64_t rows = scaled_block(x, M, K, r0, gate, scales + p * kPanel, cg);
      scaled_block(x, M, K, r0, up, scales + n + p * kPanel, cu);
      amx::gated_rows<Act>(cg, cu, bg, bias == nullptr ? nullptr : bg + n, y + r0 * n + p * kPanel, n, rows);
    }
  }
  _tile_release();
}
#endif

// The checks every entry point makes; the bias as a pointer (null: none).
const uint16_t* checked_bias(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                             const c10::optional<torch::Tensor>& bias, int64_t N, const char* name) {
  TORCH_CHECK(amx_linear_available(), name, ": this CPU (or kernel) offers no AMX bf16");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.is_contiguous(), name,
              ": x must be a contiguous 2-D bfloat16 tensor, got ", dtype_name(x.scalar_type()), " ", x.sizes());
  const int64_t K = x.size(1);
  TORCH_CHECK(N % 32 == 0 && K % 32 == 0, name, ": out_features and in_features must be multiples of 32, got ", N,
              " x ", K);
  TORCH_CHECK(packed.scalar_type() == torch::kChar && packed.is_contiguous() && packed.numel() == N * K, name,
              ": packed must be int8_pack_weight's result for a [", N, ", ", K, "] weight");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() && scales.numel() == N, name,
              ": scales must be contiguous float32 [1, out_features] (one scale per output column; int8_dot_linear "
              "takes grouped scales)");
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == torch::kBFloat16 && bias->is_contiguous() && bias->numel() == N, name,
              ": bias must be contiguous bfloat16 [out_features]");
  return reinterpret_cast<const uint16_t*>(bias->data_ptr());
}

}  // namespace

torch::Tensor int8_amx_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                              c10::optional<torch::Tensor> bias, int64_t out_features, int64_t group_size) {
  const int64_t N = out_features;
  TORCH_CHECK(x.dim() != 2 || group_size >= x.size(1), "int8_amx_linear: takes one scale per output column "
              "(group_size >= in_features), got group_size ", group_size, " for in_features ", x.size(1),
              "; int8_dot_linear takes grouped scales");
  const uint16_t* b = checked_bias(x, packed, scales, bias, N, "int8_amx_linear");
  const int64_t M = x.size(0), K = x.size(1);
  torch::Tensor y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
#ifdef PAGEDSERVE_HAVE_AMX
  const amx::PaddedRows rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), M, K);
  const int8_t* q = packed.data_ptr<int8_t>();
  const float* sc = scales.data_ptr<float>();
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  at::parallel_for(0, N / kPanel, 1, [&](int64_t p0, int64_t p1) {
    amx_int8_panels(rows, q, sc, b, yp, nullptr, M, K, N, p0, p1);
  });
#endif
  return y;
}

torch::Tensor int8_amx_linear_argmax(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                                     c10::optional<torch::Tensor> bias, int64_t out_features) {
  const int64_t N = out_features;
  const uint16_t* b = checked_bias(x, packed, scales, bias, N, "int8_amx_linear_argmax");
  const int64_t M = x.size(0), K = x.size(1);
  if (M == 0) return torch::empty({0}, x.options().dtype(torch::kLong));
#ifdef PAGEDSERVE_HAVE_AMX
  const amx::PaddedRows rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), M, K);
  const int8_t* q = packed.data_ptr<int8_t>();
  const float* sc = scales.data_ptr<float>();
  // By value, x and the weights with it: under work_share.h the helper may run the fold late.
  return row_argmax::argmax_over_ranges(
      M, N / kPanel, x.options(),
      [rows, x, packed, scales, bias, q, sc, b, M, K, N](int64_t p0, int64_t p1, row_argmax::Best* best) {
        amx_int8_panels(rows, q, sc, b, nullptr, best, M, K, N, p0, p1);
      });
#else
  return torch::empty({0}, x.options().dtype(torch::kLong));
#endif
}

torch::Tensor int8_amx_gated_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                                    c10::optional<torch::Tensor> bias, int64_t out_features, std::string activation) {
  const int64_t N = out_features, n = N / 2;
  const uint16_t* b = checked_bias(x, packed, scales, bias, N, "int8_amx_gated_linear");
  TORCH_CHECK(n % kPanel == 0, "int8_amx_gated_linear: out_features (gate and up) must be a multiple of ",
              2 * kPanel, ", got ", N);
  const bool silu = activation == "silu";
  TORCH_CHECK(silu || activation == "gelu_tanh",
              "int8_amx_gated_linear: activation must be 'silu' or 'gelu_tanh', got '", activation, "'");
  const int64_t M = x.size(0), K = x.size(1);
  torch::Tensor y = torch::empty({M, n}, x.options());
  if (M == 0) return y;
#ifdef PAGEDSERVE_HAVE_AMX
  const amx::PaddedRows rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), M, K);
  const int8_t* q = packed.data_ptr<int8_t>();
  const float* sc = scales.data_ptr<float>();
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  at::parallel_for(0, n / kPanel, 1, [&](int64_t p0, int64_t p1) {
    if (silu) {
      amx_int8_gated_panels<Silu>(rows, q, sc, b, yp, M, K, n, p0, p1);
    } else {
      amx_int8_gated_panels<GeluTanh>(rows, q, sc, b, yp, M, K, n, p0, p1);
    }
  });
#endif
  return y;
}

}  // namespace pagedserve
