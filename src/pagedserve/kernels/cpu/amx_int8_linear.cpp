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
// Pipelined: while the tiles compute on panel p, panel p + 1 is widened into a second buffer, a
// slice after each slice's tile products are issued (the tile unit and the vector units work side
// by side), and panel p + 2's codes are prefetched into L2 meanwhile (without the prefetch a third
// of the kernel's time sat on the codes' loads, W64 on a 2-core AMX Xeon).
//
// Compute as in amx_linear.cpp (tiles 0-3 a 32 x 32 fp32 block of y, 4-5 x's rows, 6-7 the
// panel's tiles); the sums times the column's scale, then what amx_linear does with its block
// (amx_rows.h): plus the bias, rounded once to bf16 and stored; or folded into each row's argmax
// (int8_amx_linear_argmax: the LM head under greedy decoding); or, for a gate_up projection, the
// gate and up panels side by side and act(gate) * up stored (int8_amx_gated_linear).

#include <ATen/Parallel.h>

#include <cstring>

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

// One slice of a panel (32 k: 16 lines of two k's 32 codes) -> its two bf16 tiles ([half][16
// rows][16 columns][2]); the codes `ahead` bytes on are prefetched into L2 line by line.
PAGEDSERVE_AMX void widen_slice(const int8_t* codes, uint16_t* tiles, int64_t ahead) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t r = 0; r < kTileRows; ++r) {
    const int8_t* line = codes + r * 2 * kPanel;  // k = 2r's 32 codes, then 2r + 1's
    _mm_prefetch(reinterpret_cast<const char*>(line + ahead), _MM_HINT_T1);
    for (int64_t h = 0; h < 2; ++h) {
      const __m512i a = _mm512_castps_si512(_mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(line + 16 * h)))));
      const __m512i b = _mm512_castps_si512(_mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(line + kPanel + 16 * h)))));
      // (a >> 16) | (b & high): 0xF8 is A | (B & C) with A = a >> 16, B = b, C = high.
      const __m512i pair = _mm512_ternarylogic_epi32(_mm512_srli_epi32(a, 16), b, high, 0xF8);
      _mm512_store_si512(tiles + (h * kTileRows + r) * 32, pair);
    }
  }
}

constexpr int64_t kSliceCodes = kSlice * kPanel;  // bytes of codes per slice
constexpr int64_t kSliceTiles = 2 * amx::kTileElems;  // bf16 values of its two tiles

// A whole panel (K / 32 slices), the next panel's codes (K * 32 bytes on) prefetched.
PAGEDSERVE_AMX void widen_panel(const int8_t* panel, int64_t K, uint16_t* tiles) {
  for (int64_t s = 0; s < K / kSlice; ++s) widen_slice(panel + s * kSliceCodes, tiles + s * kSliceTiles, K * kPanel);
}

// This thread's buffer for `panels` widened panels of K (K x 32 bf16 each: 36 KB at K = 576).
uint16_t* widened_buffer(int64_t K, int64_t panels) { return amx::thread_buffer(panels * K * kPanel); }

// A panel's codes and the two buffers its widened tiles alternate between: the tiles of panel p
// are computed on while panel p + 1's are widened into the other buffer, slice by slice, in the
// first row block's loop (the tile unit runs tdpbf16ps while the vector units widen, where the
// two phases one after the other left each idle half the time).
struct PanelPipe {
  const int8_t* q;    // panel 0's codes
  int64_t K;
  uint16_t* buf[2];

  const int8_t* codes(int64_t p) const { return q + p * K * kPanel; }
  uint16_t* tiles(int64_t i) const { return buf[i % 2]; }
};

// The 32-row block of x from row r0 times the widened panel `tiles`, into c (32 x 32 fp32), times
// the panel's column scales; when next is not null, the panel at next is widened into next_tiles
// meanwhile. Returns the block's row count.
PAGEDSERVE_AMX int64_t scaled_block(const amx::PaddedRows& x, int64_t M, int64_t K, int64_t r0, const uint16_t* tiles,
                                    const float* scale, const int8_t* next, uint16_t* next_tiles, float* c) {
  const bool two = r0 + kTileRows < M;
  const uint16_t* a1 = two ? x.at(r0 + kTileRows) : nullptr;
  if (next != nullptr) {
    const int64_t ahead = K * kPanel;
    amx::block_32x32(x.at(r0), a1, K * 2, tiles, K / kSlice, c, [next, next_tiles, ahead](int64_t s) {
      widen_slice(next + s * kSliceCodes, next_tiles + s * kSliceTiles, ahead);
    });
  } else {
    amx::block_32x32(x.at(r0), a1, K * 2, tiles, K / kSlice, 0, c);
  }
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
  uint16_t* buffer = widened_buffer(K, 2);
  const PanelPipe pipe{q, K, {buffer, buffer + K * kPanel}};
  alignas(64) float c[2 * kTileRows * kPanel];
  widen_panel(pipe.codes(p0), K, pipe.tiles(0));
  for (int64_t p = p0; p < p1; ++p) {
    const uint16_t* tiles = pipe.tiles(p - p0);
    const uint16_t* bp = bias == nullptr ? nullptr : bias + p * kPanel;
    for (int64_t r0 = 0; r0 < M; r0 += 2 * kTileRows) {
      const int8_t* next = r0 == 0 && p + 1 < p1 ? pipe.codes(p + 1) : nullptr;
      const int64_t rows = scaled_block(x, M, K, r0, tiles, scales + p * kPanel, next, pipe.tiles(p - p0 + 1), c);
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
// up panel p + n / 32, each pipelined as amx_int8_panels does.
template <class Act>
PAGEDSERVE_AMX void amx_int8_gated_panels(const amx::PaddedRows& x, const int8_t* q, const float* scales,
                                          const uint16_t* bias, uint16_t* y, int64_t M, int64_t K, int64_t n,
                                          int64_t p0, int64_t p1) {
  amx::configure_tiles();
  uint16_t* buffer = widened_buffer(K, 4);
  const int64_t panel = K * kPanel, up_panels = n / kPanel;
  const PanelPipe gate{q, K, {buffer, buffer + panel}};
  const PanelPipe up{q + up_panels * panel, K, {buffer + 2 * panel, buffer + 3 * panel}};
  alignas(64) float cg[2 * kTileRows * kPanel];
  alignas(64) float cu[2 * kTileRows * kPanel];
  widen_panel(gate.codes(p0), K, gate.tiles(0));
  widen_panel(up.codes(p0), K, up.tiles(0));
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t i = p - p0;
    const uint16_t* bg = bias == nullptr ? nullptr : bias + p * kPanel;
    for (int64_t r0 = 0; r0 < M; r0 += 2 * kTileRows) {
      const bool widen = r0 == 0 && p + 1 < p1;
      const int64_t rows = scaled_block(x, M, K, r0, gate.tiles(i), scales + p * kPanel,
                                        widen ? gate.codes(p + 1) : nullptr, gate.tiles(i + 1), cg);
      scaled_block(x, M, K, r0, up.tiles(i), scales + n + p * kPanel, widen ? up.codes(p + 1) : nullptr,
                   up.tiles(i + 1), cu);
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
