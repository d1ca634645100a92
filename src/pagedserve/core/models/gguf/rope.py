"""RoPE scaling from GGUF metadata (and the factor tensors llama.cpp stores) -> HF `rope_scaling`.

llama.cpp keeps linear and YaRN scaling as `<arch>.rope.scaling.*` keys, but stores Llama 3's and
Phi-3's frequency factors as tensors (`rope_freqs`, `rope_factors_long/short`). Anything this module
cannot restore exactly is refused rather than served with the wrong positions.
"""

from __future__ import annotations

import math

import numpy as np

from pagedserve.core.errors import UnsupportedModel
from pagedserve.core.models.gguf.metadata import f32, field

# The Llama 3.1-3.3 constants (their config.json rope_scaling); rope_freqs is checked against them.
_LLAMA3_LOW, _LLAMA3_HIGH, _LLAMA3_ORIGINAL = 1.0, 4.0, 8192


def rope_scaling(reader, arch: str, config: dict, tensors: dict) -> dict | None:
    key = lambda name, default=None: field(reader, f"{arch}.rope.scaling.{name}", default)  # noqa: E731
    kind = key("type", "none")
    if "rope_factors_long.weight" in tensors:
        return _longrope(reader, arch, config, tensors)
    if "rope_freqs.weight" in tensors:
        return _llama3(reader, arch, config, tensors)
    if kind == "none":
        return None
    factor = f32(key("factor", 1.0))
    if kind == "linear":
        return None if factor == 1.0 else {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        scaling = {"rope_type": "yarn", "factor": factor}
        original = key("original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        for gguf_name, hf_name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            value = field(reader, f"{arch}.rope.scaling.{gguf_name}")
            if value is not None:
                scaling[hf_name] = f32(value)
        return scaling
    raise UnsupportedModel(
        f"GGUF {arch}.rope.scaling.type={kind!r} is not supported; pagedserve converts none, linear, "
        "yarn, Llama 3 rope_freqs and Phi-3 longrope factors"
    )


def _values(tensor) -> list[float]:
    return [f32(v) for v in np.asarray(tensor.data, dtype=np.float32).reshape(-1)]


def _longrope(reader, arch: str, config: dict, tensors: dict) -> dict:
    if "rope_factors_short.weight" not in tensors:
        raise UnsupportedModel("GGUF has rope_factors_long but no rope_factors_short; cannot rebuild longrope")
    original = field(reader, f"{arch}.rope.scaling.original_context_length")
    if original is None:
        raise UnsupportedModel(f"GGUF has longrope factors but no {arch}.rope.scaling.original_context_length")
    return {
        "rope_type": "longrope",
        "long_factor": _values(tensors["rope_factors_long.weight"]),
        "short_factor": _values(tensors["rope_factors_short.weight"]),
        "original_max_position_embeddings": int(original),
    }


def llama3_factors(head_dim: int, theta: float, factor: float, low: float, high: float, original: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp's convert_hf_to_gguf.py writes as `rope_freqs`."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    low_wavelen, high_wavelen = original / low, original / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def _llama3(reader, arch: str, config: dict, tensors: dict) -> dict:
    stored = np.asarray(tensors["rope_freqs.weight"].data, dtype=np.float32).reshape(-1)
    factor = f32(float(stored.max()))
    theta = float(field(reader, f"{arch}.rope.freq_base", 10000.0))
    expected = llama3_factors(config["head_dim"], theta, factor, _LLAMA3_LOW, _LLAMA3_HIGH, _LLAMA3_ORIGINAL)
    if stored.shape != expected.shape or not np.allclose(stored, expected, rtol=1e-5, atol=1e-6):
        raise UnsupportedModel(
            "GGUF rope_freqs do not match Llama 3's rope scaling (low_freq_factor=1, high_freq_factor=4, "
            "original_max_position_embeddings=8192) for any factor; this RoPE variant is not supported"
        )
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": _LLAMA3_LOW,
        "high_freq_factor": _LLAMA3_HIGH,
        "original_max_position_embeddings": _LLAMA3_ORIGINAL,
    }
