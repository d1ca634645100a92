"""The Triton kernels compile for a real GPU (sm_90) on a machine without one.

The interpreter runs the kernels' arithmetic but not the compiler's rules (constexpr-only globals,
type legalization, dot shapes, PTX assembly). Triton's wheel bundles ptxas, so compiling ahead of
time for an H100 target needs no device: this catches what only a GPU run would otherwise find.
It checks compilation only; numerics are test_triton_kernels.py's job. The compiles run in a
child process without TRITON_INTERPRET (in this process the kernels are interpreter objects).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

TL_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int8: "i8",
            torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
# (query dtype, cache dtype, QUANT, FP32_DOT, NUM_SPLITS, USE_WINDOW, USE_SOFTCAP)
ATTENTION_CASES = [(torch.bfloat16, torch.int8, 1, False, 4, True, False),
                   (torch.float16, torch.float8_e4m3fn, 2, False, 1, False, False),
                   (torch.float32, torch.float32, 0, True, 1, False, False),
                   (torch.bfloat16, torch.bfloat16, 0, False, 2, True, True)]  # Gemma 2: window and softcap
LORA_DTYPES = [torch.float32, torch.bfloat16]
# (cache dtype, QUANT, ROUND)
STORE_CASES = [(torch.float8_e4m3fn, 1, False), (torch.int8, 2, False), (torch.bfloat16, 0, True)]


def compile_sm90(fn, pointer_types: dict[str, str], constexprs: dict[str, object], float_args=()):
    """Every `*_ptr` argument gets its type from pointer_types, `float_args` fp32, other scalars i32."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*" + pointer_types[name]
        else:
            signature[name] = "fp32" if name in float_args else "i32"
    names = list(signature)
    src = ASTSource(fn=fn, signature=signature, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    assert kernel.asm["ptx"] and kernel.asm.get("cubin")
    return kernel


def main() -> None:
    import pagedserve.kernels.triton.attention as attn
    import pagedserve.kernels.triton.kv_store as store
    import pagedserve.kernels.triton.lora as lora
    from pagedserve.kernels.triton.quant import quant_constexprs

    for q_dtype, cache_dtype, quant, fp32_dot, splits, window, softcap in ATTENTION_CASES:
        q, c = TL_TYPES[q_dtype], TL_TYPES[cache_dtype]
        ptrs = dict(q_ptr=q, out_ptr=q, k_cache_ptr=c, v_cache_ptr=c, k_scale_ptr="fp32", v_scale_ptr="fp32",
                    part_ml_ptr="fp32", part_acc_ptr="fp32", block_table_ptr="i32", query_start_loc_ptr="i32",
                    seq_lens_ptr="i32", q_block_seq_ptr="i32")
        compile_sm90(attn._paged_attention_kernel, ptrs, dict(
            BLOCK_Q=5, BLOCK_M=16, BLOCK_N=attn.BLOCK_N, BLOCK_D=128, NUM_SPLITS=splits, QUANT=quant,
            USE_WINDOW=window, FP32_DOT=fp32_dot, USE_SOFTCAP=softcap), float_args=("qk_scale", "softcap"))
        print("compiled attention", q, c, flush=True)
    compile_sm90(attn._reduce_splits_kernel, dict(part_ml_ptr="fp32", part_acc_ptr="fp32", out_ptr="bf16"),
                 dict(NUM_SPLITS=5, BLOCK_R=2, BLOCK_S=8, BLOCK_D=128))
    print("compiled reduce", flush=True)
    for cache_dtype, quant, round_ in STORE_CASES:
        c = TL_TYPES[cache_dtype]
        kernel = compile_sm90(store._reshape_and_cache_kernel, dict(
            key_ptr="fp32", value_ptr="fp32", key_cache_ptr=c, value_cache_ptr=c, k_scale_ptr="fp32",
            v_scale_ptr="fp32", slot_mapping_ptr="i64"), dict(
            BLOCK_H=4, BLOCK_D=64, QUANT=quant, ROUND=round_, MIN_SCALE_C=1e-12, **quant_constexprs(cache_dtype)))
        if quant:
            # Quantization divides with IEEE rounding (div.rn), as torch does, never div.full.
            ptx = kernel.asm["ptx"]
            assert "div.rn.f32" in ptx and "div.full.f32" not in ptx and "div.approx.f32" not in ptx
        print("compiled store", c, flush=True)
    for dtype in LORA_DTYPES:
        t = TL_TYPES[dtype]
        compile_sm90(lora._lora_shrink_kernel, dict(x_ptr=t, a_ptr=t, slots_ptr="i32", shrunk_ptr="fp32"),
                     dict(BLOCK_J=lora.BLOCK_J, BLOCK_K=lora.BLOCK_K))
        compile_sm90(lora._lora_expand_kernel, dict(y_ptr=t, b_ptr=t, slots_ptr="i32", shrunk_ptr="fp32"),
                     dict(R=16, BLOCK_R=16, BLOCK_O=lora.BLOCK_O))
        print("compiled lora", t, flush=True)


def test_kernels_compile_for_sm90():
    pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[dev]')")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert r.stdout.count("compiled") == len(ATTENTION_CASES) + 1 + len(STORE_CASES) + len(LORA_DTYPES), r.stdout


if __name__ == "__main__":
    main()
