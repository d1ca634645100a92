// Multi-LoRA's lora_add for bf16 on Intel AMX (lora.cpp calls it where it can: bf16 tensors, `in` a
// multiple of 32, each part's rank a multiple of 16). The vector kernel computes in fp32 FMAs, ~16
// multiply-adds an instruction; on SmolLM2 with 4 rank-16 adapters that was a fifth of a bf16 step,
// most of it in prefill, where an adapter has hundreds of rows. Here one tdpbf16ps does 8,192.
//
// Work items are (adapter slot, up to four 16-row blocks of its rows), split across threads. Per
// item and block:
// * the rows of x are transposed into tdpbf16ps's B form (one 1 KB tile per 32-wide slice of `in`:
//   tile row kp, column t holds the pair x[row t][k0 + 2kp .. k0 + 2kp + 1]), read with one gather
//   per pair of `in`;
// * shrink: A's rows are the A operand as they lie in memory (16 ranks x 32 of `in` per tile), so
//   shrunk^T [ranks, 16 rows] accumulates in fp32 with no copy of A;
// * expand, per part of a fused projection (B is block diagonal: part p reads ranks [p R, (p+1) R)):
//   shrunk rounded to bf16 is the A operand (16 rows x 32 ranks, zero past R), and each 16-output
//   tile of B is interleaved into pairs of ranks on the fly (a few shuffles per tile row);
// * y += the fp32 product, rounded to bf16 once (the reference rounds the shrink, the expand and
//   the sum; kernels/reference/lora.py is the oracle, tests/kernels/test_lora_kernels.py the test).

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "amx.h"
#include "ops.h"

namespace pagedserve {

#ifdef PAGEDSERVE_HAVE_AMX
namespace {

using amx::kTileRows;

constexpr int64_t kMaxBlocks = 4;  // row blocks per work item: tiles 0-3 accumulate one each

// Up to 4 blocks of up to 16 rows of one adapter slot: every tile of A and B loaded (and every B
// tile interleaved) serves all of them, and their accumulators are independent tdpbf16ps chains.
struct Item {
  int64_t slot;
  const int64_t* rows;  // the item's rows, `m` of them
  int64_t m;
  int64_t blocks() const { return (m + kTileRows - 1) / kTileRows; }
};

// xt: rows [16 b, 16 b + 16) of the item as tdpbf16ps B tiles, one per 32-wide slice of `in`
// (zero past the item's rows). Word w (the pair of `in` at 2w) is row w % 16 of slice w / 16's
// tile, so the tiles form one array and each gather fills one tile row.
PAGEDSERVE_AMX void transpose_rows(const uint16_t* x, int64_t n_in, const Item& item, int64_t b, uint32_t* xt) {
  const int64_t m = std::min<int64_t>(kTileRows, item.m - b * kTileRows);
  alignas(64) int32_t idx[kTileRows];
  for (int64_t t = 0; t < kTileRows; ++t) {
    idx[t] = t < m ? static_cast<int32_t>(item.rows[b * kTileRows + t] * (n_in / 2)) : 0;
  }
  const __m512i vidx = _mm512_load_si512(idx);
  const __mmask16 live = static_cast<__mmask16>(m >= kTileRows ? 0xFFFF : (1u << m) - 1);
  const int* base = reinterpret_cast<const int*>(x);
  for (int64_t w = 0; w < n_in / 2; ++w) {
    _mm512_storeu_si512(xt + w * kTileRows, _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, vidx, base + w, 4));
  }
}

// shrunk_t[b] [ranks][16] (fp32) = A_s [ranks, in] times block b's rows: A's tile for 16 ranks
// and one slice is loaded once for every block.
PAGEDSERVE_AMX void shrink(const uint16_t* a, int64_t n_in, int64_t ranks, const uint32_t* xt, int64_t nb,
                           float* shrunk_t) {
  const int64_t slices = n_in / 32, xt_size = n_in / 2 * kTileRows, st_size = ranks * kTileRows;
  for (int64_t j0 = 0; j0 < ranks; j0 += kTileRows) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t s = 0; s < slices; ++s) {
      // Tile numbers must be compile-time constants: one written-out case per block.
      _tile_loadd(4, a + j0 * n_in + s * 32, n_in * 2);
      _tile_loadd(6, xt + s * 256, 64);
      _tile_dpbf16ps(0, 4, 6);
      if (nb > 1) { _tile_loadd(7, xt + xt_size + s * 256, 64); _tile_dpbf16ps(1, 4, 7); }
      if (nb > 2) { _tile_loadd(6, xt + 2 * xt_size + s * 256, 64); _tile_dpbf16ps(2, 4, 6); }
      if (nb > 3) { _tile_loadd(7, xt + 3 * xt_size + s * 256, 64); _tile_dpbf16ps(3, 4, 7); }
    }
    _tile_stored(0, shrunk_t + j0 * kTileRows, 64);
    if (nb > 1) _tile_stored(1, shrunk_t + st_size + j0 * kTileRows, 64);
    if (nb > 2) _tile_stored(2, shrunk_t + 2 * st_size + j0 * kTileRows, 64);
    if (nb > 3) _tile_stored(3, shrunk_t + 3 * st_size + j0 * kTileRows, 64);
  }
}

