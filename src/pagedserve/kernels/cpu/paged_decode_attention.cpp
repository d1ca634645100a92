// Paged decode attention on CPU: one query row per sequence, read through the block table in the
// cache's stored format (fp32, bf16, int8 or fp8 codes with per-slot bf16 or static fp32 scales),
// arithmetic in fp32, queries and outputs in fp32 or bf16.
//
// Decode attention is bound by memory traffic: every step reads each sequence's whole K and V.
// A cache block holds block_size slots of num_kv_heads * head_dim values, contiguous, so a work
// item takes a whole sequence (all its KV heads). The softmax is online (flash-decoding): per
// chunk of 32 positions (across blocks), scores -> running max and sum -> rescaled accumulators,
// so K and V are read once and the scores never leave L1. The query heads that share a KV head
// (GQA) are served by one pass over its rows, and while a chunk is worked on the next chunk's
// rows, elsewhere in the pool, are prefetched a few lines per position. Measured on a 2-core AMX
// Xeon, SmolLM2's 30 layers at 56 sequences of ~420 bf16 tokens: 49.0 ms per decode step with
// one head per pass, 16-position steps and a burst prefetch per block; 35.2 ms now.
// On a 2-core AVX-512 Xeon without AMX, the same step took 39.2 ms until Vec16's splat, tail
// fill and horizontal max / sum compiled to vector code (vec_avx2.h, vec.h); 31.7 ms since.
//
// Attention logit softcapping (Gemma 2): each chunk's scaled scores are capped (vec.h's
// softcap_scores) before they enter the online softmax, so the running max is the capped one.
//
// Work items are (sequence, position range): with fewer sequences than threads x 4, long contexts
// are split and the parts merged by log-sum-exp, so batch-1 decode uses every core. Items are
// dealt to threads in contiguous runs of about equal cost (positions read).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "vec.h"
#include "vec_avx2.h"
#include "work_share.h"

