"""Read a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) into the pieces the
stacked weights take, checked against the base model.

The decoder fuses q/k/v and gate/up into one projection each (core/models/llama.py), so an adapter
on q_proj is a piece of the fused qkv projection: its A rows go to slice 0 of the projection's
stacked A, its B to the q rows of the stacked B (core/lora/slots.py). Phi-3's checkpoint is fused
already, and so are its adapters (qkv_proj, gate_up_proj): one piece over the whole output.

The scaling (lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora) is folded into B here, once,
so the forward computes y += (x @ A.T) @ B.T and nothing else.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedserve.core.errors import InvalidLoRAAdapter
from pagedserve.core.models.arch import ModelArch

PROJECTIONS = ("qkv", "o", "gate_up", "down")
"""The decoder's linear layers an adapter may change, in the order a layer runs them."""

# module name -> (projection, slice): slice i of a fused projection (q, k, v / gate, up); None: all of it.
_SPLIT_TARGETS = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
                  "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}
_FUSED_TARGETS = {"qkv_proj": ("qkv", None), "o_proj": ("o", 0), "gate_up_proj": ("gate_up", None),
                  "down_proj": ("down", 0)}
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")
_REFUSED_MODULES = {"embed_tokens": "the embedding", "lm_head": "the LM head"}


@dataclass(frozen=True)
class ProjectionShape:
    in_features: int
    slices: tuple[tuple[int, int], ...]
    """(first output row, rows) of each part of a fused projection: q, k, v or gate, up."""

    @property
    def out_features(self) -> int:
        return sum(n for _, n in self.slices)


def projection_shapes(arch: ModelArch) -> dict[str, ProjectionShape]:
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    h, i = arch.hidden_size, arch.intermediate_size
    return {"qkv": ProjectionShape(h, ((0, q), (q, kv), (q + kv, kv))), "o": ProjectionShape(q, ((0, h),)),
            "gate_up": ProjectionShape(h, ((0, i), (i, i))), "down": ProjectionShape(i, ((0, h),))}


@dataclass(frozen=True)
class LoRAPiece:
    """One adapted module of one layer: y[:, rows] += (x @ a.T) @ b.T, rows = out_offset + [0, b.shape[0])."""

    layer: int
    projection: str
    slice: int
    out_offset: int
    a: torch.Tensor
    """[r, in_features]"""
    b: torch.Tensor
    """[rows, r], the scaling folded in"""


@dataclass(frozen=True)
class LoRAWeights:
    pieces: tuple[LoRAPiece, ...]
    rank: int
    """The largest rank of any piece."""

    @property
    def projections(self) -> frozenset[str]:
        return frozenset(p.projection for p in self.pieces)