PAGEDSERVE_AMX inline __m512 bf16x16_masked(const uint16_t* p, __mmask16 live) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, p)), 16));
}

// y[rows of block b] [o, o + 16) (live columns) += c (16 x 16 fp32), rounded to bf16 once.
PAGEDSERVE_AMX void add_tile(const float* c, const Item& item, int64_t b, int64_t n_out, int64_t o, __mmask16 live,
                             uint16_t* y) {
  const int64_t m = std::min<int64_t>(kTileRows, item.m - b * kTileRows);
  for (int64_t t = 0; t < m; ++t) {
    uint16_t* dst = y + item.rows[b * kTileRows + t] * n_out + o;
    const __m512 sum = _mm512_add_ps(bf16x16_masked(dst, live), _mm512_load_ps(c + t * kTileRows));
    _mm256_mask_storeu_epi16(dst, live, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(sum)));
  }
}

// y[item's rows] [o0, o1) += shrunk (ranks [k0, k0 + r)) times B's rows k0.. (fp32 accumulators).
PAGEDSERVE_AMX void expand(const float* shrunk_t, int64_t ranks, const uint16_t* bs, int64_t n_out, int64_t k0,
                           int64_t r, int64_t o0, int64_t o1, const Item& item, uint16_t* y) {
  const int64_t nb = item.blocks(), k_slices = (r + 31) / 32;
  // The A operands: block b's tile ks, row t, column c = shrunk[t][k0 + 32 ks + c] in bf16, zero past r.
  std::vector<uint16_t> s_tiles(static_cast<size_t>(nb * k_slices * amx::kTileElems), 0);
  for (int64_t b = 0; b < nb; ++b) {
    for (int64_t k = 0; k < r; ++k) {
      const __m512 v = _mm512_loadu_ps(shrunk_t + b * ranks * kTileRows + (k0 + k) * kTileRows);
      alignas(32) uint16_t col[kTileRows];
      _mm256_store_si256(reinterpret_cast<__m256i*>(col), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
      uint16_t* dst = s_tiles.data() + (b * k_slices + k / 32) * amx::kTileElems + k % 32;
      for (int64_t t = 0; t < kTileRows; ++t) dst[t * 32] = col[t];
    }
  }
  // Element 2i of a B tile row is B[k][o + i], element 2i + 1 is B[k + 1][o + i].
  alignas(64) static const uint16_t pairs[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                 8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i interleave = _mm512_load_si512(pairs);
  alignas(64) uint16_t b_tile[amx::kTileElems];
  alignas(64) float c[kTileRows * kTileRows];
  auto s_tile = [&](int64_t b, int64_t ks) { return s_tiles.data() + (b * k_slices + ks) * amx::kTileElems; };
  for (int64_t o = o0; o < o1; o += kTileRows) {
    const int64_t n = std::min<int64_t>(kTileRows, o1 - o);
    const __mmask16 live = static_cast<__mmask16>(n == kTileRows ? 0xFFFF : (1u << n) - 1);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t ks = 0; ks < k_slices; ++ks) {
      for (int64_t kp = 0; kp < kTileRows; ++kp) {
        const int64_t k = 32 * ks + 2 * kp;  // r is even: k < r means k + 1 < r too
        __m512i row = _mm512_setzero_si512();
        if (k < r) {
          const uint16_t* src = bs + (k0 + k) * n_out + o;
          const __m512i lo = _mm512_castsi256_si512(_mm256_maskz_loadu_epi16(live, src));
          const __m512i hi = _mm512_castsi256_si512(_mm256_maskz_loadu_epi16(live, src + n_out));
          row = _mm512_permutex2var_epi16(lo, interleave, hi);
        }
        _mm512_store_si512(b_tile + kp * 32, row);
      }
      _tile_loadd(6, b_tile, 64);
      _tile_loadd(4, s_tile(0, ks), 64);
      _tile_dpbf16ps(0, 4, 6);
      if (nb > 1) { _tile_loadd(5, s_tile(1, ks), 64); _tile_dpbf16ps(1, 5, 6); }
      if (nb > 2) { _tile_loadd(4, s_tile(2, ks), 64); _tile_dpbf16ps(2, 4, 6); }
      if (nb > 3) { _tile_loadd(5, s_tile(3, ks), 64); _tile_dpbf16ps(3, 5, 6); }
    }
    _tile_stored(0, c, 64);
    add_tile(c, item, 0, n_out, o, live, y);
    if (nb > 1) { _tile_stored(1, c, 64); add_tile(c, item, 1, n_out, o, live, y); }
    if (nb > 2) { _tile_stored(2, c, 64); add_tile(c, item, 2, n_out, o, live, y); }
    if (nb > 3) { _tile_stored(3, c, 64); add_tile(c, item, 3, n_out, o, live, y); }
  }
}

// Items [0, n) on the calling thread (a tile configuration is per thread).
PAGEDSERVE_AMX void run_items(uint16_t* y, const uint16_t* x, const uint16_t* a, const uint16_t* b,
                              const std::vector<int64_t>& out_slices, int64_t parts, int64_t n_in, int64_t n_out,
                              int64_t ranks, const Item* items, int64_t n) {
  amx::configure_tiles();
  const int64_t r = ranks / parts, xt_size = n_in / 2 * kTileRows;
  std::vector<uint32_t> xt(static_cast<size_t>(kMaxBlocks * xt_size));
  std::vector<float> shrunk_t(static_cast<size_t>(kMaxBlocks * ranks * kTileRows));
  for (int64_t i = 0; i < n; ++i) {
    const Item& item = items[i];
    const int64_t nb = item.blocks();
    for (int64_t blk = 0; blk < nb; ++blk) transpose_rows(x, n_in, item, blk, xt.data() + blk * xt_size);
    shrink(a + item.slot * ranks * n_in, n_in, ranks, xt.data(), nb, shrunk_t.data());
    for (int64_t p = 0; p < parts; ++p) {
      expand(shrunk_t.data(), ranks, b + item.slot * ranks * n_out, n_out, p * r, r, out_slices[p],
             out_slices[p + 1], item, y);
    }
  }
  _tile_release();
}

}  // namespace

