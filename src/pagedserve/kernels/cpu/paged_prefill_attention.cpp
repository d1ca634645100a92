// Prefill rows (a sequence's chunk of more than one query row) attending causally over an fp32 or
// bf16 paged KV cache, on AVX-512 (paged_prefill_attention) or AVX2 with FMA
// (paged_prefill_attention_avx2): the GEMM-shaped half of attention, done as two GEMMs per block of
// query rows with the fp32 register blocks of fp32_gemm.h (`block`, or ymm_block on AVX2), in fp32
// math.
//
// Why: torch's CPU flash attention (SDPA) ran fp32 prefill at ~100 GFLOP/s here, a fifth of a
// 512-token prefill's time, against ~280 for the same FMAs in fp32_gemm.h's block; in bf16 on a
// CPU without bf16 dot products it is slower still (emulated), while widening bf16 to fp32 costs
// this kernel only its gather.
//
// Per sequence, its keys are gathered once from the cache into 32-key panels laid out for the
// block ([head][panel][d][32 keys], the transposed K) and its values into [head][key][d]; a
// chunk of q_len rows after a cached prefix (positions seq_len - q_len ..) is the general case, a
// whole prompt the case with no prefix. Then, for each query head and block of up to 12 rows:
// scores S = Q K^T over the keys up to the block's last row (the causal limit, in whole panels),
// an exact softmax per row in fp32 over the keys its position may see (no online rescaling: a
// block's score rows, 12 x seq_len floats, fit in L2), and O = P V, divided by the row sums.
// Work items (head, row block; the blocks zigzagged, prefill_args.h) are split across threads.
// Queries, output and caches all fp32 or all bf16 (a block's bf16 query rows are widened into a
// buffer, its output rounded once at the end), head_dim a multiple of 32; the Python side keeps
// the reference SDPA for the rest.
//
// Attention logit softcapping (Gemma 2): a block's visible scores are scaled and capped
// (tanh(s * scale / cap) * cap, vec.h's softcap_scores) before the softmax, which then runs
// unscaled. With libm's scalar tanh the cap doubled the kernel's time (a 512-token prompt at
// Gemma 2 2B's shapes: 15.9 -> 31.6 ms); vec.h's vectorised tanh lowers the cost (docs/benchmarks.md).
//
// Sliding windows (Gemma 2/3, Mistral): the row at position p sees keys (p - window, p]. Only the
// keys some row of the chunk may see are gathered (from the first row's window start, rounded down
// to a panel), a block of rows computes scores from its first row's window start (in whole panels)
// and the softmax zeroes each row's keys before its own window start. Gemma 3's 15 local layers
// ran the reference's SDPA before: 3.3x this kernel's time on 4 prompts of 300 tokens (fp32).

#include <ATen/Parallel.h>

#include <limits>
#include <type_traits>
#include <vector>

#include "fp32_gemm.h"
#include "ops.h"
#include "prefill_args.h"
#include "vec.h"
#include "vec_avx2.h"

namespace pagedserve {
namespace {

using fp32_gemm::kBlockRows;
using fp32_gemm::kPanel;

#ifdef PAGEDSERVE_HAVE_AVX512_GEMM
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

using Shapes = PrefillShapes;

// Keys and values of tokens [t0, n) of one sequence (t0 a multiple of 32), per kv head, in fp32 in
// the layouts the GEMMs read, m = n_pad - t0 tokens from t0 on: kt[h][p][d][c] = K[t0 + 32p + c][h][d]
// (zero past n), v[h][t][d] = V[t0 + t][h][d].
template <class T>
void gather_sequence(const T* key_cache, const T* value_cache, const int32_t* table, int64_t t0, int64_t n,
                     int64_t n_pad, const Shapes& s, float* kt, float* v) {
  const int64_t D = s.dim, H = s.kv_heads, m = n_pad - t0;
  at::parallel_for(0, m / kPanel, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      for (int64_t c = 0; c < kPanel; ++c) {
        const int64_t i = p * kPanel + c, t = t0 + i;
        const int64_t slot = t < n ? static_cast<int64_t>(table[t / s.block_size]) * s.block_size + t % s.block_size : -1;
        for (int64_t h = 0; h < H; ++h) {
          float* kp = kt + (h * m + p * kPanel) * D;  // panel p of head h: D rows of 32 keys
          float* vt = v + (h * m + i) * D;
          if (slot < 0) {
            for (int64_t d = 0; d < D; ++d) kp[d * kPanel + c] = 0.f;
            std::fill(vt, vt + D, 0.f);
            continue;
          }
          const T* k_src = key_cache + (slot * H + h) * D;
          const T* v_src = value_cache + (slot * H + h) * D;
          for (int64_t d = 0; d < D; ++d) kp[d * kPanel + c] = static_cast<float>(k_src[d]);
          for (int64_t d = 0; d < D; ++d) vt[d] = static_cast<float>(v_src[d]);
        }
      }
    }
  });
}

