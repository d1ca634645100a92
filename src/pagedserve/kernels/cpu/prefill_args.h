// What the prefill attention kernels (paged_prefill_attention.cpp, amx_prefill_attention.cpp)
// check of their arguments, once for both, with the calling kernel's name in every message, and
// the order both run their row blocks in.
#pragma once

#include "ops.h"

namespace pagedserve {

struct PrefillShapes {
  int64_t heads, kv_heads, dim, block_size, table_stride;
};

// The row block that runs j-th of a sequence's `blocks` (per head): first, last, second, second
// to last, ... A causal block's cost grows with its position, so at::parallel_for's contiguous
// ranges of (head, block) items then get as many early blocks as late ones. In plain order, with
// 9 heads on 2 threads, the range that ended mid-head took that head's cheap half: 4.25 heads'
// worth of causal work against 4.75.
inline int64_t zigzag_block(int64_t j, int64_t blocks) { return j % 2 == 0 ? j / 2 : blocks - 1 - j / 2; }

inline void check_prefill_tensor(const char* kernel, const torch::Tensor& t, const char* name, int64_t dim,
                                 c10::ScalarType dtype) {
  TORCH_CHECK(t.scalar_type() == dtype && t.dim() == dim && t.is_contiguous(), kernel, ": ", name,
              " must be a contiguous ", dim, "-D ", dtype_name(dtype), " tensor, got ", dtype_name(t.scalar_type()),
              " ", t.sizes());
}

// out and query [T, heads, head_dim], the caches [blocks, block_size, kv_heads, head_dim], all
// contiguous in `dtype`; head_dim a multiple of 32, heads a multiple of kv heads; the metadata
// contiguous int32, one query_start_loc entry per sequence plus one, a block_table row each.
inline PrefillShapes check_prefill_args(const char* kernel, c10::ScalarType dtype, const torch::Tensor& out,
                                        const torch::Tensor& query, const torch::Tensor& key_cache,
                                        const torch::Tensor& value_cache, const torch::Tensor& block_table,
                                        const torch::Tensor& query_start_loc, const torch::Tensor& seq_lens,
                                        int64_t sliding_window, double softcap) {
  TORCH_CHECK(softcap >= 0, kernel, ": softcap must be >= 0 (0: none), got ", softcap);
  TORCH_CHECK(sliding_window >= 0, kernel, ": sliding_window must be >= 0 (0: none), got ", sliding_window);
  check_prefill_tensor(kernel, out, "out", 3, dtype);
  check_prefill_tensor(kernel, query, "query", 3, dtype);
  check_prefill_tensor(kernel, key_cache, "key_cache", 4, dtype);
  check_prefill_tensor(kernel, value_cache, "value_cache", 4, dtype);
  TORCH_CHECK(out.sizes() == query.sizes(), kernel, ": out must have query's shape");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), kernel, ": key and value caches differ");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt && block_table.dim() == 2 && block_table.is_contiguous() &&
                  query_start_loc.scalar_type() == torch::kInt && seq_lens.scalar_type() == torch::kInt &&
                  query_start_loc.is_contiguous() && seq_lens.is_contiguous(),
              kernel, ": block_table, query_start_loc and seq_lens must be contiguous int32");
  const PrefillShapes s{query.size(1), key_cache.size(2), query.size(2), key_cache.size(1), block_table.size(1)};
  TORCH_CHECK(key_cache.size(3) == s.dim && s.dim % 32 == 0 && s.heads % s.kv_heads == 0, kernel,
              ": head_dim must match the cache and be a multiple of 32, and heads a multiple of kv heads");
  const int64_t B = seq_lens.numel();
  TORCH_CHECK(query_start_loc.numel() == B + 1 && block_table.size(0) >= B, kernel,
              ": one query_start_loc entry per sequence plus one, a block_table row each");
  return s;
}

// Sequence b's q_len query rows fit its seq_len n, and its blocks its block_table row.
inline void check_prefill_sequence(const char* kernel, int64_t b, int64_t q_len, int64_t n, const PrefillShapes& s) {
  TORCH_CHECK(q_len <= n && (n + s.block_size - 1) / s.block_size <= s.table_stride, kernel, ": sequence ", b,
              " has q_len ", q_len, " > seq_len ", n, " or more blocks than block_table holds");
}

}  // namespace pagedserve
