// Prefill rows of bf16 queries attending causally over a bf16 paged KV cache on Intel AMX
// (paged_prefill_attention_amx): the same computation as paged_prefill_attention.cpp (per block
// of query rows, S = Q K^T, a softmax per row in fp32, O = P V / row sums), with both GEMMs on
// tdpbf16ps.
//
// Why: on AMX hosts bf16 prefill went through torch's CPU flash attention, which ran a 512-token
// SmolLM2 prompt's attention at ~0.12 TFLOP/s (1.3 ms per layer, 39 ms of a 125 ms prefill), and
// slower past a cached prefix (an explicit mask). The GEMMs here are small (32 query rows by 32
// keys by head_dim) and need no packing beyond the gather below (docs/benchmarks.md).
//
// Numerics are those of torch's bf16 flash attention: scores accumulate in fp32, the softmax runs
// in fp32 over key chunks (a running maximum per row; the sums and P V so far rescaled when it
// grows), the probabilities are rounded to bf16 for the P V product (accumulated in fp32), and
// each output row is divided by its fp32 row sum and rounded once to bf16.
//
// Layout. Per sequence, the keys some row may see are gathered once (from t0, a multiple of 32)
// into the VNNI tiles tdpbf16ps takes as its B operand:
//   K, for S = Q K^T: one tile per 16 keys and 32 dims: row r holds, for key c = 0..15, the pair
//     K[c][2r], K[c][2r + 1] of its 32 dims;
//   V, for O = P V: one tile per 32 keys and 16 dims: row r holds, for dim c = 0..15, the pair
//     V[2r][c], V[2r + 1][c] of its 32 keys.
// Keys past the sequence are zero. A work item is (KV head, block of 32 rows: two 16-row halves)
// for every query head of the KV head; its query rows are copied into zero-padded 32 x head_dim
// buffers (the A operands). From the block's first visible panel to its causal limit, one key
// chunk (kChunkKeys) at a time and per query head: the chunk's scores 32 keys at a time, their
// probabilities (bf16, zero outside each row's visible keys) the A operands of P V, 32 output
// dims at a time, added to O. Both halves multiply the same K and V tiles (four accumulator
// tiles), so each tile load feeds two tdpbf16ps; the group's heads find the chunk's tiles in L2.
// Sliding windows and the Gemma 2 softcap as in paged_prefill_attention.

#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "amx.h"
#include "ops.h"
#include "prefill_args.h"
#include "vec.h"

namespace pagedserve {
namespace {

#ifdef PAGEDSERVE_HAVE_AMX
using amx::kTileElems;
using amx::kTileRows;

constexpr int64_t kKeys = 32;  // keys per score step (two 16-key tiles) and per P V slice
constexpr int64_t kBlockRows = 2 * kTileRows;  // query rows per work item (two tiles of rows)
constexpr int64_t kChunkKeys = 1024;  // keys per softmax chunk (a 32-row block's scores: 132 KB; 256 and 512 measured slower)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

using Shapes = PrefillShapes;

// r[c] (16 x 16 32-bit words) transposed in place: r[j] lane c = the old r[c] lane j.
PAGEDSERVE_AMX inline void transpose16x16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {  // within 128-bit lanes: pairs of rows
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4 i + j], lane L: rows 4 i .. 4 i + 3 of column 4 L + j
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {  // the 128-bit lanes of u[j], u[4 + j], u[8 + j], u[12 + j] transposed
    const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44), v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xee);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
    const __m512i v3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xee);
    r[j] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[4 + j] = _mm512_shuffle_i32x4(v0, v2, 0xdd);
    r[8 + j] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(v1, v3, 0xdd);
  }
}

// 16 dims from d0 of KV head h at cache slot `at` (-1: zeros), each in the low half of a 32-bit lane.
PAGEDSERVE_AMX inline __m512i widened_dims(const uint16_t* cache, int64_t at, int64_t H, int64_t h, int64_t D,
                                           int64_t d0) {
  if (at < 0) return _mm512_setzero_si512();
  return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(cache + (at * H + h) * D + d0)));
}