// scores[r][0 .. keys) -> e^{(s - max) * scale} over [begin[r], visible[r]), 0 elsewhere; returns the
// sums. Vectorised over 16 keys with a masked last step: max and sum lanes are reduced once per row.
PAGEDSERVE_AVX512 void softmax_rows(float* scores, int64_t ld, int64_t rows, int64_t keys, const int64_t* begin,
                                   const int64_t* visible, float scale, float* sums) {
  for (int64_t r = 0; r < rows; ++r) {
    std::fill(scores + r * ld, scores + r * ld + begin[r], 0.f);  // before the row's window
    float* s = scores + r * ld + begin[r];
    const int64_t n = visible[r] - begin[r], full = n / 16 * 16, keys_left = keys - begin[r];
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - full)) - 1);
    __m512 m = _mm512_set1_ps(kNegInf);
    for (int64_t j = 0; j < full; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + j));
    if (tail) m = _mm512_max_ps(m, _mm512_mask_loadu_ps(m, tail, s + full));
    const float row_max = _mm512_reduce_max_ps(m);
    v16sf l = {};
    for (int64_t j = 0; j < full; j += 16) {
      const v16sf e = exp_nonpositive16((loadv<v16sf>(s + j) - row_max) * scale);
      storev(s + j, e);
      l += e;
    }
    if (tail) {  // keys past the row's position: 0 (masked out before the exp)
      const __m512 x = _mm512_maskz_loadu_ps(tail, s + full);
      v16sf e = exp_nonpositive16((reinterpret_cast<const v16sf&>(x) - row_max) * scale);
      const __m512 kept = _mm512_maskz_mov_ps(tail, reinterpret_cast<const __m512&>(e));
      e = reinterpret_cast<const v16sf&>(kept);
      storev(s + full, e);
      l += e;
    }
    const int64_t written = full + (tail ? 16 : 0);
    if (written < keys_left) std::fill(s + written, s + keys_left, 0.f);
    sums[r] = hsum16(l);
  }
}

// The same on AVX2, over F8x2 (vec_avx2.h: GCC compiles v16sf's comparisons and selects to
// scalar code without AVX-512); the last partial 16 keys are masked by fill_from.
PAGEDSERVE_AVX2 void softmax_rows_ymm(float* scores, int64_t ld, int64_t rows, int64_t keys, const int64_t* begin,
                                      const int64_t* visible, float scale, float* sums) {
  using VO = Vec16<F8x2>;
  for (int64_t r = 0; r < rows; ++r) {
    std::fill(scores + r * ld, scores + r * ld + begin[r], 0.f);  // before the row's window
    float* s = scores + r * ld + begin[r];
    const int64_t n = visible[r] - begin[r], written = (n + 15) / 16 * 16, keys_left = keys - begin[r];
    F8x2 m = VO::splat(kNegInf);
    for (int64_t j = 0; j < written; j += 16) m = VO::max(m, VO::fill_from(VO::load(s + j), n - j, kNegInf));
    const float row_max = VO::hmax(m);
    F8x2 l = VO::zero();
    for (int64_t j = 0; j < written; j += 16) {  // keys past the row's position: 0
      const F8x2 e = VO::fill_from(VO::exp((VO::load(s + j) - row_max) * scale), n - j, 0.f);
      VO::store(s + j, e);
      l += e;
    }
    if (written < keys_left) std::fill(s + written, s + keys_left, 0.f);
    sums[r] = VO::hsum(l);
  }
}

// What prefill_sequence computes with: one of fp32_gemm.h's register blocks (x's rows as they
// lie) and the softmax for the same ISA.
struct Avx512Math {
  static constexpr const char* isa = "AVX-512";
  static bool available() { return fp32_gemm::available(); }
  static void rows_block(int64_t rows, const float* x, int64_t ldx, const float* panel, int64_t ldp, int64_t K,
                         float* y, int64_t ldy) {
    fp32_gemm::rows_block(rows, x, ldx, panel, ldp, K, y, ldy);
  }
  static void softmax(float* scores, int64_t ld, int64_t rows, int64_t keys, const int64_t* begin,
                      const int64_t* visible, float scale, float* sums) {
    softmax_rows(scores, ld, rows, keys, begin, visible, scale, sums);
  }
};
struct Avx2Math {
  static constexpr const char* isa = "AVX2 with FMA";
  static bool available() { return fp32_gemm::avx2_available(); }
  static void rows_block(int64_t rows, const float* x, int64_t ldx, const float* panel, int64_t ldp, int64_t K,
                         float* y, int64_t ldy) {
    fp32_gemm::ymm_rows_block<false>(rows, x, ldx, panel, ldp, K, y, ldy);
  }
  static void softmax(float* scores, int64_t ld, int64_t rows, int64_t keys, const int64_t* begin,
                      const int64_t* visible, float scale, float* sums) {
    softmax_rows_ymm(scores, ld, rows, keys, begin, visible, scale, sums);
  }
};

