"""Tiny GGUF files written with the `gguf` package's GGUFWriter, for the converter's tests.

Weights are random and stored under the GGUF names llama.cpp writes for each architecture; the
tests convert them and compare against what transformers makes of the same file, so nothing here
has to imitate llama.cpp's value transforms.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 256, 4, 2, 64, 512, 2
CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"

# Block types gguf.quants cannot quantize are written as random block bytes: every byte <= 0x3B
# makes every fp16 scale inside a block a finite value below 1, whatever the layout.
_RANDOM_BYTE_MAX = 0x3B


def _layer_tensors(arch: str) -> dict[str, tuple[int, ...]]:
    """GGUF block tensor kind -> numpy shape (out, in), per architecture."""
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes = {"attn_norm": (HIDDEN,), "attn_output": (HIDDEN, q), "ffn_down": (HIDDEN, FFN), "ffn_norm": (HIDDEN,)}
    if arch == "phi3":
        return {**shapes, "attn_qkv": (q + 2 * kv, HIDDEN), "ffn_up": (2 * FFN, HIDDEN)}
    shapes |= {"attn_q": (q, HIDDEN), "attn_k": (kv, HIDDEN), "attn_v": (kv, HIDDEN),
               "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN)}  # fmt: skip
    if arch == "qwen2":
        shapes |= {"attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,)}
    if arch in ("qwen3", "gemma3"):
        shapes |= {"attn_q_norm": (HEAD_DIM,), "attn_k_norm": (HEAD_DIM,)}
    if arch in ("gemma2", "gemma3"):
        shapes |= {"post_attention_norm": (HIDDEN,), "post_ffw_norm": (HIDDEN,)}
    return shapes


def quantized(values: np.ndarray, type_name: str, rng: np.random.Generator):
    """(data, raw_dtype) for add_tensor: real quantization where gguf has it, random blocks else."""
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name == "F32":
        return values.astype(np.float32), None
    if type_name == "F16":
        return values.astype(np.float16), None
    try:
        return gguf.quants.quantize(values.astype(np.float32), qtype), qtype
    except NotImplementedError:
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        rows, cols = values.shape
        data = rng.integers(0, _RANDOM_BYTE_MAX + 1, size=(rows, cols // block * type_size), dtype=np.uint8)
        return data, qtype


def _tokenizer(writer, kind: str) -> int:
    """Write a small tokenizer; returns the vocabulary size."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    normal, control, byte = (gguf.TokenType.NORMAL, gguf.TokenType.CONTROL, gguf.TokenType.BYTE)
    if kind == "bpe":
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        pieces = list(bytes_to_unicode().values()) + ["Ġt", "he", "Ġthe", "ll", "Ġw"]
        merges = ["Ġ t", "h e", "Ġt he", "l l", "Ġ w"]
        tokens = specials + pieces
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_merges(merges)
        types = [control] * len(specials) + [normal] * len(pieces)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
    else:  # sentencepiece, as Gemma and Phi-3 files carry
        specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
        byte_tokens = [f"<0x{i:02X}>" for i in range(256)]
        pieces = ["▁", "▁t", "he", "▁the", "l", "ll", "o", "▁w", "h", "e", "t"]
        tokens = specials + byte_tokens + pieces
        writer.add_tokenizer_model("llama")
        writer.add_token_scores([0.0] * len(specials) + [0.0] * 256 + [-float(i) for i in range(len(pieces))])
        types = [control] * len(specials) + [byte] * 256 + [normal] * len(pieces)
        writer.add_bos_token_id(2)
        writer.add_eos_token_id(1)
        writer.add_unk_token_id(3)
        writer.add_pad_token_id(0)
        writer.add_eot_token_id(5)
    writer.add_token_list(tokens)
    writer.add_token_types([int(t) for t in types])
    writer.add_chat_template(CHAT_TEMPLATE)
    return len(tokens)


def write_gguf(path: Path, arch: str, types: tuple[str, ...] = ("F32",), *, name: str = "tiny",
               tied: bool = False, seed: int = 0, metadata: dict | None = None,
               extra_tensors: dict[str, np.ndarray] | None = None) -> Path:
    """A 2-layer model of GGUF architecture `arch`. Matrices take their storage type from `types` in
    turn (so one file covers several); 1-D tensors stay F32, as llama.cpp keeps them."""
    import gguf

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    if arch == "llama":
        writer.add_rope_dimension_count(HEAD_DIM)
    if arch in ("gemma2", "gemma3", "phi3"):
        writer.add_sliding_window(128)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(50.0)
        writer.add_final_logit_softcapping(30.0)
    vocab = _tokenizer(writer, "spm" if arch in ("gemma2", "gemma3", "phi3") else "bpe")
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)

    shapes = {"token_embd.weight": (vocab, HIDDEN), "output_norm.weight": (HIDDEN,)}
    if not tied:
        shapes["output.weight"] = (vocab, HIDDEN)
    for layer in range(LAYERS):
        for kind, shape in _layer_tensors(arch).items():
            full = kind if kind.endswith(".bias") else f"{kind}.weight"
            shapes[f"blk.{layer}.{full}"] = shape
    matrix = 0
    for tensor_name, shape in shapes.items():
        values = rng.standard_normal(shape).astype(np.float32) * 0.5
        if len(shape) == 1:
            data, raw = values, None
        else:
            data, raw = quantized(values, types[matrix % len(types)], rng)
            matrix += 1
        writer.add_tensor(tensor_name, data, raw_dtype=raw)
    for tensor_name, values in (extra_tensors or {}).items():
        writer.add_tensor(tensor_name, values.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