// Panels [p0, p1) (32 keys each, from t0) of gather_tiles. A K tile's 16 rows are 16 keys' 64-byte
// slices transposed as 32-bit pairs; a V tile's row interleaves two keys' 16 dims.
PAGEDSERVE_AMX void gather_panels(const uint16_t* key_cache, const uint16_t* value_cache, const int32_t* table,
                                  int64_t t0, int64_t n, int64_t m, const Shapes& s, uint16_t* kb, uint16_t* vb,
                                  int64_t p0, int64_t p1) {
  const int64_t D = s.dim, H = s.kv_heads, slices = D / 32, dim_tiles = D / 16;
  for (int64_t p = p0; p < p1; ++p) {
    int64_t slot[kKeys];  // each key's cache slot, -1 past the sequence
    for (int64_t i = 0; i < kKeys; ++i) {
      const int64_t t = t0 + p * kKeys + i;
      slot[i] = t < n ? static_cast<int64_t>(table[t / s.block_size]) * s.block_size + t % s.block_size : -1;
    }
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t g = 0; g < 2; ++g) {  // K: the panel's two 16-key tiles per 32-dim slice
        uint16_t* kt = kb + (h * (m / 16) + p * 2 + g) * slices * kTileElems;
        for (int64_t sl = 0; sl < slices; ++sl) {
          __m512i rows[16];
          for (int64_t c = 0; c < 16; ++c) {
            const int64_t at = slot[g * 16 + c];
            rows[c] = at < 0 ? _mm512_setzero_si512() : _mm512_loadu_si512(key_cache + (at * H + h) * D + sl * 32);
          }
          transpose16x16(rows);
          for (int64_t r = 0; r < 16; ++r) _mm512_storeu_si512(kt + sl * kTileElems + r * 32, rows[r]);
        }
      }
      uint16_t* vt = vb + (h * (m / kKeys) + p) * dim_tiles * kTileElems;
      for (int64_t dt = 0; dt < dim_tiles; ++dt) {  // V: row r holds keys 2 r (low halves) and 2 r + 1
        for (int64_t r = 0; r < 16; ++r) {
          const __m512i even = widened_dims(value_cache, slot[2 * r], H, h, D, dt * 16);
          const __m512i odd = widened_dims(value_cache, slot[2 * r + 1], H, h, D, dt * 16);
          _mm512_storeu_si512(vt + dt * kTileElems + r * 32, _mm512_or_si512(even, _mm512_slli_epi32(odd, 16)));
        }
      }
    }
  }
}

// Keys and values of tokens [t0, n_pad) of one sequence (zero from n on) into the tile layouts
// above: kb[h][key tile][dim slice], vb[h][key slice][dim tile], each tile 512 bf16.
void gather_tiles(const uint16_t* key_cache, const uint16_t* value_cache, const int32_t* table, int64_t t0,
                  int64_t n, int64_t n_pad, const Shapes& s, uint16_t* kb, uint16_t* vb) {
  const int64_t m = n_pad - t0;
  at::parallel_for(0, m / kKeys, 1, [&](int64_t p0, int64_t p1) {
    gather_panels(key_cache, value_cache, table, t0, n, m, s, kb, vb, p0, p1);
  });
}

// 2^t for t <= 0 on 16 lanes: 2^n * 2^f with n = round(t), f = t - n in [-1/2, 1/2] and 2^f from a
// degree-4 polynomial fitted for relative error (measured at most 2.7e-6 in fp32: about torch's
// exp_u20, which its CPU flash attention takes for the same softmax), n applied by vscalef (which
// gives 0 past the smallest float, so t needs no clamp). Why not exp_nonpositive16 (degree 7,
// ~1e-7): the softmax's exponentials were the kernel's largest cost (docs/benchmarks.md), and
// this takes 7 instructions per 16 scores where that took 16. The probabilities are rounded to
// bf16 (relative error 2^-9) before P V; only the fp32 row sums see the difference.
PAGEDSERVE_AMX inline __m512 exp2_nonpositive(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(9.570101276040077e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.591786280274391e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40247443318367e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931217908859253e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999992847442627e-1f));
  return _mm512_scalef_ps(p, n);
}

