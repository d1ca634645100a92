// Paged decode attention on CPU: one query row per sequence, fp32 queries and arithmetic (the
// Python wrapper widens bf16 queries and rounds the result back), K/V read in place through the
// block table. The pure-torch reference (kernels/reference/attention.py) gathers every key of
// every decode row into a fresh buffer before SDPA; reading the cache in place skips that copy.
// Decode attention is bound by memory traffic (its latency more than its bandwidth: see
// kPrefetchAhead), so the cache is read in its stored format (fp32, bf16, int8 or fp8 codes with
// per-slot bf16 or static fp32 scales) and widened to fp32 one row at a time in L1, never whole.
//
// Work item = (decode sequence, KV head): the group's query heads (GQA) share one pass over the
// keys, so each K/V row is loaded once per item. Scores are kept for the whole context (at most
// max_model_len floats per query head), then softmax, then the weighted sum of V rows.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

// Compiled twice on x86-64 (AVX2+FMA and baseline) and picked at load time by the CPU, so a
// build cached on one machine never executes an instruction another machine lacks.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PAGEDSERVE_MULTIVERSION __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define PAGEDSERVE_MULTIVERSION
#endif

struct Geometry {
  int64_t block_size;
  int64_t row_stride;  // elements between consecutive cache slots: num_kv_heads * head_dim
  int64_t num_kv_heads;
  int64_t group;       // query heads per KV head
  int64_t head_dim;
};

enum CacheKind : int64_t { kFloat32 = 0, kBFloat16 = 1, kInt8 = 2, kFp8 = 3 };

// One KV head of one cache, with how to widen its rows to fp32.
struct Source {
  const void* data;        // cache base offset to the head
  const uint16_t* scales;  // per-slot bf16 scales offset to the head (stride num_kv_heads), or null
  float static_scale;      // the scale when `scales` is null (1 for float caches)
  const float* lut;        // fp8 code -> value, 256 entries (kFp8 only)
};

// e^x for x <= 0 (a score minus the row's maximum), vectorisable where std::exp is a scalar libm
// call (measured ~10% of the kernel's time with std::exp): e^x = 2^n * 2^f with n = round(x / ln2), |f| <= 1/2, and
// 2^f from its degree-7 Taylor polynomial (relative error below 1e-7, float rounding level).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // below this e^x underflows anyway; keeps 2^n a normal float
  const float t = x * 1.4426950408889634f;
  const float n = std::floor(t + 0.5f);
  const float f = (t - n) * 0.6931471805599453f;  // the remainder back in natural-log units
  const float p = 1.f + f * (1.f + f * (0.5f + f * (1.f / 6 + f * (1.f / 24 + f * (1.f / 120 + f * (1.f / 720 + f * (1.f / 5040)))))));
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Eight floats as one GCC vector (AVX in the x86-64-v3 clone, two SSE halves in the baseline).
typedef float v8sf __attribute__((vector_size(32)));
constexpr int64_t kTile = 4;