// One sequence's prefill rows: query rows [q0, q0 + q_len) at positions [n - q_len, n), over the
// keys gathered from t0 on (gather_sequence); window 0: none.
template <class Math, class T>
void prefill_sequence(T* out, const T* query, const float* kt, const float* v, int64_t q0, int64_t q_len,
                      int64_t n, int64_t t0, int64_t n_pad, int64_t window, const Shapes& s, float scale,
                      float softcap) {
  const int64_t D = s.dim, group = s.heads / s.kv_heads, ldq = s.heads * D, m = n_pad - t0;
  const int64_t blocks = (q_len + kBlockRows - 1) / kBlockRows, first_pos = n - q_len;
  // The first key the row at position p sees.
  auto window_start = [&](int64_t p) { return window > 0 ? std::max<int64_t>(0, p - window + 1) : int64_t{0}; };
  at::parallel_for(0, s.heads * blocks, 1, [&](int64_t i0, int64_t i1) {
    // Score rows one panel apart beyond the gathered keys: a power-of-two row stride would put the
    // 12 rows' lines in a few L1 sets.
    const int64_t lds = m + kPanel;
    std::vector<float> scores(static_cast<size_t>(kBlockRows * lds));
    // fp32 query rows and output rows of a bf16 block (fp32 blocks read and write in place).
    std::vector<float> q_rows, o_rows;
    if (!std::is_same<T, float>::value) {
      q_rows.resize(static_cast<size_t>(kBlockRows * D));
      o_rows.resize(q_rows.size());
    }
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t h = i / blocks, r0 = zigzag_block(i % blocks, blocks) * kBlockRows;
      const int64_t rows = std::min(kBlockRows, q_len - r0);
      const int64_t kvh = h / group;
      const int64_t keys = first_pos + r0 + rows;  // the block's last row sees keys [.., keys)
      const int64_t keys_pad = (keys + kPanel - 1) / kPanel * kPanel;
      // The block's scores start at the panel holding its first row's first key (>= t0).
      const int64_t base = window_start(first_pos + r0) / kPanel * kPanel;
      const T* q_src = query + (q0 + r0) * ldq + h * D;
      T* o_dst = out + (q0 + r0) * ldq + h * D;
      const float* q = reinterpret_cast<const float*>(q_src);
      float* o = reinterpret_cast<float*>(o_dst);
      int64_t ldo = ldq, ldx = ldq;
      if (!std::is_same<T, float>::value) {
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t d = 0; d < D; ++d) q_rows[r * D + d] = static_cast<float>(q_src[r * ldq + d]);
        }
        q = q_rows.data(), o = o_rows.data(), ldo = ldx = D;
      }
      const float* kh = kt + (kvh * m + base - t0) * D;
      for (int64_t p = 0; p < (keys_pad - base) / kPanel; ++p) {
        Math::rows_block(rows, q, ldx, kh + p * kPanel * D, kPanel, D, scores.data() + p * kPanel, lds);
      }
      int64_t begin[kBlockRows], visible[kBlockRows];  // per row, relative to base
      float sums[kBlockRows];
      for (int64_t r = 0; r < rows; ++r) {
        begin[r] = window_start(first_pos + r0 + r) - base;
        visible[r] = first_pos + r0 + r + 1 - base;
      }
      float softmax_scale = scale;
      if (softcap > 0.f) {  // Gemma 2: cap the scaled scores each row may see, then softmax them unscaled
        for (int64_t r = 0; r < rows; ++r) {
          float* row = scores.data() + r * lds + begin[r];
          const int64_t count = visible[r] - begin[r];
          softcap_scores(row, count, scale, softcap);
        }
        softmax_scale = 1.f;
      }
      Math::softmax(scores.data(), lds, rows, keys_pad - base, begin, visible, softmax_scale, sums);
      for (int64_t c = 0; c < D; c += kPanel) {
        Math::rows_block(rows, scores.data(), lds, v + (kvh * m + base - t0) * D + c, D, keys - base, o + c, ldo);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = 1.f / sums[r];
        for (int64_t d = 0; d < D; ++d) o[r * ldo + d] *= inv;
        if (!std::is_same<T, float>::value) {
          for (int64_t d = 0; d < D; ++d) o_dst[r * ldq + d] = static_cast<T>(o[r * ldo + d]);
        }
      }
    }
  });
}
#endif