namespace pagedserve {
namespace {

enum CacheKind : int64_t { kFloat32 = 0, kBFloat16 = 1, kInt8 = 2, kFp8 = 3 };

struct Geometry {
  int64_t block_size;
  int64_t num_kv_heads;
  int64_t group;  // query heads per KV head
  int64_t head_dim;
  int64_t row;    // values per cache slot: num_kv_heads * head_dim
  float softcap;  // > 0: scaled scores become tanh(s / softcap) * softcap (Gemma 2); 0: none
};

// One cache (K or V), with how to widen its values to fp32.
struct Source {
  const void* data;
  const uint16_t* scales;  // per-slot bf16 scales [slot][num_kv_heads], or null
  float static_scale;      // the scale when `scales` is null (1 for float caches)
  const float* lut;        // fp8 code -> value, 256 entries (kFp8 only)
};

// Running softmax state of one work item: per query head the max, the sum of e^(s - max), and
// the unnormalised output (head_dim values).
struct Partial {
  float* m;
  float* l;
  float* acc;
};

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// fp32 values of `n` consecutive slots from `slot` (all KV heads; n * g.row values): a pointer into
// the cache for fp32, else `tmp` filled with code * scale, as the reference's dequantize_kv does.
template <int64_t Kind>
PAGEDSERVE_INLINE const float* widen_slots(const Source& s, int64_t slot, int64_t n, const Geometry& g, float* tmp) {
  const int64_t off = slot * g.row;
  if constexpr (Kind == kFloat32) {
    return static_cast<const float*>(s.data) + off;
  } else if constexpr (Kind == kBFloat16) {
    const uint16_t* p = static_cast<const uint16_t*>(s.data) + off;
    for (int64_t i = 0; i < n * g.row; ++i) tmp[i] = bf16_to_float(p[i]);
    return tmp;
  } else {
    const int64_t D = g.head_dim;
    for (int64_t r = 0; r < n * g.num_kv_heads; ++r) {  // r: (slot, head) pairs, D values each
      const float scale = s.scales != nullptr ? bf16_to_float(s.scales[slot * g.num_kv_heads + r]) : s.static_scale;
      float* dst = tmp + r * D;
      if constexpr (Kind == kInt8) {
        const int8_t* p = static_cast<const int8_t*>(s.data) + off + r * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(p[d]) * scale;
      } else {
        const uint8_t* p = static_cast<const uint8_t*>(s.data) + off + r * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = s.lut[p[d]] * scale;
      }
    }
    return tmp;
  }
}

template <int64_t Kind>
PAGEDSERVE_INLINE void prefetch_slots(const Source& s, int64_t slot, int64_t n, const Geometry& g) {
  constexpr int64_t elem = Kind == kFloat32 ? 4 : Kind == kBFloat16 ? 2 : 1;
  const char* p = static_cast<const char*>(s.data) + slot * g.row * elem;
  for (int64_t b = 0; b < n * g.row * elem; b += 64) __builtin_prefetch(p + b, 0, 3);
}

// Where block `pos` / B starts: its first slot and how many of its positions are in [pos, last).
// Also prefetches the following block, which lives elsewhere in the pool.
template <int64_t Kind>
PAGEDSERVE_INLINE int64_t block_at(const Source& k, const Source& v, const int32_t* blocks, int64_t pos,
                                   int64_t last, const Geometry& g, int64_t* n) {
  const int64_t B = g.block_size, j = pos / B;
  *n = std::min(last, (j + 1) * B) - pos;
  if (pos + *n < last) {
    const int64_t next = static_cast<int64_t>(blocks[j + 1]) * B, next_n = std::min(B, last - (pos + *n));
    prefetch_slots<Kind>(k, next, next_n, g);
    prefetch_slots<Kind>(v, next, next_n, g);
  }
  return static_cast<int64_t>(blocks[j]) * B + pos % B;
}

// Fold scores s[0, n) of one head into its running state; leaves e^(s - max) in s and returns
// the factor the head's accumulator must be scaled by.
PAGEDSERVE_INLINE float online_softmax_scalar(float* s, int64_t n, float* m, float* l) {
  const float m_new = std::max(*m, *std::max_element(s, s + n));
  const float alpha = *m == kNegInf ? 0.f : exp_nonpositive(*m - m_new);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < n; ++t) {
    s[t] = exp_nonpositive(s[t] - m_new);
    sum += s[t];
  }
  *l = *l * alpha + sum;
  *m = m_new;
  return alpha;
}

// Any head_dim: scalar loops the compiler vectorises as it can. K and V of a block are widened to
// fp32 in `tmp` (two blocks of values) first.
template <int64_t Kind>
PAGEDSERVE_INLINE void attend_any(const float* q, const Source& k, const Source& v, const int32_t* blocks,
                                  int64_t first, int64_t last, const Geometry& g, float scale, float* scores,
                                  float* tmp, Partial st) {
  const int64_t D = g.head_dim, H = g.num_kv_heads * g.group, SB = (g.block_size + 15) / 16 * 16;
  for (int64_t pos = first, n = 0; pos < last; pos += n) {
    const int64_t slot = block_at<Kind>(k, v, blocks, pos, last, g, &n);
    const float* kr = widen_slots<Kind>(k, slot, n, g, tmp);
    for (int64_t h = 0; h < H; ++h) {
      const float* qh = q + h * D;
      const float* kh = kr + (h / g.group) * D;
      float* s = scores + h * SB;
      for (int64_t t = 0; t < n; ++t) {
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += qh[d] * kh[t * g.row + d];
        s[t] = dot * scale;
      }
      if (g.softcap > 0.f) softcap_scores(s, n, 1.f, g.softcap);
      const float alpha = online_softmax_scalar(s, n, st.m + h, st.l + h);
      float* a = st.acc + h * D;
      for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
    }
    const float* vr = widen_slots<Kind>(v, slot, n, g, tmp + g.block_size * g.row);
    for (int64_t h = 0; h < H; ++h) {
      const float* vh = vr + (h / g.group) * D;
      float* a = st.acc + h * D;
      for (int64_t t = 0; t < n; ++t) {
        const float p = scores[h * SB + t];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += p * vh[t * g.row + d];
      }
    }
  }
}

// 32 consecutive cache values as two fp32 vectors. fp32: values 0-15 and 16-31. bf16: one 64-byte
// load split into the even values (x << 16) and the odd ones (x & 0xffff0000), both exact; the
// query and the accumulators are kept in the same even/odd order (lane order, see
// to_lane_order), so bf16 caches need no widening pass.
template <int64_t Kind, class V>
PAGEDSERVE_INLINE void load32(const void* base, int64_t i, V& a, V& b) {
  if constexpr (Kind == kBFloat16) {
    Vec16<V>::bf16_even_odd(static_cast<const uint16_t*>(base) + i, a, b);
  } else {
    const float* p = static_cast<const float*>(base) + i;
    a = Vec16<V>::load(p);
    b = Vec16<V>::load(p + 16);
  }
}

// Natural order -> lane order (bf16: within every 32 values, the even ones then the odd ones).
void to_lane_order(const float* in, float* out, int64_t count) {
  for (int64_t c = 0; c < count; c += 32) {
    for (int64_t i = 0; i < 16; ++i) {
      out[c + i] = in[c + 2 * i];
      out[c + 16 + i] = in[c + 2 * i + 1];
    }
  }
}

void from_lane_order(const float* in, float* out, int64_t count) {
  for (int64_t c = 0; c < count; c += 32) {
    for (int64_t i = 0; i < 16; ++i) {
      out[c + 2 * i] = in[c + i];
      out[c + 2 * i + 1] = in[c + 16 + i];
    }
  }
}

// Positions per softmax update in the vector kernels: two 16-slot blocks, so the max / exp /
// rescale bookkeeping is paid once per 32 scores.
constexpr int64_t kChunk = 32;

// GB query heads sharing one KV head (GQA) over n <= kChunk positions whose values start at
// kr/vr + rows[t] (+ the KV head's offset): each K and V row is loaded (and, for bf16, split into
// lane order) once for all GB heads. 16 scores of a head are reduced together (reduce16), the
// exp is vectorised. q and st.acc are in lane order for bf16 caches. V: 16 floats as one v16sf
// (AVX-512 and baseline builds) or F8x2 (AVX2; vec_avx2.h says why), through Vec16<V>.
//
// Narrow passes (GB * NP <= 8: up to 4 heads at head_dim 64, 2 at 128, 1 at 256) keep q and each
// head's whole accumulator in registers across the chunk. Wide passes (more heads, AVX-512 only:
// Gemma 3's 4 heads per KV head at head_dim 256) read q from L1 and take P V one 64-value slice
// of head_dim at a time, so a K or V row is still split once for all the heads: with one head per
// pass each was split 4 times, and Gemma 3 270M's step was bound by that arithmetic (17 GB/s of
// K/V against 27 GB/s at SmolLM2's shape, 2-core AMX Xeon).
template <int64_t Kind, int64_t NP, int64_t GB, class V>
PAGEDSERVE_INLINE void attend_heads(const float* q, const void* kr, const void* vr, const int64_t* rows, int64_t n,
                                    const int64_t* next_rows, int64_t next_n, int64_t head0, int64_t kv_offset,
                                    float scale, float softcap, float* scores, Partial st) {
  using VO = Vec16<V>;
  constexpr int64_t D = 32 * NP, kBytes = Kind == kBFloat16 ? 2 : 4;
  constexpr bool kWide = GB * NP > 8;
  V qa[kWide ? 1 : GB][NP], qb[kWide ? 1 : GB][NP];
  if constexpr (!kWide) {
    for (int64_t g = 0; g < GB; ++g) {
      for (int64_t c = 0; c < NP; ++c) {
        qa[g][c] = VO::load(q + (head0 + g) * D + 32 * c);
        qb[g][c] = VO::load(q + (head0 + g) * D + 32 * c + 16);
      }
    }
  }
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    V dots[GB][16];
    for (int64_t t = 0; t < 16; ++t) {
      // Lanes past the chunk's end repeat its last row: finite values, masked below.
      const int64_t row = rows[std::min(t0 + t, n - 1)] + kv_offset;
      // This KV head's rows of the next chunk, a few lines per position, into L2 (prefetcht1): W64
      // bf16 ran 2-5% faster than with them pulled into L1 (prefetcht0), fp32 the same
      // (docs/benchmarks.md, 2026-12-07).
      if (t0 + t < next_n) {
        const char* kn = static_cast<const char*>(kr) + (next_rows[t0 + t] + kv_offset) * kBytes;
        const char* vn = static_cast<const char*>(vr) + (next_rows[t0 + t] + kv_offset) * kBytes;
        for (int64_t b = 0; b < D * kBytes; b += 64) {
          __builtin_prefetch(kn + b, 0, 2);
          __builtin_prefetch(vn + b, 0, 2);
        }
      }
      V sum[GB];
      for (int64_t g = 0; g < GB; ++g) sum[g] = VO::zero();
      for (int64_t c = 0; c < NP; ++c) {
        V ka, kb;
        load32<Kind>(kr, row + 32 * c, ka, kb);
        for (int64_t g = 0; g < GB; ++g) {
          if constexpr (kWide) {
            const float* qg = q + (head0 + g) * D + 32 * c;
            sum[g] = VO::fmadd(VO::load(qg), ka, VO::fmadd(VO::load(qg + 16), kb, sum[g]));
          } else {
            sum[g] = VO::fmadd(qa[g][c], ka, VO::fmadd(qb[g][c], kb, sum[g]));
          }
        }
      }
      for (int64_t g = 0; g < GB; ++g) dots[g][t] = sum[g];
    }
    for (int64_t g = 0; g < GB; ++g) VO::store(scores + g * kChunk + t0, VO::reduce(dots[g]) * scale);
  }
  if (softcap > 0.f) {  // before the max: the softmax below sees the capped scores
    for (int64_t g = 0; g < GB; ++g) softcap_scores(scores + g * kChunk, n, 1.f, softcap);
  }
  float alpha[GB];
  for (int64_t g = 0; g < GB; ++g) {
    float* s = scores + g * kChunk;
    const int64_t h = head0 + g;
    V m_vec = VO::splat(kNegInf);
    for (int64_t t0 = 0; t0 < n; t0 += 16) m_vec = VO::max(m_vec, VO::fill_from(VO::load(s + t0), n - t0, kNegInf));
    const float m_new = std::max(st.m[h], VO::hmax(m_vec));
    // The accumulator is rescaled only when the maximum moved (most chunks after the first).
    alpha[g] = st.m[h] == kNegInf ? 0.f : m_new == st.m[h] ? 1.f : exp_nonpositive(st.m[h] - m_new);
    V sum_vec = VO::zero();
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
      const V e = VO::fill_from(VO::exp(VO::load(s + t0) - m_new), n - t0, 0.f);
      VO::store(s + t0, e);
      sum_vec += e;
    }
    st.l[h] = st.l[h] * alpha[g] + VO::hsum(sum_vec);
    st.m[h] = m_new;
  }
  // P V over slices of CP * 32 values of head_dim: the whole head (narrow) or 64 values (wide).
  constexpr int64_t CP = kWide ? 2 : NP;
  static_assert(NP % CP == 0, "head_dim slices must tile the head");
  for (int64_t c0 = 0; c0 < NP; c0 += CP) {
    V aa[GB][CP], ab[GB][CP];
    for (int64_t g = 0; g < GB; ++g) {
      const float* a = st.acc + (head0 + g) * D + 32 * c0;
      for (int64_t c = 0; c < CP; ++c) {
        aa[g][c] = VO::load(a + 32 * c) * alpha[g];
        ab[g][c] = VO::load(a + 32 * c + 16) * alpha[g];
      }
    }
    for (int64_t t = 0; t < n; ++t) {
      const int64_t row = rows[t] + kv_offset + 32 * c0;
      for (int64_t c = 0; c < CP; ++c) {
        V va, vb;
        load32<Kind>(vr, row + 32 * c, va, vb);
        for (int64_t g = 0; g < GB; ++g) {
          const V p = VO::splat(scores[g * kChunk + t]);
          aa[g][c] = VO::fmadd(p, va, aa[g][c]);
          ab[g][c] = VO::fmadd(p, vb, ab[g][c]);
        }
      }
    }
    for (int64_t g = 0; g < GB; ++g) {
      float* a = st.acc + (head0 + g) * D + 32 * c0;
      for (int64_t c = 0; c < CP; ++c) {
        VO::store(a + 32 * c, aa[g][c]);
        VO::store(a + 32 * c + 16, ab[g][c]);
      }
    }
  }
}

