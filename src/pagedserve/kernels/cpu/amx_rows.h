// What the AMX linear kernels (amx_linear.cpp over bf16 weights, amx_int8_linear.cpp over int8
// codes) do with one 32-row x 32-column fp32 block of results as it leaves the tiles (row stride
// 32): store it rounded to bf16 (or widened back to fp32), fold it into each row's argmax
// (row_argmax.h), or apply a gated MLP's activation to a gate block and multiply by its up block.
// Shared so that both kernels round exactly as their unfused compositions do.
#pragma once

#include "activations.h"
#include "amx.h"
#include "row_argmax.h"
#include "vec.h"

#ifdef PAGEDSERVE_HAVE_AMX
namespace pagedserve {
namespace amx {

constexpr int64_t kBlockCols = 32;  // output columns of a block: two 16-column weight tiles

// y[r, 0 .. 32) for `rows` rows (1..32) of block c, plus the bias, rounded to bf16: stored as bf16
// (y), or widened back to fp32 (y32, when not null).
PAGEDSERVE_AMX inline void write_rows(const float* c, const uint16_t* bias, uint16_t* y, float* y32, int64_t ldy,
                                      int64_t rows) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < kBlockCols; h += 16) {
      v16sf v = loadv<v16sf>(c + r * kBlockCols + h);
      if (bias != nullptr) v += bf16x16_to_float(bias + h);
      if (y32 != nullptr) {
        storev(y32 + r * ldy + h, round_to_bf16x16(v));
      } else {
        float_to_bf16x16(v, y + r * ldy + h);
      }
    }
  }
}

// The same rows' values folded into best[0 .. rows) (row_argmax.h), columns from col0.
PAGEDSERVE_AMX inline void fold_rows(const float* c, const uint16_t* bias, row_argmax::Best* best, int64_t col0,
                                     int64_t rows) {
  for (int64_t r = 0; r < rows; ++r) {
    v16sf lo = loadv<v16sf>(c + r * kBlockCols), hi = loadv<v16sf>(c + r * kBlockCols + 16);
    if (bias != nullptr) {
      lo += bf16x16_to_float(bias);
      hi += bf16x16_to_float(bias + 16);
    }
    row_argmax::fold32(best[r], reinterpret_cast<__m512>(round_to_bf16x16(lo)),
                       reinterpret_cast<__m512>(round_to_bf16x16(hi)), col0);
  }
}

// y[r, 0 .. 32) = act(gate) * up for one block's gate and up results (cg, cu), with silu_and_mul's
// roundings: gate and up rounded to bf16 as a gate_up projection stores them (after the bias),
// act(gate) rounded, the product rounded.
template <class Act>
PAGEDSERVE_AMX inline void gated_rows(const float* cg, const float* cu, const uint16_t* bias_g, const uint16_t* bias_u,
                                      uint16_t* y, int64_t ldy, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < kBlockCols; h += 16) {
      v16sf g = loadv<v16sf>(cg + r * kBlockCols + h), u = loadv<v16sf>(cu + r * kBlockCols + h);
      if (bias_g != nullptr) {
        g += bf16x16_to_float(bias_g + h);
        u += bf16x16_to_float(bias_u + h);
      }
      g = round_to_bf16x16(g);
      u = round_to_bf16x16(u);
      float_to_bf16x16(round_to_bf16x16(Act::vec(g)) * u, y + r * ldy + h);
    }
  }
}

// c[r, j] *= scale[j] for `rows` rows of a block: an int8 layer's per-column scales.
PAGEDSERVE_AMX inline void scale_columns(float* c, const float* scale, int64_t rows) {
  const v16sf lo = loadv<v16sf>(scale), hi = loadv<v16sf>(scale + 16);
  for (int64_t r = 0; r < rows; ++r) {
    storev(c + r * kBlockCols, loadv<v16sf>(c + r * kBlockCols) * lo);
    storev(c + r * kBlockCols + 16, loadv<v16sf>(c + r * kBlockCols + 16) * hi);
  }
}

}  // namespace amx
}  // namespace pagedserve
#endif