// One 16-row tile of a key chunk's scores (fp32, ld apart; chunk keys [0, keys)) -> bf16
// probabilities 2^{s c - max c} over each row's visible keys [lo[r], hi[r]) (0 elsewhere; rows from
// `rows` to 16 all 0), c = scale log2(e), where max is the row's running maximum over this and the
// earlier chunks (state max[r], sum[r], updated); alpha[r]: what the row's earlier probabilities
// (its sum and P V so far) are multiplied by for the new maximum, 1 for a row with no visible key
// here. Torch's CPU flash attention takes its key blocks the same way.
PAGEDSERVE_AMX void softmax_chunk(const float* scores, int64_t ld, int64_t rows, int64_t keys, const int64_t* lo,
                                  const int64_t* hi, float c, float* max, float* sum, float* alpha, uint16_t* probs,
                                  int64_t ldp) {
  const __m512 cv = _mm512_set1_ps(c);
  for (int64_t r = 0; r < kTileRows; ++r) {
    uint16_t* p = probs + r * ldp;
    const int64_t b = r < rows ? lo[r] : 0, e = r < rows ? hi[r] : 0;
    if (b >= e) {
      std::fill(p, p + keys, uint16_t{0});
      if (r < rows) alpha[r] = 1.f;
      continue;
    }
    const float* s = scores + r * ld;
    __m512 m = _mm512_set1_ps(kNegInf), m2 = m;  // two chains: the max's latency, not its loads, bound it
    int64_t j = b;
    for (; j + 32 <= e; j += 32) {
      m = _mm512_max_ps(m, _mm512_loadu_ps(s + j));
      m2 = _mm512_max_ps(m2, _mm512_loadu_ps(s + j + 16));
    }
    for (; j + 16 <= e; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + j));
    if (j < e) m = _mm512_max_ps(m, _mm512_mask_loadu_ps(m, static_cast<__mmask16>((1u << (e - j)) - 1), s + j));
    const float new_max = std::max(max[r], _mm512_reduce_max_ps(_mm512_max_ps(m, m2)));
    // The first visible chunk: no earlier sums to rescale (and -inf - max would be NaN). An
    // unchanged maximum leaves them exactly as they are (the polynomial's 2^0 is 1 - 7e-7).
    alpha[r] = max[r] == kNegInf   ? 0.f
               : new_max == max[r] ? 1.f
                                   : _mm512_cvtss_f32(exp2_nonpositive(_mm512_set1_ps((max[r] - new_max) * c)));
    max[r] = new_max;
    const __m512 shift = _mm512_set1_ps(new_max * c);
    std::fill(p, p + b, uint16_t{0});
    __m512 total = _mm512_setzero_ps();
    // Rounded to nearest even and stored straight from the register (a copy through the stack
    // stalled on store forwarding: a quarter of the kernel's time).
    for (j = b; j + 16 <= e; j += 16) {
      const __m512 ex = exp2_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(s + j), cv, shift));
      total = _mm512_add_ps(total, ex);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(ex)));
    }
    if (j < e) {
      const __mmask16 live = static_cast<__mmask16>((1u << (e - j)) - 1);
      const __m512 x = _mm512_maskz_loadu_ps(live, s + j);
      const __m512 ex = _mm512_maskz_mov_ps(live, exp2_nonpositive(_mm512_fmsub_ps(x, cv, shift)));
      total = _mm512_add_ps(total, ex);
      _mm256_mask_storeu_epi16(p + j, live, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(ex)));
    }
    std::fill(p + e, p + keys, uint16_t{0});
    sum[r] = sum[r] * alpha[r] + _mm512_reduce_add_ps(total);
  }
}

// The order work items run in: (KV head, 32-row block), blocks zigzagged (prefill_args.h).
struct Item {
  int64_t kv_head, row0;
};
inline Item item_at(int64_t i, int64_t blocks) { return {i / blocks, zigzag_block(i % blocks, blocks) * kBlockRows}; }