// head_dim = 32 * NP. fp32 and bf16 caches are read in place, kChunk positions (across blocks)
// at a time, the next chunk prefetched; int8/fp8 are widened one block at a time into `tmp`.
// Query heads are taken in passes of up to 4 per KV head. The AVX2 build (F8x2: 16 ymm registers)
// keeps to narrow passes (2 heads at head_dim 128, 1 at 256), whose accumulators fit in registers.
template <int64_t Kind, int64_t NP, class V>
PAGEDSERVE_INLINE void attend_vec(const float* q, const Source& k, const Source& v, const int32_t* blocks,
                                  int64_t first, int64_t last, const Geometry& g, float scale, float* scores,
                                  float* tmp, Partial st) {
  constexpr bool kInPlace = Kind == kFloat32 || Kind == kBFloat16;
  constexpr int64_t kLoad = kInPlace ? Kind : kFloat32;  // widened codes are fp32
  constexpr int64_t kMaxPass = std::is_same_v<V, v16sf> || NP == 2 ? 4 : NP == 4 ? 2 : 1;
  const int64_t B = g.block_size, R = g.row, D = 32 * NP;
  // Row offsets (in values) of a chunk's positions; in-place caches also know the next chunk's,
  // which attend_heads prefetches a few lines per position while it works on this one.
  int64_t row_tables[2][kChunk];
  int64_t* rows = row_tables[0];
  int64_t* next_rows = row_tables[1];
  auto chunk_rows = [&](int64_t pos, int64_t* out) {
    int64_t n = 0;
    while (n < kChunk && pos + n < last) {
      const int64_t p = pos + n, slot = static_cast<int64_t>(blocks[p / B]) * B + p % B;
      const int64_t run = std::min({B - p % B, last - p, kChunk - n});
      for (int64_t i = 0; i < run; ++i) out[n + i] = (slot + i) * R;
      n += run;
    }
    return n;
  };
  int64_t next_n = kInPlace ? chunk_rows(first, next_rows) : 0;
  for (int64_t pos = first, n = 0; pos < last; pos += n) {
    const void* kr = k.data;
    const void* vr = v.data;
    if constexpr (kInPlace) {
      std::swap(rows, next_rows);
      n = next_n;
      next_n = chunk_rows(pos + n, next_rows);
    } else {
      const int64_t slot = block_at<Kind>(k, v, blocks, pos, last, g, &n);
      n = std::min(n, kChunk);  // blocks larger than a chunk are taken a chunk at a time
      kr = widen_slots<Kind>(k, slot, n, g, tmp);
      vr = widen_slots<Kind>(v, slot, n, g, tmp + B * R);
      for (int64_t i = 0; i < n; ++i) rows[i] = i * R;
    }
    for (int64_t kv = 0; kv < g.num_kv_heads; ++kv) {
      for (int64_t h = kv * g.group, end = h + g.group; h < end;) {
        const int64_t pass = std::min(kMaxPass, end - h);
        switch (pass) {
          case 4: attend_heads<kLoad, NP, 4, V>(q, kr, vr, rows, n, next_rows, next_n, h, kv * D, scale, g.softcap, scores, st); break;
          case 3: attend_heads<kLoad, NP, 3, V>(q, kr, vr, rows, n, next_rows, next_n, h, kv * D, scale, g.softcap, scores, st); break;
          case 2: attend_heads<kLoad, NP, 2, V>(q, kr, vr, rows, n, next_rows, next_n, h, kv * D, scale, g.softcap, scores, st); break;
          default: attend_heads<kLoad, NP, 1, V>(q, kr, vr, rows, n, next_rows, next_n, h, kv * D, scale, g.softcap, scores, st); break;
        }
        h += pass;
      }
    }
  }
}

