// Python bindings of the CPU kernels (the module torch.utils.cpp_extension builds, see build.py).
#include "ops.h"
#include "work_share.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace pagedserve;
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode rows of a packed varlen batch attending over a paged KV cache (fp32, bf16, int8 or fp8 codes); "
        "softcap > 0: scaled scores become tanh(s / softcap) * softcap (Gemma 2).",
        py::arg("out"), py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_table"),
        py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("scale"), py::arg("sliding_window"),
        py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(), py::arg("fp8_lut") = py::none(),
        py::arg("softcap") = 0.0);
  m.def("force_avx2_vector_code", &force_avx2_vector_code,
        "Make paged_decode_attention and silu_and_mul take their AVX2 builds wherever they run (tests); returns the "
        "previous setting.", py::arg("force"));
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "Prefill rows (q_len > 1) of a packed varlen batch attending causally over an fp32 or bf16 paged KV cache (query of the same dtype); "
        "sliding_window > 0: a row at position p sees keys (p - sliding_window, p]; softcap > 0: scaled scores "
        "become tanh(s / softcap) * softcap (Gemma 2).",
        py::arg("out"), py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_table"),
        py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("scale"), py::arg("sliding_window") = 0,
        py::arg("softcap") = 0.0);
  m.def("paged_prefill_attention_avx2", &paged_prefill_attention_avx2,
        "paged_prefill_attention on AVX2 with FMA (ymm blocks, the same sums).", py::arg("out"), py::arg("query"),
        py::arg("key_cache"), py::arg("value_cache"), py::arg("block_table"), py::arg("query_start_loc"),
        py::arg("seq_lens"), py::arg("scale"), py::arg("sliding_window") = 0, py::arg("softcap") = 0.0);
  m.def("paged_prefill_attention_amx", &paged_prefill_attention_amx,
        "paged_prefill_attention for bf16 queries and caches on AMX (tdpbf16ps GEMMs, fp32 softmax, bf16 probabilities).",
        py::arg("out"), py::arg("query"), py::arg("key_cache"), py::arg("value_cache"), py::arg("block_table"),
        py::arg("query_start_loc"), py::arg("seq_lens"), py::arg("scale"), py::arg("sliding_window") = 0,
        py::arg("softcap") = 0.0);
  m.def("add_rms_norm", &add_rms_norm, "residual += x; x = weight * rms_norm(residual), in place.",
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"));
  m.def("rms_norm", &rms_norm, "weight * rms_norm(x) as a new tensor.", py::arg("x"), py::arg("weight"), py::arg("eps"));
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up for gate_up = [gate | up].", py::arg("gate_up"));
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, "gelu_tanh(gate) * up for gate_up = [gate | up] (Gemma's MLP).",
        py::arg("gate_up"));
  m.def("rotary_qkv", &rotary_qkv,
        "(q, k, v) from a fused qkv projection, q and k optionally head-normalised and rotated (neox).",
        py::arg("qkv"), py::arg("positions"), py::arg("cos"), py::arg("sin"), py::arg("num_heads"),
        py::arg("num_kv_heads"), py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none(), py::arg("eps") = 0.0);
  m.def("store_kv", &store_kv, "key_cache[slot] = key, value_cache[slot] = value for float caches.",
        py::arg("key"), py::arg("value"), py::arg("key_cache"), py::arg("value_cache"), py::arg("slot_mapping"));
  m.def("argmax_rows", &argmax_rows, "Row-wise argmax of fp32 logits (torch.max(dim=-1).indices).",
        py::arg("logits"));
  m.def("lora_add", &lora_add,
        "y[t] += (x[t] @ lora_a[s].T) @ lora_b[s] for s = token_slots[t] >= 0, each part of out_slices reading its "
        "own ranks of lora_b (in place).",
        py::arg("y"), py::arg("x"), py::arg("lora_a"), py::arg("lora_b"), py::arg("token_slots"), py::arg("out_slices"));
  m.def("amx_linear_available", &amx_linear_available, "Whether this CPU and process can run amx_linear.");
  m.def("amx_pack_weight", &amx_pack_weight, "A bf16 [out, in] weight in amx_linear's tile layout.",
        py::arg("weight"));
  m.def("amx_linear", &amx_linear, "x @ weight.T (+ bias) in bf16 on AMX, weight from amx_pack_weight.",
        py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("out_features"),
        py::arg("fp32_out") = false, py::arg("out") = py::none());
  m.def("amx_linear_argmax", &amx_linear_argmax,
        "Each row's argmax (int64 [rows]) over amx_linear's result, which is not stored (greedy decoding).",
        py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("out_features"));
  m.def("amx_gated_linear", &amx_gated_linear,
        "act(gate) * up for a gate_up projection on AMX ([gate | up] outputs; activation 'silu' or 'gelu_tanh'), "
        "as the activation over amx_linear's result gives it, without storing that result.",
        py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("out_features"), py::arg("activation"));
  m.def("amx_packed_rows", &amx_packed_rows, "Rows ids of the weight amx_pack_weight packed ([len(ids), in]).",
        py::arg("packed"), py::arg("ids"), py::arg("in_features"));
  m.def("avx512_kernels_available", &avx512_kernels_available,
        "Whether this CPU can run the fp32 / bf16 linear kernels and paged_prefill_attention (AVX-512 F and BW).");
  m.def("avx512_bf16_dot_native", &avx512_bf16_dot_native,
        "Whether bf16_dot_linear runs AVX512-BF16's dot product here (else an emulation of it, for tests).");
  m.def("avx2_kernels_available", &avx2_kernels_available, "Whether this CPU can run avx2_fp32_linear (AVX2, FMA).");
  m.def("fp32_pack_weight", &fp32_pack_weight, "An fp32 [out, in] weight in fp32_linear's panel layout.",
        py::arg("weight"));
  m.def("fp32_linear", &fp32_linear, "x @ weight.T (+ bias) in fp32 on AVX-512, weight from fp32_pack_weight.",
        py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("out_features"),
        py::arg("out") = py::none());
  m.def("fp32_amx_linear", &fp32_amx_linear,
        "fp32_linear on AMX: each fp32 value split into three bf16 terms, six of their products summed in fp32.",
        py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("out_features"), py::arg("out") = py::none());
  m.def("fp32_amx_min_rows", &fp32_amx_min_rows, "The fewest rows for which fp32_linear runs fp32_amx_linear on AMX.");
  m.def("avx2_fp32_linear", &avx2_fp32_linear,
        "fp32_linear on AVX2 with FMA (ymm blocks, the same sums), weight from fp32_pack_weight.", py::arg("x"),
        py::arg("packed"), py::arg("bias"), py::arg("out_features"),
        py::arg("out") = py::none());
  m.def("fp32_packed_rows", &fp32_packed_rows, "Rows ids of the weight fp32_pack_weight packed ([len(ids), in]).",
        py::arg("packed"), py::arg("ids"), py::arg("in_features"));
  m.def("bf16_pack_weight", &bf16_pack_weight, "A bf16 [out, in] weight in bf16_linear's paired panel layout.",
        py::arg("weight"));
  m.def("bf16_linear", &bf16_linear,
        "x @ weight.T (+ bias) for bf16 x and weight in fp32 math on AVX-512F, weight from bf16_pack_weight.",
        py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("out_features"),
        py::arg("fp32_out") = false, py::arg("out") = py::none());
  m.def("bf16_dot_linear", &bf16_dot_linear,
        "x @ weight.T (+ bias) for bf16 x and weight by bf16 pair dot products (vdpbf16ps), weight from bf16_pack_weight.",
        py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("out_features"),
        py::arg("fp32_out") = false, py::arg("out") = py::none());
  m.def("fp32_linear_argmax", &fp32_linear_argmax, "Each row's argmax over fp32_linear's result, not stored.",
        py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("out_features"));
  m.def("bf16_linear_argmax", &bf16_linear_argmax, "Each row's argmax over bf16_linear's result, not stored.",
        py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("out_features"));
  m.def("bf16_dot_linear_argmax", &bf16_dot_linear_argmax,
        "Each row's argmax over bf16_dot_linear's result, not stored.", py::arg("x"), py::arg("packed"),
        py::arg("bias"), py::arg("out_features"));
  m.def("bf16_packed_rows", &bf16_packed_rows, "Rows ids of the weight bf16_pack_weight packed ([len(ids), in]).",
        py::arg("packed"), py::arg("ids"), py::arg("in_features"));
  m.def("int8_dot_native", &int8_dot_native,
        "Whether int8_dot_linear runs AVX512-BF16's dot product here (else an emulation of it, for tests).");
  m.def("int8_pack_weight", &int8_pack_weight, "An int8 [out, in] weight in the int8 kernels' panel layout.",
        py::arg("weight"));
  m.def("int8_dot_linear", &int8_dot_linear,
        "x @ (q * scales)^T (+ bias) for bf16 x over int8 weights widened to bf16 pairs (vdpbf16ps) on AVX-512.",
        py::arg("x"), py::arg("packed"), py::arg("scales"), py::arg("bias"), py::arg("out_features"),
        py::arg("group_size"));
  m.def("int8_amx_linear", &int8_amx_linear,
        "x @ (q * scales)^T (+ bias) for bf16 x over int8 weights with per-column scales, widened to bf16 tiles on AMX.",
        py::arg("x"), py::arg("packed"), py::arg("scales"), py::arg("bias"), py::arg("out_features"),
        py::arg("group_size"));
  m.def("int8_amx_linear_argmax", &int8_amx_linear_argmax,
        "Each row's argmax (int64 [rows]) over int8_amx_linear's result, which is not stored (greedy decoding).",
        py::arg("x"), py::arg("packed"), py::arg("scales"), py::arg("bias"), py::arg("out_features"));
  m.def("int8_amx_gated_linear", &int8_amx_gated_linear,
        "act(gate) * up for an int8 gate_up projection on AMX ([gate | up] outputs; activation 'silu' or "
        "'gelu_tanh'), as the activation over int8_amx_linear's result gives it, without storing that result.",
        py::arg("x"), py::arg("packed"), py::arg("scales"), py::arg("bias"), py::arg("out_features"),
        py::arg("activation"));
  m.def("int8_avx2_linear", &int8_avx2_linear,
        "x @ (q * scales)^T (+ bias) for fp32 or bf16 x over int8 weights in fp32 math on AVX2 with FMA.",
        py::arg("x"), py::arg("packed"), py::arg("scales"), py::arg("bias"), py::arg("out_features"),
        py::arg("group_size"));
  m.def("work_share_set_helper", &work_share::set_helper,
        "Turns the kernels' helper thread on for the calling thread (pinned to helper_cpu; < 0: the calling thread's CPUs) or "
        "off; returns its thread id (work_share.h).",
        py::arg("on"), py::arg("helper_cpu"));
  m.def("work_share_stats", &work_share::helper_stats,
        "[helper thread id, chunks the helper committed, chunks the engine thread took back].");
  m.def("work_share_set_test_delay_us", &work_share::set_helper_test_delay_us,
        "Tests: the helper sleeps this long after claiming each chunk, as if descheduled.", py::arg("us"));
}