def _bad(path: Path, what: str) -> InvalidLoRAAdapter:
    return InvalidLoRAAdapter(f"LoRA adapter {path}: {what}", param="lora_path")


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise _bad(path, "no such directory; give the directory PEFT's save_pretrained wrote")
    try:
        config = json.loads((path / "adapter_config.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise _bad(path, "has no adapter_config.json; give the directory PEFT's save_pretrained wrote") from None
    except (OSError, ValueError) as exc:
        raise _bad(path, f"adapter_config.json cannot be read ({exc}); save the adapter again") from None
    if not isinstance(config, dict):
        raise _bad(path, "adapter_config.json is not a JSON object; save the adapter again")
    return config


def _check_config(path: Path, config: dict[str, Any], max_rank: int) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise _bad(path, f"peft_type={config.get('peft_type')!r}: only LoRA adapters (peft_type LORA) are served")
    if config.get("use_dora"):
        raise _bad(path, "use_dora=true: DoRA adapters are not supported; serve a plain LoRA (use_dora=false)")
    if config.get("modules_to_save"):
        raise _bad(path, f"modules_to_save={config['modules_to_save']!r}: adapters that replace whole modules "
                         "are not supported; train with modules_to_save=None")
    if config.get("bias", "none") != "none" or config.get("lora_bias"):
        raise _bad(path, "trains biases (bias / lora_bias): not supported; train with bias='none'")
    if config.get("fan_in_fan_out"):
        raise _bad(path, "fan_in_fan_out=true (Conv1D layers): not supported for the Llama-family decoders served")
    if config.get("alpha_pattern"):
        raise _bad(path, "alpha_pattern (a lora_alpha per module) is not supported; use one lora_alpha")
    targets = config.get("target_modules") or ()
    for name in [targets] if isinstance(targets, str) else targets:
        for refused, what in _REFUSED_MODULES.items():
            if refused in str(name):
                raise _bad(path, f"target_modules has {name!r} ({what}): only the attention and MLP projections "
                                 "(q/k/v/o_proj, gate/up/down_proj) can be served")
    r = config.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise _bad(path, f"adapter_config.json: r={r!r} is not a positive integer")
    if r > max_rank:
        raise _bad(path, f"rank r={r} exceeds max_lora_rank={max_rank}; start the engine with --max-lora-rank {r} "
                         "or higher")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise _bad(path, f"adapter_config.json: lora_alpha={alpha!r} is not a number")


def load_peft_adapter(path: str | Path, arch: ModelArch, dtype: torch.dtype, max_rank: int) -> LoRAWeights:
    """The adapter's pieces in `dtype` on the CPU, or InvalidLoRAAdapter naming what is wrong and the fix."""
    from safetensors.torch import load_file

    path = Path(path)
    config = _read_config(path)
    _check_config(path, config, max_rank)
    file = path / "adapter_model.safetensors"
    if not file.is_file():
        also = " (adapter_model.bin is not read: save with safe_serialization=True)" if (
            path / "adapter_model.bin").exists() else ""
        raise _bad(path, f"has no adapter_model.safetensors{also}")
    try:
        tensors = load_file(str(file))
    except Exception as exc:  # noqa: BLE001 - safetensors raises several types for a damaged file
        raise _bad(path, f"adapter_model.safetensors cannot be read ({exc}); save the adapter again") from None
    targets = _FUSED_TARGETS if arch.fused_checkpoint else _SPLIT_TARGETS
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise _bad(path, _unservable_key(key))
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in targets:
            raise _bad(path, f"targets {module!r} (tensor {key}); this model's adaptable modules are "
                             f"{', '.join(targets)}")
        if layer >= arch.num_layers:
            raise _bad(path, f"tensor {key} is for layer {layer} but the base model has {arch.num_layers} layers: "
                             "the adapter was trained for another base model")
        pairs.setdefault((layer, module), {})[ab] = tensor
    if not pairs:
        raise _bad(path, "adapter_model.safetensors holds no LoRA weights")
    scale = _alpha(config)
    shapes = projection_shapes(arch)
    pieces = [_piece(path, layer, module, ab, targets[module], shapes, scale, dtype, max_rank)
              for (layer, module), ab in sorted(pairs.items())]
    return LoRAWeights(tuple(pieces), max(p.a.shape[0] for p in pieces))


def _alpha(config: dict[str, Any]) -> tuple[float, bool]:
    """(lora_alpha, use_rslora): _piece scales by the rank the piece actually has, as PEFT does
    (rank_pattern may give modules ranks of their own)."""
    return float(config.get("lora_alpha", 8)), bool(config.get("use_rslora"))


def _piece(path: Path, layer: int, module: str, ab: dict[str, torch.Tensor], target: tuple[str, int | None],
           shapes: dict[str, ProjectionShape], scale: tuple[float, bool], dtype: torch.dtype, max_rank: int) -> LoRAPiece:
    where = f"layers.{layer}.{module}"
    if set(ab) != {"A", "B"}:
        raise _bad(path, f"{where} has lora_{''.join(ab)} without its pair; save the adapter again")
    a, b = ab["A"], ab["B"]
    projection, slice_index = target
    shape = shapes[projection]
    out_offset, rows = (0, shape.out_features) if slice_index is None else shape.slices[slice_index]
    r = a.shape[0]
    if a.dim() != 2 or b.dim() != 2 or b.shape[1] != r:
        raise _bad(path, f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are not a rank-r pair")
    if r > max_rank:
        raise _bad(path, f"{where} has rank {r}, more than max_lora_rank={max_rank}; start the engine with "
                         f"--max-lora-rank {r} or higher")
    if a.shape[1] != shape.in_features or b.shape[0] != rows:
        raise _bad(path, f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the base model's "
                         f"{module} ({shape.in_features} in, {rows} out): the adapter was trained for another "
                         "base model")
    alpha, rslora = scale
    scaling = alpha / math.sqrt(r) if rslora else alpha / r
    return LoRAPiece(layer, projection, 0 if slice_index is None else slice_index, out_offset,
                     a.to(dtype).contiguous(), (b.float() * scaling).to(dtype).contiguous())


def _unservable_key(key: str) -> str:
    if "lora_magnitude_vector" in key:
        return f"holds DoRA magnitudes ({key}): DoRA adapters are not supported"
    if "lora_embedding" in key or "embed_tokens" in key:
        return f"adapts the embedding ({key}): only the attention and MLP projections can be served"
    if "lm_head" in key:
        return f"adapts the LM head ({key}): only the attention and MLP projections can be served"
    if "modules_to_save" in key:
        return f"replaces a whole module ({key}, modules_to_save): not supported"
    return (f"tensor {key} is not a LoRA weight of an attention or MLP projection of a Llama-family decoder "
            "(model.layers.N.self_attn|mlp.MODULE.lora_A|lora_B.weight)")