using AttendFn = void (*)(const float*, const Source&, const Source&, const int32_t*, int64_t, int64_t,
                          const Geometry&, float, float*, float*, Partial);

// One compiled entry per (head_dim class, cache kind). The any-head_dim ones are cloned per ISA
// (PAGEDSERVE_MULTIVERSION). The vector ones are cloned for AVX-512 and the baseline over v16sf,
// and built once more for AVX2 over F8x2 (the `_avx2` entries): GCC's AVX2 clone of the v16sf
// code ran 4-6x slower than the AVX-512 one (vec_avx2.h).
#define PAGEDSERVE_ATTEND_ENTRY(ATTRS, NAME, CALL)                                                                \
  ATTRS void NAME(const float* q, const Source& k, const Source& v, const int32_t* blocks, int64_t first,        \
                  int64_t last, const Geometry& g, float scale, float* scores, float* tmp, Partial st) {        \
    CALL(q, k, v, blocks, first, last, g, scale, scores, tmp, st);                                              \
  }
PAGEDSERVE_ATTEND_ENTRY(PAGEDSERVE_MULTIVERSION, attend_any_fp32, attend_any<kFloat32>)
PAGEDSERVE_ATTEND_ENTRY(PAGEDSERVE_MULTIVERSION, attend_any_bf16, attend_any<kBFloat16>)
PAGEDSERVE_ATTEND_ENTRY(PAGEDSERVE_MULTIVERSION, attend_any_int8, attend_any<kInt8>)
PAGEDSERVE_ATTEND_ENTRY(PAGEDSERVE_MULTIVERSION, attend_any_fp8, attend_any<kFp8>)
#define PAGEDSERVE_COMMA ,
#define PAGEDSERVE_VECTOR_ENTRIES(ATTRS, SUFFIX, V)                                                              \
  PAGEDSERVE_ATTEND_ENTRY(ATTRS, attend64_fp32##SUFFIX, attend_vec<kFloat32 PAGEDSERVE_COMMA 2 PAGEDSERVE_COMMA V>)   \
  PAGEDSERVE_ATTEND_ENTRY(ATTRS, attend64_bf16##SUFFIX, attend_vec<kBFloat16 PAGEDSERVE_COMMA 2 PAGEDSERVE_COMMA V>)  \
  PAGEDSERVE_ATTEND_ENTRY(ATTRS, attend64_int8##SUFFIX, attend_vec<kInt8 PAGEDSERVE_COMMA 2 PAGEDSERVE_COMMA V>)      \
  PAGEDSERVE_ATTEND_ENTRY(ATTRS, attend64_fp8##SUFFIX, attend_vec<kFp8 PAGEDSERVE_COMMA 2 PAGEDSERVE_COMMA V>)        \
  PAGEDSERVE_ATTEND_ENTRY(ATTRS, attend128_fp32##SUFFIX, attend_vec<kFloat32 PAGEDSERVE_COMMA 4 PAGEDSERVE_COMMA V>)  \
  PAGEDSERVE_ATTEND_ENTRY(ATTRS, attend128_bf16##SUFFIX, attend_vec<kBFloat16 PAGEDSERVE_COMMA 4 PAGEDSERVE_COMMA V>) \
  PAGEDSERVE_ATTEND_ENTRY(ATTRS, attend128_int8##SUFFIX, attend_vec<kInt8 PAGEDSERVE_COMMA 4 PAGEDSERVE_COMMA V>)     \
  PAGEDSERVE_ATTEND_ENTRY(ATTRS, attend128_fp8##SUFFIX, attend_vec<kFp8 PAGEDSERVE_COMMA 4 PAGEDSERVE_COMMA V>)        \
  PAGEDSERVE_ATTEND_ENTRY(ATTRS, attend256_fp32##SUFFIX, attend_vec<kFloat32 PAGEDSERVE_COMMA 8 PAGEDSERVE_COMMA V>)  \
  PAGEDSERVE_ATTEND_ENTRY(ATTRS, attend256_bf16##SUFFIX, attend_vec<kBFloat16 PAGEDSERVE_COMMA 8 PAGEDSERVE_COMMA V>) \
  PAGEDSERVE_ATTEND_ENTRY(ATTRS, attend256_int8##SUFFIX, attend_vec<kInt8 PAGEDSERVE_COMMA 8 PAGEDSERVE_COMMA V>)     \
  PAGEDSERVE_ATTEND_ENTRY(ATTRS, attend256_fp8##SUFFIX, attend_vec<kFp8 PAGEDSERVE_COMMA 8 PAGEDSERVE_COMMA V>)
#ifdef PAGEDSERVE_HAVE_F8X2
PAGEDSERVE_VECTOR_ENTRIES(__attribute__((target_clones("arch=x86-64-v4", "default"))), , v16sf)
PAGEDSERVE_VECTOR_ENTRIES(__attribute__((target("arch=x86-64-v3"))), _avx2, F8x2)
#else
PAGEDSERVE_VECTOR_ENTRIES(PAGEDSERVE_MULTIVERSION, , v16sf)
#endif
#undef PAGEDSERVE_VECTOR_ENTRIES
#undef PAGEDSERVE_COMMA

// Whether the vector kernels take their F8x2 (AVX2) entries here (vec_avx2.h: use_avx2_builds).
bool avx2_vector_entries() {
#ifdef PAGEDSERVE_HAVE_F8X2
  return use_avx2_builds();
#else
  return false;
#endif
}

int64_t cache_kind(const torch::Tensor& cache, const torch::Tensor& lut) {
  switch (cache.scalar_type()) {
    case torch::kFloat32: return kFloat32;
    case torch::kBFloat16: return kBFloat16;
    case torch::kChar: return kInt8;
    case torch::kByte:  // fp8 codes, passed as uint8 with their decoding table
      TORCH_CHECK(lut.defined() && lut.scalar_type() == torch::kFloat32 && lut.numel() == 256 && lut.is_contiguous(),
                  "8-bit float caches (passed as uint8) need a float32 [256] code table");
      return kFp8;
    default:
      TORCH_CHECK(false, "paged_decode_attention: unsupported cache dtype ", cache.scalar_type(),
                  " (float32, bfloat16, int8, or fp8 codes as uint8)");
  }
}

// Per-slot bf16 scales [num_blocks, block_size, num_kv_heads], a 0-dim float32 static scale, or
// undefined for float caches.
void scale_pointers(const torch::Tensor& scale, int64_t kind, const torch::Tensor& cache, const uint16_t** per_slot,
                    float* fixed) {
  *per_slot = nullptr;
  *fixed = 1.f;
  if (kind == kFloat32 || kind == kBFloat16) {
    TORCH_CHECK(!scale.defined(), "float caches take no scales");
    return;
  }
  TORCH_CHECK(scale.defined(), "quantized caches need k_scale and v_scale");
  if (scale.dim() == 0) {
    TORCH_CHECK(scale.scalar_type() == torch::kFloat32, "a static scale must be a 0-dim float32 tensor");
    *fixed = scale.item<float>();
    return;
  }
  TORCH_CHECK(scale.scalar_type() == torch::kBFloat16 && scale.is_contiguous() && scale.dim() == 3 &&
                  scale.size(0) == cache.size(0) && scale.size(1) == cache.size(1) && scale.size(2) == cache.size(2),
              "per-slot scales must be contiguous bfloat16 [num_blocks, block_size, num_kv_heads]");
  *per_slot = reinterpret_cast<const uint16_t*>(scale.data_ptr());
}

struct WorkItem {
  int64_t seq;    // batch row
  int64_t first;  // positions [first, last) of the sequence
  int64_t last;
  int64_t part;   // index of this item's partial result when its sequence is split, else -1
};

// A split sequence's ranges are at least this many blocks long.
constexpr int64_t kMinSplitBlocks = 4;

// Items for the decode rows, each sequence split into block-aligned ranges when there are fewer
// than `wanted` sequences. Returns the number of partial results the split items need.
int64_t make_items(const std::vector<int64_t>& decode_seqs, const int32_t* lens, int64_t sliding_window,
                   int64_t block_size, int64_t wanted, std::vector<WorkItem>* items) {
  const int64_t count = static_cast<int64_t>(decode_seqs.size());
  const int64_t splits_per_seq = std::max<int64_t>(1, (wanted + count - 1) / count);
  int64_t parts = 0;
  for (int64_t b : decode_seqs) {
    const int64_t last = lens[b], first = sliding_window > 0 ? std::max<int64_t>(0, last - sliding_window) : 0;
    const int64_t first_block = first / block_size, n_blocks = (last + block_size - 1) / block_size - first_block;
    const int64_t splits = std::min(splits_per_seq, std::max<int64_t>(1, n_blocks / kMinSplitBlocks));
    if (splits == 1) {
      items->push_back({b, first, last, -1});
      continue;
    }
    for (int64_t s = 0; s < splits; ++s) {
      const int64_t lo = std::max(first, (first_block + n_blocks * s / splits) * block_size);
      const int64_t hi = std::min(last, (first_block + n_blocks * (s + 1) / splits) * block_size);
      items->push_back({b, lo, hi, parts++});
    }
  }
  return parts;
}

// bounds[t]..bounds[t + 1]: the items of thread t, contiguous runs of about equal positions.
std::vector<int64_t> balance(const std::vector<WorkItem>& items, int64_t threads) {
  int64_t total = 0;
  for (const WorkItem& it : items) total += it.last - it.first;
  std::vector<int64_t> bounds(threads + 1, static_cast<int64_t>(items.size()));
  bounds[0] = 0;
  int64_t acc = 0, t = 1;
  for (int64_t i = 0; i < static_cast<int64_t>(items.size()) && t < threads; ++i) {
    acc += items[i].last - items[i].first;
    while (t < threads && acc * threads >= total * t) bounds[t++] = i + 1;
  }
  return bounds;
}

// One call's state, held by value (and its tensors kept alive): under work_share.h the helper may
// attend its items after the call returned, into its scratch only.
struct DecodeCall {
  std::vector<WorkItem> items;
  std::vector<float> parts;  // split items' partial results, part_size floats each
  torch::Tensor out, query;
  std::vector<torch::Tensor> keep;  // what k, v, bt and starts point into
  AttendFn attend;
  bool lane_order, bf16_io;
  Geometry g;
  Source k, v;
  const int32_t* starts;
  const int32_t* bt;
  int64_t max_blocks, num_heads, head_dim, HD, part_size, scores_size, tmp_size;
  float scale;

  void read_query(int64_t row, float* q, float* scratch) const {
    float* dst = lane_order ? scratch : q;
    if (bf16_io) {
      const uint16_t* qs = reinterpret_cast<const uint16_t*>(query.data_ptr()) + row * HD;
      for (int64_t j = 0; j < HD; ++j) dst[j] = bf16_to_float(qs[j]);
    } else {
      std::memcpy(dst, query.data_ptr<float>() + row * HD, HD * sizeof(float));
    }
    if (lane_order) to_lane_order(scratch, q, HD);
  }

  // out[row] = acc / l per head (acc in the kernel's order).
  void write_row(int64_t row, const float* acc, const float* l, float* scratch, float* result) const {
    for (int64_t h = 0; h < num_heads; ++h) {
      const float inv = 1.f / l[h];
      for (int64_t d = 0; d < head_dim; ++d) scratch[h * head_dim + d] = acc[h * head_dim + d] * inv;
    }
    const float* values = scratch;
    if (lane_order) {
      from_lane_order(scratch, result, HD);
      values = result;
    }
    if (bf16_io) {
      uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr()) + row * HD;
      for (int64_t i = 0; i < HD; ++i) o[i] = float_to_bf16(values[i]);
    } else {
      std::memcpy(out.data_ptr<float>() + row * HD, values, HD * sizeof(float));
    }
  }

  // Items [i0, i1): into their out rows or parts (to null), or each item's partial result into
  // to + (i - i0) * part_size (the helper's scratch).
  void attend_items(int64_t i0, int64_t i1, float* to) {
    std::vector<float> q(HD), scratch(HD), result(HD), own(part_size), scores(scores_size), tmp(tmp_size);
    for (int64_t i = i0; i < i1; ++i) {
      const WorkItem& it = items[i];
      float* p = to != nullptr ? to + (i - i0) * part_size : it.part >= 0 ? parts.data() + it.part * part_size : own.data();
      const Partial st{p, p + num_heads, p + 2 * num_heads};
      std::fill(st.m, st.m + num_heads, kNegInf);
      std::fill(st.l, st.l + num_heads, 0.f);
      std::fill(st.acc, st.acc + HD, 0.f);
      read_query(starts[it.seq], q.data(), scratch.data());
      attend(q.data(), k, v, bt + it.seq * max_blocks, it.first, it.last, g, scale, scores.data(), tmp.data(), st);
      if (to == nullptr && it.part < 0) write_row(starts[it.seq], st.acc, st.l, scratch.data(), result.data());
    }
  }

  // The helper's partial results of items [i0, i1) into parts or out.
  void commit_items(int64_t i0, int64_t i1, const float* from) {
    std::vector<float> scratch(HD), result(HD);
    for (int64_t i = i0; i < i1; ++i) {
      const WorkItem& it = items[i];
      const float* p = from + (i - i0) * part_size;
      if (it.part >= 0) {
        std::memcpy(parts.data() + it.part * part_size, p, part_size * sizeof(float));
      } else {
        write_row(starts[it.seq], p + 2 * num_heads, p + num_heads, scratch.data(), result.data());
      }
    }
  }

  // Each split sequence's parts (its items are consecutive) merged by log-sum-exp into its out row.
  void merge_parts() {
    std::vector<float> merged(part_size), scratch(HD), result(HD);
    for (size_t i = 0; i < items.size();) {
      size_t end = i + 1;
      while (end < items.size() && items[end].seq == items[i].seq) ++end;
      if (items[i].part >= 0) {
        float* l = merged.data() + num_heads;
        float* acc = merged.data() + 2 * num_heads;
        for (int64_t h = 0; h < num_heads; ++h) {
          float m_all = kNegInf;
          for (size_t j = i; j < end; ++j) m_all = std::max(m_all, parts[items[j].part * part_size + h]);
          l[h] = 0.f;
          std::fill(acc + h * head_dim, acc + (h + 1) * head_dim, 0.f);
          for (size_t j = i; j < end; ++j) {
            const float* p = parts.data() + items[j].part * part_size;
            const float w = std::exp(p[h] - m_all);
            l[h] += p[num_heads + h] * w;
            for (int64_t d = 0; d < head_dim; ++d) acc[h * head_dim + d] += p[2 * num_heads + h * head_dim + d] * w;
          }
        }
        write_row(starts[items[i].seq], acc, l, scratch.data(), result.data());
      }
      i = end;
    }
  }
};

}  // namespace

bool force_avx2_vector_code(bool force) {
#ifdef PAGEDSERVE_HAVE_F8X2
  return avx2_builds_forced().exchange(force);
#else
  return false;
#endif
}

// Writes out[row] for every sequence whose query_start_loc span is exactly one row; rows of
// longer spans (prefill chunks) are left untouched for the caller. sliding_window <= 0: none.
// softcap > 0: scaled scores become tanh(s / softcap) * softcap before the softmax; 0: none.
// query / out: both float32 or both bfloat16. k_scale / v_scale: undefined (None) for float
// caches; fp8_lut: undefined unless the caches are fp8 codes viewed as uint8.
void paged_decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                            torch::Tensor value_cache, torch::Tensor block_table,
                            torch::Tensor query_start_loc, torch::Tensor seq_lens, double scale,
                            int64_t sliding_window, c10::optional<torch::Tensor> k_scale,
                            c10::optional<torch::Tensor> v_scale, c10::optional<torch::Tensor> fp8_lut,
                            double softcap) {
  const bool bf16_io = query.scalar_type() == torch::kBFloat16;
  TORCH_CHECK((query.scalar_type() == torch::kFloat32 || bf16_io) && out.scalar_type() == query.scalar_type(),
              "paged_decode_attention: query and out must both be float32 or both bfloat16");
  TORCH_CHECK(value_cache.scalar_type() == key_cache.scalar_type(), "key and value caches differ in dtype");
  TORCH_CHECK(softcap >= 0, "paged_decode_attention: softcap must be >= 0 (0: none), got ", softcap);
  const torch::Tensor lut = fp8_lut.value_or(torch::Tensor());
  const int64_t kind = cache_kind(key_cache, lut);
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query and out must be [num_tokens, num_heads, head_dim]");
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
              "caches must be [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(query.is_contiguous() && out.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  block_table.is_contiguous() && query_start_loc.is_contiguous() && seq_lens.is_contiguous(),
              "paged_decode_attention: every tensor must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt32 && query_start_loc.scalar_type() == torch::kInt32 &&
                  seq_lens.scalar_type() == torch::kInt32,
              "block_table, query_start_loc and seq_lens must be int32");
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "query heads/head_dim do not fit the cache");
  const int64_t num_seqs = seq_lens.size(0), max_blocks = block_table.size(1);
  TORCH_CHECK(block_table.size(0) == num_seqs && query_start_loc.size(0) == num_seqs + 1, "batch sizes disagree");
  const uint16_t *k_scales, *v_scales;
  float k_fixed, v_fixed;
  scale_pointers(k_scale.value_or(torch::Tensor()), kind, key_cache, &k_scales, &k_fixed);
  scale_pointers(v_scale.value_or(torch::Tensor()), kind, value_cache, &v_scales, &v_fixed);

  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  std::vector<int64_t> decode_seqs;
  for (int64_t b = 0; b < num_seqs; ++b) {
    if (starts[b + 1] - starts[b] == 1) {
      TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_blocks * block_size, "seq_lens[", b, "]=", lens[b], " does not fit the block table");
      decode_seqs.push_back(b);
    }
  }
  if (decode_seqs.empty()) return;
  // Beside the helper thread (work_share.h) the items are cut as for two threads and claimed in
  // chunks; else dealt in contiguous runs, one per thread.
  const bool shared = work_share::sharing();
  const int64_t threads = shared ? 2 : std::max<int64_t>(1, at::get_num_threads());
  auto call = std::make_shared<DecodeCall>();
  DecodeCall& c = *call;
  const int64_t num_parts = make_items(decode_seqs, lens, sliding_window, block_size, 4 * threads, &c.items);

  static const AttendFn kernels[4][4] = {{attend_any_fp32, attend_any_bf16, attend_any_int8, attend_any_fp8},
                                         {attend64_fp32, attend64_bf16, attend64_int8, attend64_fp8},
                                         {attend128_fp32, attend128_bf16, attend128_int8, attend128_fp8},
                                         {attend256_fp32, attend256_bf16, attend256_int8, attend256_fp8}};
#ifdef PAGEDSERVE_HAVE_F8X2
  static const AttendFn avx2_kernels[4][4] = {
      {attend_any_fp32, attend_any_bf16, attend_any_int8, attend_any_fp8},
      {attend64_fp32_avx2, attend64_bf16_avx2, attend64_int8_avx2, attend64_fp8_avx2},
      {attend128_fp32_avx2, attend128_bf16_avx2, attend128_int8_avx2, attend128_fp8_avx2},
      {attend256_fp32_avx2, attend256_bf16_avx2, attend256_int8_avx2, attend256_fp8_avx2}};
#else
  static const AttendFn(&avx2_kernels)[4][4] = kernels;
#endif
  const int64_t variant = head_dim == 64 ? 1 : head_dim == 128 ? 2 : head_dim == 256 ? 3 : 0;
  c.attend = (avx2_vector_entries() ? avx2_kernels : kernels)[variant][kind];
  // The vector kernels over bf16 caches keep q and the accumulators in load32's lane order.
  c.lane_order = variant != 0 && kind == kBFloat16;
  c.bf16_io = bf16_io;
  c.g = Geometry{block_size, num_kv_heads, num_heads / num_kv_heads, head_dim, num_kv_heads * head_dim,
                 static_cast<float>(softcap)};
  c.k = Source{key_cache.data_ptr(), k_scales, k_fixed, kind == kFp8 ? lut.data_ptr<float>() : nullptr};
  c.v = Source{value_cache.data_ptr(), v_scales, v_fixed, c.k.lut};
  c.out = out;
  c.query = query;
  c.keep = {key_cache, value_cache, block_table, query_start_loc, lut, k_scale.value_or(torch::Tensor()),
            v_scale.value_or(torch::Tensor())};
  c.starts = starts;
  c.bt = block_table.data_ptr<int32_t>();
  c.max_blocks = max_blocks;
  c.scale = static_cast<float>(scale);
  c.num_heads = num_heads;
  c.head_dim = head_dim;
  c.HD = num_heads * head_dim;
  c.part_size = num_heads * (head_dim + 2);
  c.parts.assign(static_cast<size_t>(num_parts * c.part_size), 0.f);  // split items: m, l, acc
  c.scores_size = std::max(num_heads * ((block_size + 15) / 16 * 16), 4 * kChunk);
  c.tmp_size = kind == kFloat32 || c.lane_order ? 0 : 2 * block_size * c.g.row;

  const int64_t n_items = static_cast<int64_t>(c.items.size());
  if (shared) {
    const int64_t grain = work_share::grain_for(n_items);
    work_share::run(
        n_items, grain, static_cast<size_t>(grain * c.part_size) * sizeof(float),
        [call](int64_t i0, int64_t i1, void* scratch) { call->attend_items(i0, i1, static_cast<float*>(scratch)); },
        [call](int64_t i0, int64_t i1, const void* scratch) {
          call->commit_items(i0, i1, static_cast<const float*>(scratch));
        });
  } else {
    const std::vector<int64_t> bounds = balance(c.items, threads);
    at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) c.attend_items(bounds[t], bounds[t + 1], nullptr);
    });
  }
  c.merge_parts();
}

}  // namespace pagedserve