// Work items [i0, i1) of one sequence (item_at), query rows [q0, q0 + q_len) at positions
// [n - q_len, n), over the tiles gathered from t0; window 0: none. An item runs the block's rows
// for every query head of its KV head, key chunk by key chunk (kChunkKeys): each chunk's K and V
// tiles come from memory once for the group and its scores stay in L2, where one pass per head
// over the whole context went to memory for K, V, 32 rows of scores and their probabilities. The
// block's two 16-row halves share every K and V tile load (2 x 2 accumulator tiles).
PAGEDSERVE_AMX void attend_blocks(uint16_t* out, const uint16_t* query, const uint16_t* kb, const uint16_t* vb,
                                  int64_t q0, int64_t q_len, int64_t n, int64_t t0, int64_t n_pad, int64_t window,
                                  const Shapes& s, float scale, float softcap, int64_t i0, int64_t i1) {
  amx::configure_tiles();
  const int64_t D = s.dim, group = s.heads / s.kv_heads, ldq = s.heads * D, m = n_pad - t0;
  const int64_t slices = D / 32, dim_tiles = D / 16, first_pos = n - q_len;
  const int64_t blocks = (q_len + kBlockRows - 1) / kBlockRows;
  auto window_start = [&](int64_t p) { return window > 0 ? std::max<int64_t>(0, p - window + 1) : int64_t{0}; };
  // Rows one panel past a chunk apart (no power-of-two stride: see the fp32 kernel).
  const int64_t lds = kChunkKeys + kKeys, ldp = kChunkKeys + kKeys;
  std::vector<float> scores(static_cast<size_t>(kBlockRows * lds));
  std::vector<uint16_t> probs(static_cast<size_t>(kBlockRows * ldp));
  std::vector<uint16_t> q_rows(static_cast<size_t>(group * kBlockRows * D));
  std::vector<float> o(static_cast<size_t>(group * kBlockRows * D));
  std::vector<float> row_max(static_cast<size_t>(group * kBlockRows)), row_sum(row_max.size());
  float alpha[kBlockRows];
  // Gemma 2's softcap: the scaled scores capped, then their softmax unscaled.
  const float c = (softcap > 0.f ? 1.f : scale) * 1.4426950408889634f;  // e^{x} = 2^{x log2(e)}
  for (int64_t i = i0; i < i1; ++i) {
    const Item item = item_at(i, blocks);
    const int64_t kvh = item.kv_head, r0 = item.row0, rows = std::min(kBlockRows, q_len - r0);
    const bool two = rows > kTileRows;  // a second 16-row half
    const int64_t keys = first_pos + r0 + rows;  // the block's last row sees keys [.., keys)
    const int64_t keys_pad = (keys + kKeys - 1) / kKeys * kKeys;
    const int64_t base = window_start(first_pos + r0) / kKeys * kKeys;  // >= t0, a multiple of 32
    std::fill(q_rows.begin(), q_rows.end(), uint16_t{0});
    for (int64_t g = 0; g < group; ++g) {
      const int64_t h = kvh * group + g;
      for (int64_t r = 0; r < rows; ++r) {
        const uint16_t* q = query + (q0 + r0 + r) * ldq + h * D;
        std::copy(q, q + D, q_rows.data() + (g * kBlockRows + r) * D);
      }
    }
    std::fill(row_max.begin(), row_max.end(), kNegInf);
    std::fill(row_sum.begin(), row_sum.end(), 0.f);
    int64_t begin[kBlockRows], visible[kBlockRows];  // per row, absolute key positions
    for (int64_t r = 0; r < rows; ++r) {
      begin[r] = window_start(first_pos + r0 + r);
      visible[r] = first_pos + r0 + r + 1;
    }
    const uint16_t* kh = kb + kvh * (m / 16) * slices * kTileElems;
    for (int64_t c0 = base; c0 < keys_pad; c0 += kChunkKeys) {
      const int64_t width = std::min(kChunkKeys, keys_pad - c0);
      int64_t lo[kBlockRows], hi[kBlockRows];  // each row's visible keys in the chunk, chunk-relative
      for (int64_t r = 0; r < rows; ++r) {
        lo[r] = std::clamp<int64_t>(begin[r] - c0, 0, width);
        hi[r] = std::clamp<int64_t>(visible[r] - c0, 0, width);
      }
      const uint16_t* vh = vb + (kvh * (m / kKeys) + (c0 - t0) / kKeys) * dim_tiles * kTileElems;
      for (int64_t g = 0; g < group; ++g) {
        const uint16_t* qg = q_rows.data() + g * kBlockRows * D;
        float* og = o.data() + g * kBlockRows * D;
        // S = Q K^T, 32 keys at a time (amx.h's 2 x 2 tile product over the head's 32-dim slices:
        // the first 16 keys' tile for slice s at kt + s tiles, the next 16 keys' `slices` tiles on).
        for (int64_t k0 = c0; k0 < c0 + width; k0 += kKeys) {
          const uint16_t* kt = kh + ((k0 - t0) / 16) * slices * kTileElems;
          amx::product_2x2(qg, two ? qg + kTileRows * D : nullptr, D * 2, {kt, kTileElems, slices * kTileElems},
                           slices, scores.data() + (k0 - c0), lds, false, [](int64_t) {});
        }
        if (softcap > 0.f) {
          for (int64_t r = 0; r < rows; ++r) {
            softcap_scores(scores.data() + r * lds + lo[r], hi[r] - lo[r], scale, softcap);
          }
        }
        float* mg = row_max.data() + g * kBlockRows;
        float* sg = row_sum.data() + g * kBlockRows;
        for (int64_t half = 0; half < 2; ++half) {  // the second half's probabilities are 0 past `rows`
          const int64_t h0 = half * kTileRows;
          if (half == 1 && !two) break;
          softmax_chunk(scores.data() + h0 * lds, lds, std::min(kTileRows, rows - h0), width, lo + h0, hi + h0, c,
                        mg + h0, sg + h0, alpha + h0, probs.data() + h0 * ldp, ldp);
        }
        const bool first = c0 == base;  // O starts at 0; later chunks add to it, rescaled first
        if (!first) {
          for (int64_t r = 0; r < rows; ++r) {
            if (alpha[r] == 1.f) continue;
            for (int64_t d = 0; d < D; d += 16) storev(og + r * D + d, loadv<v16sf>(og + r * D + d) * alpha[r]);
          }
        }
        // O += P V, 32 dims at a time, over the chunk's 32-key slices (key slice p's two 16-dim
        // tiles for dims u0 .. u0 + 31 at vh + p * dim_tiles + u0 tiles, side by side).
        static_assert(kKeys == 32, "a P V slice is one tile row of 32 keys");
        for (int64_t u0 = 0; u0 < dim_tiles; u0 += 2) {
          amx::product_2x2(probs.data(), two ? probs.data() + kTileRows * ldp : nullptr, ldp * 2,
                           {vh + u0 * kTileElems, dim_tiles * kTileElems, kTileElems}, width / kKeys, og + u0 * 16, D,
                           !first, [](int64_t) {});
        }
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      const int64_t h = kvh * group + g;
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = 1.f / row_sum[g * kBlockRows + r];
        const float* og = o.data() + (g * kBlockRows + r) * D;
        uint16_t* dst = out + (q0 + r0 + r) * ldq + h * D;
        for (int64_t d = 0; d < D; d += 16) float_to_bf16x16(loadv<v16sf>(og + d) * inv, dst + d);
      }
    }
  }
  _tile_release();
}