bool lora_add_amx(torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& lora_a, const torch::Tensor& lora_b,
                  const int32_t* token_slots, const std::vector<int64_t>& out_slices) {
  const int64_t rows = x.size(0), n_in = x.size(1), n_out = y.size(1), ranks = lora_a.size(1);
  const int64_t parts = static_cast<int64_t>(out_slices.size()) - 1, r = ranks / parts;
  if (x.scalar_type() != torch::kBFloat16 || !amx_linear_available() || n_in % 32 != 0 || r % 16 != 0 ||
      rows * n_in / 2 >= (int64_t{1} << 31)) {
    return false;
  }
  const int64_t num_slots = lora_a.size(0);
  std::vector<std::vector<int64_t>> members(static_cast<size_t>(num_slots));
  for (int64_t t = 0; t < rows; ++t) {
    if (token_slots[t] >= 0) members[token_slots[t]].push_back(t);
  }
  // Items of up to 4 blocks, fewer where that would leave a thread without one (one adapter's 64
  // decode rows are 4 items on 4 threads, not 1).
  int64_t total_blocks = 0;
  for (const auto& m : members) total_blocks += (static_cast<int64_t>(m.size()) + kTileRows - 1) / kTileRows;
  const int64_t per_item = std::clamp<int64_t>(total_blocks / std::max(1, at::get_num_threads()), 1, kMaxBlocks);
  const int64_t item_rows = per_item * kTileRows;
  std::vector<Item> items;
  for (int64_t s = 0; s < num_slots; ++s) {
    const auto& m = members[s];
    for (int64_t i = 0; i < static_cast<int64_t>(m.size()); i += item_rows) {
      items.push_back({s, m.data() + i, std::min<int64_t>(item_rows, static_cast<int64_t>(m.size()) - i)});
    }
  }
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* ap = reinterpret_cast<const uint16_t*>(lora_a.data_ptr());
  const auto* bp = reinterpret_cast<const uint16_t*>(lora_b.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
    run_items(yp, xp, ap, bp, out_slices, parts, n_in, n_out, ranks, items.data() + i0, i1 - i0);
  });
  return true;
}

#else

bool lora_add_amx(torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const int32_t*,
                  const std::vector<int64_t>&) {
  return false;
}

#endif

}  // namespace pagedserve