inline v8sf load8(const float* p) {
  v8sf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline float hsum8(v8sf v) {
  return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

inline float bf16_to_float(uint16_t bits) {
  uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

// fp32 values of cache slot `slot` (head_dim of them): a pointer into the cache for fp32, else
// `tmp` filled with code * scale, exactly as the reference's dequantize_kv computes it.
template <int64_t Kind>
__attribute__((always_inline)) inline const float* load_row(const Source& s, int64_t slot, const Geometry& g,
                                                            float* tmp) {
  const int64_t off = slot * g.row_stride, D = g.head_dim;
  if constexpr (Kind == kFloat32) {
    return static_cast<const float*>(s.data) + off;
  } else if constexpr (Kind == kBFloat16) {
    const uint16_t* p = static_cast<const uint16_t*>(s.data) + off;
    for (int64_t d = 0; d < D; ++d) tmp[d] = bf16_to_float(p[d]);
    return tmp;
  } else {
    const float scale = s.scales != nullptr ? bf16_to_float(s.scales[slot * g.num_kv_heads]) : s.static_scale;
    if constexpr (Kind == kInt8) {
      const int8_t* p = static_cast<const int8_t*>(s.data) + off;
      for (int64_t d = 0; d < D; ++d) tmp[d] = static_cast<float>(p[d]) * scale;
    } else {
      const uint8_t* p = static_cast<const uint8_t*>(s.data) + off;
      for (int64_t d = 0; d < D; ++d) tmp[d] = s.lut[p[d]] * scale;
    }
    return tmp;
  }
}

// Software prefetch this many positions ahead. A work item reads one KV head's part of each slot
// (SmolLM2: 256 of every 768 bytes) from blocks scattered over the pool, which the hardware
// prefetcher follows poorly: measured 1.4-1.7x faster on fp32 caches at 64 sequences of 16-768
// tokens (int8 ~1.1x); 8 and 16 positions tie, 4 and 32 are slower.
constexpr int64_t kPrefetchAhead = 8;

template <int64_t Kind>
__attribute__((always_inline)) inline void prefetch_row(const Source& s, int64_t slot, const Geometry& g) {
  constexpr int64_t elem = Kind == kFloat32 ? 4 : Kind == kBFloat16 ? 2 : 1;
  const char* p = static_cast<const char*>(s.data) + slot * g.row_stride * elem;
  for (int64_t b = 0; b < g.head_dim * elem; b += 64) __builtin_prefetch(p + b, 0, 3);
}

// Attention of `group` query rows (q: group x head_dim, contiguous) over cache positions
// [first, last) of one sequence and one KV head.
template <int64_t Kind>
__attribute__((always_inline)) inline void attend(const float* q, const Source& k, const Source& v,
                                                  const int32_t* blocks, int64_t first, int64_t last,
                                                  const Geometry& g, float scale, float* scores, float* tmp,
                                                  float* out) {
  const int64_t n = last - first, D = g.head_dim;
  auto slot = [&](int64_t pos) {
    return static_cast<int64_t>(blocks[pos / g.block_size]) * g.block_size + pos % g.block_size;
  };
  int64_t i = 0;
  if (D % 8 == 0) {
    // kTile positions at a time, one 8-wide accumulator each: independent FMA chains instead of
    // one dependent chain per dot product (measured 12-20% faster than the plain simd loop).
    for (; i + kTile <= n; i += kTile) {
      for (int64_t t = 0; t < kTile; ++t) {
        if (i + kPrefetchAhead + t < n) prefetch_row<Kind>(k, slot(first + i + kPrefetchAhead + t), g);
      }
      const float* kr[kTile];
      for (int64_t t = 0; t < kTile; ++t) kr[t] = load_row<Kind>(k, slot(first + i + t), g, tmp + t * D);
      for (int64_t h = 0; h < g.group; ++h) {
        const float* qr = q + h * D;
        v8sf acc[kTile] = {};
        for (int64_t d = 0; d < D; d += 8) {
          const v8sf qv = load8(qr + d);
          for (int64_t t = 0; t < kTile; ++t) acc[t] += qv * load8(kr[t] + d);
        }
        for (int64_t t = 0; t < kTile; ++t) scores[h * n + i + t] = hsum8(acc[t]) * scale;
      }
    }
  }
  for (; i < n; ++i) {
    const float* kr = load_row<Kind>(k, slot(first + i), g, tmp);
    for (int64_t h = 0; h < g.group; ++h) {
      const float* qr = q + h * D;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < D; ++d) dot += qr[d] * kr[d];
      scores[h * n + i] = dot * scale;
    }
  }
  for (int64_t h = 0; h < g.group; ++h) {
    float* s = scores + h * n;
    const float m = *std::max_element(s, s + n);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; ++i) {
      s[i] = exp_nonpositive(s[i] - m);
      sum += s[i];
    }
    const float inv = 1.f / sum;
    for (int64_t i = 0; i < n; ++i) s[i] *= inv;
    std::fill(out + h * D, out + (h + 1) * D, 0.f);
  }
  for (int64_t i = 0; i < n; ++i) {
    if (i + kPrefetchAhead < n) prefetch_row<Kind>(v, slot(first + i + kPrefetchAhead), g);
    const float* vr = load_row<Kind>(v, slot(first + i), g, tmp);
    for (int64_t h = 0; h < g.group; ++h) {
      const float p = scores[h * n + i];
      float* o = out + h * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] += p * vr[d];
    }
  }
}