#ifdef PAGEDSERVE_HAVE_AVX512_GEMM
// Every sequence with more than one query row, one after the other (threads split each one's work).
template <class Math, class T>
void prefill_all(const char* name, torch::Tensor& out, const torch::Tensor& query, const torch::Tensor& key_cache,
                 const torch::Tensor& value_cache, const torch::Tensor& block_table, const int32_t* starts,
                 const int32_t* lens, int64_t B, const Shapes& s, int64_t window, float scale, float softcap) {
  std::vector<float> kt, v;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t q0 = starts[b], q_len = starts[b + 1] - starts[b], n = lens[b];
    if (q_len <= 1) continue;  // decode rows: paged_decode_attention's
    check_prefill_sequence(name, b, q_len, n, s);
    const int64_t n_pad = (n + kPanel - 1) / kPanel * kPanel;
    // The first key any row may see, rounded down to a panel: with a window, a long sequence's
    // older keys are not gathered at all.
    const int64_t t0 = window > 0 ? std::max<int64_t>(0, n - q_len - window + 1) / kPanel * kPanel : 0;
    kt.resize(static_cast<size_t>(s.kv_heads * (n_pad - t0) * s.dim));
    v.resize(kt.size());
    gather_sequence(key_cache.data_ptr<T>(), value_cache.data_ptr<T>(),
                    block_table.data_ptr<int32_t>() + b * s.table_stride, t0, n, n_pad, s, kt.data(), v.data());
    prefill_sequence<Math>(out.data_ptr<T>(), query.data_ptr<T>(), kt.data(), v.data(), q0, q_len, n, t0, n_pad,
                           window, s, scale, softcap);
  }
}

// The checks, then prefill_all in the dtype given.
template <class Math>
void prefill_attention(const char* name, torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                       torch::Tensor value_cache, torch::Tensor block_table, torch::Tensor query_start_loc,
                       torch::Tensor seq_lens, double scale, int64_t sliding_window, double softcap) {
  TORCH_CHECK(Math::available(), name, ": this CPU offers no ", Math::isa);
  const c10::ScalarType dtype = query.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat || dtype == torch::kBFloat16, name, ": query must be float32 or bfloat16, got ",
              dtype_name(dtype));
  const Shapes s = check_prefill_args(name, dtype, out, query, key_cache, value_cache, block_table, query_start_loc,
                                      seq_lens, sliding_window, softcap);
  const int64_t B = seq_lens.numel();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  if (dtype == torch::kFloat) {
    prefill_all<Math, float>(name, out, query, key_cache, value_cache, block_table, starts, lens, B, s, sliding_window,
                             static_cast<float>(scale), static_cast<float>(softcap));
  } else {
    prefill_all<Math, c10::BFloat16>(name, out, query, key_cache, value_cache, block_table, starts, lens, B, s,
                                     sliding_window, static_cast<float>(scale), static_cast<float>(softcap));
  }
}
#endif

}  // namespace

void paged_prefill_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                             torch::Tensor value_cache, torch::Tensor block_table, torch::Tensor query_start_loc,
                             torch::Tensor seq_lens, double scale, int64_t sliding_window, double softcap) {
#ifdef PAGEDSERVE_HAVE_AVX512_GEMM
  prefill_attention<Avx512Math>("paged_prefill_attention", out, query, key_cache, value_cache, block_table,
                                query_start_loc, seq_lens, scale, sliding_window, softcap);
#else
  TORCH_CHECK(false, "paged_prefill_attention: this build has no x86-64 vector kernels");
#endif
}

void paged_prefill_attention_avx2(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                                  torch::Tensor value_cache, torch::Tensor block_table,
                                  torch::Tensor query_start_loc, torch::Tensor seq_lens, double scale,
                                  int64_t sliding_window, double softcap) {
#ifdef PAGEDSERVE_HAVE_AVX512_GEMM
  prefill_attention<Avx2Math>("paged_prefill_attention_avx2", out, query, key_cache, value_cache, block_table,
                              query_start_loc, seq_lens, scale, sliding_window, softcap);
#else
  TORCH_CHECK(false, "paged_prefill_attention_avx2: this build has no x86-64 vector kernels");
#endif
}

}  // namespace pagedserve
