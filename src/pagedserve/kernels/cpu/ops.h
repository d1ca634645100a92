// The operations the extension exports (bindings.cpp), one declaration each.
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

namespace pagedserve {

// A dtype as torch's Python side names it, for error messages ("float32", not "Float").
inline std::string dtype_name(c10::ScalarType t) { return std::string(c10::getDtypeNames(t).first); }

// paged_decode_attention.cpp
void paged_decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                            torch::Tensor value_cache, torch::Tensor block_table,
                            torch::Tensor query_start_loc, torch::Tensor seq_lens, double scale,
                            int64_t sliding_window, c10::optional<torch::Tensor> k_scale,
                            c10::optional<torch::Tensor> v_scale, c10::optional<torch::Tensor> fp8_lut,
                            double softcap);

// Makes paged_decode_attention and silu_and_mul take their AVX2 builds (vec_avx2.h) on any CPU
// with AVX2 and FMA, AVX-512 ones too (for tests); returns the previous setting.
bool force_avx2_vector_code(bool force);

// paged_prefill_attention.cpp
void paged_prefill_attention(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                             torch::Tensor value_cache, torch::Tensor block_table, torch::Tensor query_start_loc,
                             torch::Tensor seq_lens, double scale, int64_t sliding_window, double softcap);
void paged_prefill_attention_avx2(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                                  torch::Tensor value_cache, torch::Tensor block_table,
                                  torch::Tensor query_start_loc, torch::Tensor seq_lens, double scale,
                                  int64_t sliding_window, double softcap);
// amx_prefill_attention.cpp: the same for bf16 queries and caches, on AMX.
void paged_prefill_attention_amx(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                                 torch::Tensor value_cache, torch::Tensor block_table, torch::Tensor query_start_loc,
                                 torch::Tensor seq_lens, double scale, int64_t sliding_window, double softcap);

// amx_int8_linear.cpp
torch::Tensor int8_amx_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                              c10::optional<torch::Tensor> bias, int64_t out_features, int64_t group_size);
torch::Tensor int8_amx_linear_argmax(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                                     c10::optional<torch::Tensor> bias, int64_t out_features);
torch::Tensor int8_amx_gated_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                                    c10::optional<torch::Tensor> bias, int64_t out_features, std::string activation);

// fused_ops.cpp
void add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
torch::Tensor gelu_tanh_and_mul(torch::Tensor gate_up);
std::vector<torch::Tensor> rotary_qkv(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos,
                                      torch::Tensor sin, int64_t num_heads, int64_t num_kv_heads,
                                      c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm,
                                      double eps);
void store_kv(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache, torch::Tensor value_cache,
              torch::Tensor slot_mapping);

// argmax_rows.cpp
torch::Tensor argmax_rows(torch::Tensor logits);

// lora.cpp: y[t] += (x[t] @ lora_a[s].T) @ lora_b[s], s = token_slots[t] >= 0 (kernels/reference/lora.py)
void lora_add(torch::Tensor y, torch::Tensor x, torch::Tensor lora_a, torch::Tensor lora_b, torch::Tensor token_slots,
              std::vector<int64_t> out_slices);
// amx_lora.cpp: the same for bf16 on AMX; false (nothing done) where it does not apply (not bf16,
// no AMX, `in` not a multiple of 32, a part's rank not a multiple of 16).
bool lora_add_amx(torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& lora_a, const torch::Tensor& lora_b,
                  const int32_t* token_slots, const std::vector<int64_t>& out_slices);

// A linear kernel's output [rows of x, n] of dtype: `out` when given (checked: contiguous, that dtype
// and shape; a caller that reuses one buffer spares the fresh pages a large new tensor costs), else
// a new tensor. `name` prefixes the error. (simd_linear.cpp)
torch::Tensor output_for(const torch::Tensor& x, int64_t n, c10::ScalarType dtype,
                         const c10::optional<torch::Tensor>& out, const char* name);

