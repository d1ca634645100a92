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
// Compute as in amx_linear.cpp (tiles 0-3 a 32 x 32 fp32 block of y, 4-5 x's rows, 6-7 the
// panel's tiles); the sums times the column's scale, plus the bias, rounded once to bf16.

#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#include "amx.h"
#include "ops.h"
#include "vec.h"

namespace pagedserve {
namespace {

#ifdef PAGEDSERVE_HAVE_AMX
using amx::kTileElems;
using amx::kTileRows;
constexpr int64_t kSlice = 32;  // k per tile row pair set (a tile row holds 16 pairs)
constexpr int64_t kPanel = 32;  // output columns per panel: two 16-column tiles

// Panel p's codes (K rows of 32 bytes) -> [slice][half][16 rows][16 columns][2] bf16 tiles.
PAGEDSERVE_AMX void widen_panel(const int8_t* panel, int64_t K, uint16_t* tiles) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int64_t k = 0; k < K; k += 2) {
    const int8_t* line = panel + k * kPanel;  // k's 32 codes, then k + 1's
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

// y[r, n0 .. n0 + 32) for `rows` rows from the fp32 block c (row stride 32): c * scale + bias, in bf16.
PAGEDSERVE_AMX void write_scaled_rows(const float* c, const float* scale, const uint16_t* bias, uint16_t* y,
                                      int64_t ldy, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < kPanel; h += 16) {
      v16sf v = loadv<v16sf>(c + r * kPanel + h) * loadv<v16sf>(scale + h);
      if (bias != nullptr) v += bf16x16_to_float(bias + h);
      float_to_bf16x16(v, y + r * ldy + h);
    }
  }
}

// Panels [p0, p1) of y for x [M, K].
PAGEDSERVE_AMX void amx_int8_panels(const amx::PaddedRows& x, const int8_t* q, const float* scales,
                                    const uint16_t* bias, uint16_t* y, int64_t M, int64_t K, int64_t N, int64_t p0,
                                    int64_t p1) {
  amx::configure_tiles();
  const int64_t slices = K / kSlice;
  // One panel's widened tiles (K x 32 bf16: 36 KB at K = 576), aligned for the 64-byte stores.
  std::vector<uint16_t> storage(static_cast<size_t>(slices * 2 * kTileElems + 32));
  uint16_t* tiles = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t{63});
  alignas(64) float c[2 * kTileRows * kPanel];
  const int64_t x_stride = K * 2;
  for (int64_t p = p0; p < p1; ++p) {
    widen_panel(q + p * K * kPanel, K, tiles);
    for (int64_t r0 = 0; r0 < M; r0 += 2 * kTileRows) {
      const bool two = r0 + kTileRows < M;
      amx::block_32x32(x.at(r0), two ? x.at(r0 + kTileRows) : nullptr, x_stride, tiles, slices, 0, c);
      const int64_t rows = std::min<int64_t>(2 * kTileRows, M - r0);
      write_scaled_rows(c, scales + p * kPanel, bias == nullptr ? nullptr : bias + p * kPanel,
                        y + r0 * N + p * kPanel, N, rows);
    }
  }
  _tile_release();
}
#endif

}  // namespace

torch::Tensor int8_amx_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                              c10::optional<torch::Tensor> bias, int64_t out_features, int64_t group_size) {
  TORCH_CHECK(amx_linear_available(), "int8_amx_linear: this CPU (or kernel) offers no AMX bf16");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "int8_amx_linear: x must be a contiguous 2-D bfloat16 tensor, got ", dtype_name(x.scalar_type()), " ",
              x.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(N % 32 == 0 && K % 32 == 0, "int8_amx_linear: out_features and in_features must be multiples of 32, got ",
              N, " x ", K);
  TORCH_CHECK(group_size >= K, "int8_amx_linear: takes one scale per output column (group_size >= in_features), got "
              "group_size ", group_size, " for in_features ", K, "; int8_dot_linear takes grouped scales");
  TORCH_CHECK(packed.scalar_type() == torch::kChar && packed.is_contiguous() && packed.numel() == N * K,
              "int8_amx_linear: packed must be int8_pack_weight's result for a [", N, ", ", K, "] weight");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() && scales.numel() == N,
              "int8_amx_linear: scales must be contiguous float32 [1, out_features]");
  const uint16_t* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kBFloat16 && bias->is_contiguous() && bias->numel() == N,
                "int8_amx_linear: bias must be contiguous bfloat16 [out_features]");
    b = reinterpret_cast<const uint16_t*>(bias->data_ptr());
  }
  torch::Tensor y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
#ifdef PAGEDSERVE_HAVE_AMX
  const amx::PaddedRows rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), M, K);
  const int8_t* q = packed.data_ptr<int8_t>();
  const float* sc = scales.data_ptr<float>();
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  at::parallel_for(0, N / kPanel, 1, [&](int64_t p0, int64_t p1) {
    amx_int8_panels(rows, q, sc, b, yp, M, K, N, p0, p1);
  });
#endif
  return y;
}

}  // namespace pagedserve