#endif

}  // namespace

void paged_prefill_attention_amx(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                                 torch::Tensor value_cache, torch::Tensor block_table, torch::Tensor query_start_loc,
                                 torch::Tensor seq_lens, double scale, int64_t sliding_window, double softcap) {
#ifdef PAGEDSERVE_HAVE_AMX
  TORCH_CHECK(amx_linear_available(), "paged_prefill_attention_amx: this CPU (or kernel) offers no AMX bf16");
  constexpr const char* kName = "paged_prefill_attention_amx";
  const Shapes s = check_prefill_args(kName, torch::kBFloat16, out, query, key_cache, value_cache, block_table,
                                      query_start_loc, seq_lens, sliding_window, softcap);
  const int64_t B = seq_lens.numel();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const auto* kc = reinterpret_cast<const uint16_t*>(key_cache.data_ptr());
  const auto* vc = reinterpret_cast<const uint16_t*>(value_cache.data_ptr());
  const auto* q = reinterpret_cast<const uint16_t*>(query.data_ptr());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  std::vector<uint16_t> kb, vb;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q0 = starts[b], q_len = starts[b + 1] - starts[b], n = lens[b];
    if (q_len <= 1) continue;  // decode rows: paged_decode_attention's
    check_prefill_sequence(kName, b, q_len, n, s);
    const int64_t n_pad = (n + kKeys - 1) / kKeys * kKeys;
    const int64_t t0 = sliding_window > 0 ? std::max<int64_t>(0, n - q_len - sliding_window + 1) / kKeys * kKeys : 0;
    kb.resize(static_cast<size_t>(s.kv_heads * (n_pad - t0) * s.dim));
    vb.resize(kb.size());
    gather_tiles(kc, vc, block_table.data_ptr<int32_t>() + b * s.table_stride, t0, n, n_pad, s, kb.data(), vb.data());
    const int64_t blocks = (q_len + kBlockRows - 1) / kBlockRows;
    at::parallel_for(0, s.kv_heads * blocks, 1, [&](int64_t i0, int64_t i1) {
      attend_blocks(o, q, kb.data(), vb.data(), q0, q_len, n, t0, n_pad, sliding_window, s,
                    static_cast<float>(scale), static_cast<float>(softcap), i0, i1);
    });
  }
#else
  TORCH_CHECK(false, "paged_prefill_attention_amx: this build has no AMX kernels");
#endif
}

}  // namespace pagedserve