// amx_linear.cpp
bool amx_linear_available();
torch::Tensor amx_pack_weight(torch::Tensor weight);
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                         int64_t out_features, bool fp32_out, c10::optional<torch::Tensor> out);
torch::Tensor amx_packed_rows(torch::Tensor packed, torch::Tensor ids, int64_t in_features);
// The *_linear_argmax entry points: each row's argmax over x @ W^T (+ bias) as the linear would
// have returned it, int64 [rows], without storing the outputs (row_argmax.h: greedy decoding).
torch::Tensor amx_linear_argmax(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                                int64_t out_features);
// A gate_up projection ([gate | up] outputs, out_features = 2 n) followed by its gated activation
// ("silu" or "gelu_tanh"): act(gate) * up [rows, n], as silu_and_mul / gelu_tanh_and_mul over
// amx_linear's result would give it, without storing that result.
torch::Tensor amx_gated_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                               int64_t out_features, std::string activation);

// amx_fp32_linear.cpp: fp32_linear's result on AMX (each value split into three bf16 terms), for
// calls of many rows; over fp32_pack_weight's layout.
torch::Tensor fp32_amx_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                              int64_t out_features, c10::optional<torch::Tensor> out);
// The fewest rows for which fp32_linear takes fp32_amx_linear (where AMX runs).
int64_t fp32_amx_min_rows();

// simd_linear.cpp
bool avx512_kernels_available();  // fp32_*/bf16_* linear and paged_prefill_attention (AVX-512 F, BW)
bool avx512_bf16_dot_native();    // bf16_dot_linear uses vdpbf16ps (AVX512-BF16), not its emulation
bool avx2_kernels_available();    // avx2_fp32_linear (AVX2 with FMA)
torch::Tensor fp32_pack_weight(torch::Tensor weight);
torch::Tensor fp32_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                          int64_t out_features, c10::optional<torch::Tensor> out);
// fp32_linear on AVX-512's FMAs whatever the rows (fp32_amx_linear's way out for non-finite x).
torch::Tensor fp32_fma_linear(const torch::Tensor& x, const torch::Tensor& packed,
                              const c10::optional<torch::Tensor>& bias, int64_t out_features,
                              const c10::optional<torch::Tensor>& out);
// avx2_fp32_linear: over fp32_pack_weight's layout
torch::Tensor avx2_fp32_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                               int64_t out_features, c10::optional<torch::Tensor> out);
torch::Tensor fp32_packed_rows(torch::Tensor packed, torch::Tensor ids, int64_t in_features);
torch::Tensor bf16_pack_weight(torch::Tensor weight);
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                          int64_t out_features, bool fp32_out, c10::optional<torch::Tensor> out);
torch::Tensor bf16_packed_rows(torch::Tensor packed, torch::Tensor ids, int64_t in_features);
// bf16_dot_linear: over bf16_pack_weight's layout
torch::Tensor bf16_dot_linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                              int64_t out_features, bool fp32_out, c10::optional<torch::Tensor> out);
torch::Tensor fp32_linear_argmax(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                                 int64_t out_features);
torch::Tensor bf16_linear_argmax(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                                 int64_t out_features);
torch::Tensor bf16_dot_linear_argmax(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias,
                                     int64_t out_features);

// int8_linear.cpp: weight-only int8 (q [N, K] int8, scales float32 [K / group_size, N])
bool int8_dot_native();  // int8_dot_linear uses vdpbf16ps (AVX512-BF16), not its emulation
torch::Tensor int8_pack_weight(torch::Tensor weight);
torch::Tensor int8_dot_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                              c10::optional<torch::Tensor> bias, int64_t out_features, int64_t group_size);
torch::Tensor int8_avx2_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales,
                               c10::optional<torch::Tensor> bias, int64_t out_features, int64_t group_size);

}  // namespace pagedserve
