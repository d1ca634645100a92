// Paged decode attention on CPU: one query row per sequence, fp32, K/V read in place through
// the block table. The pure-torch reference (kernels/reference/attention.py) gathers every key of
// every decode row into a fresh buffer before SDPA; reading the cache in place skips that copy,
// which was most of the attention time on 2-core machines.
//
// Work item = (decode sequence, KV head): the group's query heads (GQA) share one pass over the
// keys, so each K/V row is loaded once per item. Scores are kept for the whole context (at most
// max_model_len floats per query head), then softmax, then the weighted sum of V rows.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
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
  int64_t row_stride;  // floats between consecutive cache slots: num_kv_heads * head_dim
  int64_t group;       // query heads per KV head
  int64_t head_dim;
};

// Attention of `group` query rows (q: group x head_dim, contiguous) over cache positions
// [first, last) of one sequence and one KV head (k, v already offset to that head).
PAGEDSERVE_MULTIVERSION
void attend(const float* q, const float* k, const float* v, const int32_t* blocks, int64_t first,
            int64_t last, const Geometry& g, float scale, float* scores, float* out) {
  const int64_t n = last - first, D = g.head_dim;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t pos = first + i;
    const float* kr = k + (static_cast<int64_t>(blocks[pos / g.block_size]) * g.block_size + pos % g.block_size) * g.row_stride;
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
    for (int64_t i = 0; i < n; ++i) {
      s[i] = std::exp(s[i] - m);
      sum += s[i];
    }
    const float inv = 1.f / sum;
    for (int64_t i = 0; i < n; ++i) s[i] *= inv;
    std::fill(out + h * D, out + (h + 1) * D, 0.f);
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t pos = first + i;
    const float* vr = v + (static_cast<int64_t>(blocks[pos / g.block_size]) * g.block_size + pos % g.block_size) * g.row_stride;
    for (int64_t h = 0; h < g.group; ++h) {
      const float p = scores[h * n + i];
      float* o = out + h * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] += p * vr[d];
    }
  }
}

}  // namespace

// Writes out[row] for every sequence whose query_start_loc span is exactly one row; rows of
// longer spans (prefill chunks) are left untouched for the caller. sliding_window <= 0: none.
void paged_decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                            torch::Tensor value_cache, torch::Tensor block_table,
                            torch::Tensor query_start_loc, torch::Tensor seq_lens, double scale,
                            int64_t sliding_window) {
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && key_cache.scalar_type() == torch::kFloat32 &&
                  value_cache.scalar_type() == torch::kFloat32 && out.scalar_type() == torch::kFloat32,
              "paged_decode_attention: query, caches and out must be float32");
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

  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  std::vector<int64_t> decode_seqs;
  for (int64_t b = 0; b < num_seqs; ++b) {
    if (starts[b + 1] - starts[b] == 1) {
      TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_blocks * block_size, "seq_lens[", b, "]=", lens[b], " does not fit the block table");
      decode_seqs.push_back(b);
    }
  }
  const Geometry g{block_size, num_kv_heads * head_dim, num_heads / num_kv_heads, head_dim};
  const float* qp = query.data_ptr<float>();
  const float* kp = key_cache.data_ptr<float>();
  const float* vp = value_cache.data_ptr<float>();
  const int32_t* bt = block_table.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);

  const int64_t items = static_cast<int64_t>(decode_seqs.size()) * num_kv_heads;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t w = begin; w < end; ++w) {
      const int64_t b = decode_seqs[w / num_kv_heads], h = w % num_kv_heads;
      const int64_t last = lens[b];
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, last - sliding_window) : 0;
      scores.resize(g.group * (last - first));
      const int64_t row = starts[b];
      const int64_t head_offset = (row * num_heads + h * g.group) * head_dim;
      attend(qp + head_offset, kp + h * head_dim, vp + h * head_dim, bt + b * max_blocks, first, last, g, sc,
             scores.data(), op + head_offset);
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode rows of a packed varlen batch attending over a paged fp32 KV cache (in place).");
}
