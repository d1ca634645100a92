"""Load a checkpoint of a supported family from a local Hugging Face directory (safetensors only).

Tensor names are transformers' (model.layers.N.self_attn.q_proj.weight, ...). Phi-3 stores q/k/v
and gate/up fused (qkv_proj, gate_up_proj): they are taken as they are, being the same [q; k; v]
and [gate; up] concatenations the decoder makes of the others. Gemma's norms are stored as w and
computed as x * (1 + w): 1 + w is stored instead, so the decoder has one norm op for all families.
A multimodal Gemma 3 (Gemma3ForConditionalGeneration) keeps its text decoder under
language_model.model.* (language_model.lm_head.*), or model.language_model.* (lm_head.*) as newer
transformers save it: those names are read as the text model's, and the vision tower and projector
are left unread (the text decoder does not need them; images are refused at the request).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch
from safetensors import safe_open

from pagedserve.core.errors import ModelNotFound, UnsupportedModel
from pagedserve.core.layers.linear import Linear
from pagedserve.core.models.arch import ModelArch
from pagedserve.core.models.llama import LayerWeights, LlamaDecoder
from pagedserve.kernels.reference.int8_linear import Int8Weight, from_q8_0, quantize_per_channel


_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
CONVERT_HANDLE_BYTES = 64 << 20
INT8_LM_HEAD = True
"""Whether `quantization: int8` quantizes the LM head (and a tied embedding, looked up from the same
codes) too. Measured on SmolLM2-135M (tied, 21% of its weights): weights 0.50x bf16 with it, 0.61x
without (over issue 35's 0.55x); argmax agreement with fp32 95.2% with it, 95.6% without, both
rounded to nearest (calibrated, with it: 97.5%; docs/quantization.md)."""


class _Checkpoint:
    """Lazy name -> tensor access across all *.safetensors shards of a directory.

    A safetensors handle maps its whole shard, and every page a tensor was read through it stays
    resident while the handle lives. Tensors stored in the wanted dtype are read through the shard's
    handle, open for the whole load (as before). Tensors that are converted (SmolLM2's fp32 file
    loaded in bf16) are read through a second handle, replaced after every CONVERT_HANDLE_BYTES read,
    so their full-precision pages leave as loading goes on: with one handle for everything, the whole
    513 MiB fp32 file stayed resident beside the bf16 weights until the load ended (engine peak RSS
    1.2-1.3 GB against 0.75-0.9 GB, same load time). A handle per tensor measured the same peak and
    0.1 s slower (each open parses the shard's header).
    """

    def __init__(self, path: Path, dtype: torch.dtype, device: torch.device, multimodal_text: bool = False) -> None:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ModelNotFound(f"{path}: no *.safetensors files (pagedserve loads safetensors checkpoints only)")
        self._where: dict[str, Path] = {}
        self._stored: dict[str, str] = {}  # name as the decoder asks for it -> name in the file, where they differ
        for f in files:
            with safe_open(str(f), framework="pt") as sf:
                for stored in sf.keys():
                    name = _text_model_name(stored) if multimodal_text else stored
                    if name is None:
                        continue
                    self._where[name] = f
                    if name != stored:
                        self._stored[name] = stored
        self._handles = {f: safe_open(str(f), framework="pt") for f in files}
        self._converting: tuple[Path, Any] | None = None
        self._converted_bytes = 0
        self.dtype, self.device = dtype, device
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor in `dtype` (default: the model's)."""
        dtype = dtype or self.dtype
        if name not in self._where:
            raise UnsupportedModel(f"checkpoint has no tensor {name!r}; is this a Llama-family model?")
        self.used.add(name)
        shard = self._where[name]
        handle = self._handles[shard]
        name = self._stored.get(name, name)
        # Read in the model's dtype as stored: through the handle open all along. Anything else
        # (converted, or int8's full-precision reads) through the converting one, whose pages go.
        if (self.device.type == "cpu" and dtype == self.dtype
                and _SAFETENSORS_DTYPES.get(handle.get_slice(name).get_dtype()) == dtype):
            return handle.get_tensor(name)
        if self._converting is None or self._converting[0] != shard or self._converted_bytes > CONVERT_HANDLE_BYTES:
            self._converting, self._converted_bytes = (shard, safe_open(str(shard), framework="pt")), 0
        stored = self._converting[1].get_tensor(name)
        self._converted_bytes += stored.numel() * stored.element_size()
        return stored.to(device=self.device, dtype=dtype)

    def close_converting(self) -> None:
        """Drop the converting handle (and the pages read through it) once loading is done."""
        self._converting = None

    def maybe(self, name: str) -> torch.Tensor | None:
        return self.get(name) if self.has(name) else None

    def unused(self) -> list[str]:
        return sorted(set(self._where) - self.used)


# convert.py's Q8_0_FILE (not imported: that module pulls in the gguf package).
_Q8_0_FILE = "gguf-q8_0-blocks.st"


def _q8_0_blocks(path: Path) -> dict[str, Int8Weight]:
    """HF name -> Int8Weight of the Q8_0 projections a GGUF conversion kept undecoded (none for
    other checkpoints): `quantization: int8` takes them as they are, without requantizing."""
    file = path / _Q8_0_FILE
    if not file.is_file():
        return {}
    with safe_open(str(file), framework="pt") as f:
        names = {k.rsplit(".", 1)[0] for k in f.keys()}
        return {n: from_q8_0(f.get_tensor(n + ".codes"), f.get_tensor(n + ".scales")) for n in sorted(names)}


def _cat_int8(parts: list[Int8Weight]) -> Int8Weight:
    """Q8_0 weights fused as _cat fuses plain ones: rows (codes) and their scale columns."""
    return Int8Weight(torch.cat([p.qweight for p in parts], dim=0).contiguous(),
                      torch.cat([p.scales for p in parts], dim=1).contiguous(), parts[0].group_size)


# Multimodal Gemma 3: text decoder prefixes (as saved by transformers <= 4.51 and 5.x, and by
# 4.52-4.57) -> the text model's names; the vision parts are not read.
_TEXT_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                  ("model.language_model.", "model."), ("lm_head.", "lm_head."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def _text_model_name(stored: str) -> str | None:
    """A multimodal checkpoint's tensor name as the text decoder's, None for the vision parts;
    any other name stays as it is (and is refused as not understood if nothing reads it)."""
    if stored.startswith(_VISION_PREFIXES):
        return None
    for prefix, text in _TEXT_PREFIXES:
        if stored.startswith(prefix):
            return text + stored[len(prefix):]
    return stored


_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "self_attn.k_scale", "self_attn.v_scale", "self_attn.kv_scale")


def _cat(*parts: torch.Tensor | None) -> torch.Tensor | None:
    if all(p is None for p in parts):
        return None
    if any(p is None for p in parts):
        raise UnsupportedModel("checkpoint has biases on some but not all of q/k/v (or gate/up)")
    return torch.cat(parts, dim=0).contiguous()


Int8Quantizer = Callable[[str, Callable[[], torch.Tensor]], Int8Weight]
"""(key, full-precision weight getter) -> its int8 form. Keys: "layers.{i}.qkv", "layers.{i}.o",
"layers.{i}.gate_up", "layers.{i}.down" and "lm_head" (core/models/int8_calibration.py)."""


def round_to_nearest(key: str, weight: Callable[[], torch.Tensor]) -> Int8Weight:
    """The quantizer without a calibration run: per channel, each weight to its nearest code."""
    return quantize_per_channel(weight())


def load_decoder(path: Path, arch: ModelArch, dtype: torch.dtype, device: torch.device,
                 max_position: int, kernels: ModuleType, quantization: str | None = None,
                 int8_quantizer: Int8Quantizer = round_to_nearest) -> LlamaDecoder:
    """quantization: None, or "int8": every decoder projection, and the LM head too where
    INT8_LM_HEAD, quantized per output channel by `int8_quantizer` from the checkpoint's values in
    float32 (not from their model-dtype rounding: the int8 rounding then happens once); GGUF Q8_0
    projections are taken as stored."""
    ckpt = _Checkpoint(path, dtype, device, arch.multimodal_text)
    # The backend's packed linear layers where it has them (kernels/cpu: bf16 on AMX).
    prepack = getattr(kernels, "prepack_linear", None)
    int8 = quantization == "int8"
    prepack_int8 = getattr(kernels, "prepack_int8_linear", None)

    def linear(weight: torch.Tensor | Int8Weight, bias: torch.Tensor | None = None) -> Linear:
        return Linear(weight, bias, prepack=prepack, int8=int8, prepack_int8=prepack_int8, dtype=dtype)

    # GGUF Q8_0 projections, kept as stored where every part of a (fused) projection has them; a
    # projection mixing Q8_0 with other types is quantized per channel from its decoded values.
    q8_0 = _q8_0_blocks(path) if int8 else {}

    def read(names: list[str], dtype: torch.dtype | None = None) -> torch.Tensor:
        return ckpt.get(names[0], dtype) if len(names) == 1 else _cat(*(ckpt.get(n, dtype) for n in names))

    def weight(key: str, names: list[str]) -> torch.Tensor | Int8Weight:
        if names and all(n in q8_0 for n in names):
            ckpt.used.update(names)
            return q8_0[names[0]] if len(names) == 1 else _cat_int8([q8_0[n] for n in names])
        if int8:  # a quantizer with the result at hand (a cached calibration) reads nothing
            ckpt.used.update(names)
            return int8_quantizer(key, lambda: read(names, torch.float32))
        return read(names)

    def norm(name: str) -> torch.Tensor:
        w = ckpt.get(name)
        return (1.0 + w.float()).to(w.dtype) if arch.gemma_norms else w

    def fused(key: str, prefix: str, fused_name: str, parts: tuple[str, ...],
              suffix: str) -> torch.Tensor | Int8Weight | None:
        if arch.fused_checkpoint:
            return weight(key, [prefix + fused_name + suffix]) if suffix == ".weight" else ckpt.maybe(prefix + fused_name + suffix)
        if suffix == ".weight":
            return weight(key, [prefix + x + suffix for x in parts])
        return _cat(*(ckpt.maybe(prefix + x + suffix) for x in parts))

    layers = []
    for i in range(arch.num_layers):
        p, key = f"model.layers.{i}.", f"layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        qkv_parts, gate_up_parts = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")
        layers.append(LayerWeights(
            input_norm=norm(p + "input_layernorm.weight"),
            qkv=linear(fused(key + "qkv", attn, "qkv_proj", qkv_parts, ".weight"),
                       fused("", attn, "qkv_proj", qkv_parts, ".bias")),
            o=linear(weight(key + "o", [attn + "o_proj.weight"]), ckpt.maybe(attn + "o_proj.bias")),
            q_norm=norm(attn + "q_norm.weight") if arch.qk_norm else None,
            k_norm=norm(attn + "k_norm.weight") if arch.qk_norm else None,
            post_norm=norm(p + "post_attention_layernorm.weight"),
            gate_up=linear(fused(key + "gate_up", mlp, "gate_up_proj", gate_up_parts, ".weight"),
                           fused("", mlp, "gate_up_proj", gate_up_parts, ".bias")),
            down=linear(weight(key + "down", [mlp + "down_proj.weight"]), ckpt.maybe(mlp + "down_proj.bias")),
            pre_ff_norm=norm(p + "pre_feedforward_layernorm.weight") if arch.gemma_norms else None,
            post_ff_norm=norm(p + "post_feedforward_layernorm.weight") if arch.gemma_norms else None,
        ))
    embed = ckpt.get("model.embed_tokens.weight")
    head_name = ("model.embed_tokens.weight" if arch.tie_word_embeddings or not ckpt.has("lm_head.weight")
                 else "lm_head.weight")
    int8_lm_head = None
    if int8 and INT8_LM_HEAD:
        ckpt.used.add(head_name)
        int8_lm_head = int8_quantizer("lm_head", lambda: ckpt.get(head_name, torch.float32))
    if head_name == "model.embed_tokens.weight":
        lm_head = embed  # tied (the decoder then looks the embedding up from int8_lm_head's codes)
    else:
        lm_head = ckpt.get(head_name) if int8_lm_head is None else None
    final_norm = norm("model.norm.weight")
    # Rotary inverse-frequency buffers some exporters save are recomputed from the config; static
    # KV-cache scales are read by core/kv_cache/cache_tensors.py.
    leftovers = [n for n in ckpt.unused() if not n.endswith(_IGNORED_SUFFIXES) and n != "lm_head.weight"]
    if leftovers:
        raise UnsupportedModel(f"checkpoint tensors not understood: {leftovers[:5]} (total {len(leftovers)})")
    ckpt.close_converting()  # before the LM head is packed
    return LlamaDecoder(arch, embed, layers, final_norm, lm_head, max_position, kernels, int8_lm_head)