// One compiled entry per cache kind; each is cloned for AVX2+FMA and the baseline ISA.
#define PAGEDSERVE_ATTEND_ENTRY(NAME, KIND)                                                                  \
  PAGEDSERVE_MULTIVERSION void NAME(const float* q, const Source& k, const Source& v, const int32_t* blocks, \
                                    int64_t first, int64_t last, const Geometry& g, float scale,           \
                                    float* scores, float* tmp, float* out) {                               \
    attend<KIND>(q, k, v, blocks, first, last, g, scale, scores, tmp, out);                                \
  }
PAGEDSERVE_ATTEND_ENTRY(attend_fp32, kFloat32)
PAGEDSERVE_ATTEND_ENTRY(attend_bf16, kBFloat16)
PAGEDSERVE_ATTEND_ENTRY(attend_int8, kInt8)
PAGEDSERVE_ATTEND_ENTRY(attend_fp8, kFp8)

using AttendFn = void (*)(const float*, const Source&, const Source&, const int32_t*, int64_t, int64_t,
                          const Geometry&, float, float*, float*, float*);

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

}  // namespace

// Writes out[row] for every sequence whose query_start_loc span is exactly one row; rows of
// longer spans (prefill chunks) are left untouched for the caller. sliding_window <= 0: none.
// k_scale / v_scale: undefined (None) for float caches; fp8_lut: undefined unless the caches are
// fp8 codes viewed as uint8.
void paged_decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                            torch::Tensor value_cache, torch::Tensor block_table,
                            torch::Tensor query_start_loc, torch::Tensor seq_lens, double scale,
                            int64_t sliding_window, c10::optional<torch::Tensor> k_scale,
                            c10::optional<torch::Tensor> v_scale, c10::optional<torch::Tensor> fp8_lut) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && out.scalar_type() == torch::kFloat32,
              "paged_decode_attention: query and out must be float32");
  TORCH_CHECK(value_cache.scalar_type() == key_cache.scalar_type(), "key and value caches differ in dtype");
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
  const Geometry g{block_size, num_kv_heads * head_dim, num_kv_heads, num_heads / num_kv_heads, head_dim};
  const AttendFn attend_fn = kind == kFloat32 ? attend_fp32 : kind == kBFloat16 ? attend_bf16
                           : kind == kInt8 ? attend_int8 : attend_fp8;
  const int64_t elem = key_cache.element_size();
  const char* kp = static_cast<const char*>(key_cache.data_ptr());
  const char* vp = static_cast<const char*>(value_cache.data_ptr());
  const float* lut_p = kind == kFp8 ? lut.data_ptr<float>() : nullptr;
  const float* qp = query.data_ptr<float>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);

  const int64_t items = static_cast<int64_t>(decode_seqs.size()) * num_kv_heads;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> tmp(kTile * head_dim);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = decode_seqs[w / num_kv_heads], h = w % num_kv_heads;
      const int64_t last = lens[b];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, last - sliding_window) : 0;
      scores.resize(g.group * (last - first));
      const Source k{kp + h * head_dim * elem, k_scales ? k_scales + h : nullptr, k_fixed, lut_p};
      const Source v{vp + h * head_dim * elem, v_scales ? v_scales + h : nullptr, v_fixed, lut_p};
      const int64_t head_offset = (starts[b] * num_heads + h * g.group) * head_dim;
      attend_fn(qp + head_offset, k, v, bt + b * max_blocks, first, last, g, sc, scores.data(), tmp.data(),
                op + head_offset);
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode rows of a packed varlen batch attending over a paged KV cache (fp32, bf16, int8 or fp8 codes).",
        py::arg("out"), py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_table"),
        py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("scale"), py::arg("sliding_window"),
        py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(), py::arg("fp8_lut") = py::none());
}
