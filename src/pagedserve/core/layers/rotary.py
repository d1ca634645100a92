"""Rotary position embeddings with the scaling variants Hugging Face configs use.

Types: default, linear, llama3, yarn (Qwen2.5 / Qwen3 past 32k), dynamic (NTK), longrope (Phi-3 /
Phi-3.5 / Phi-4-mini), each with an optional partial_rotary_factor (only the first
int(head_dim * factor) dims of a head rotate). The inverse frequencies are transformers'
(modeling_rope_utils.ROPE_INIT_FUNCTIONS) computed the same way, down to where transformers
computes in float64 on the host and where in float32 tensors; tests/test_rope_scaling.py holds
them equal bit for bit.

cos/sin are precomputed once in fp32 for every position, scaled by the type's attention factor
(yarn's and longrope's mscale) and cast to the model dtype once; the kernels gather them per forward
by row index, which is Hugging Face's arithmetic (positions * inv_freq in fp32, then cos/sin, times
the factor, then a cast), so greedy outputs stay token-exact. The rotation itself is
kernels/reference/layers.apply_rotary.

Two types depend on the sequence's length, because transformers recomputes their frequencies from
the longest position of each forward (`dynamic_rope_update`): longrope switches from the short
factors to the long ones once that length passes original_max_position_embeddings, and dynamic NTK
raises the base once it passes max_position_embeddings. In generate() that length is the prompt's
for every prompt token and position + 1 for each new token, and K/V keep the rotation they were
computed with. RotaryEmbedding.rows() follows exactly that rule per token from
ForwardBatch.rope_lengths, so chunked prefill, batching and preemption give the same rotation as
transformers; `prefix_cache_key` says which prompt lengths may share cached blocks.

Dynamic NTK: rope_lengths = max(prompt length, position + 1). Longrope: rope_lengths = the
sample's current length (prompt + outputs), because Phi-3's generate() does not keep short-factor
K/V past the switch: when a sequence that started at or under original_max_position_embeddings
grows past it, transformers discards its cache and recomputes every token with the long factors
(Phi3ForCausalLM.prepare_inputs_for_generation). The scheduler does the same (`switch_length`:
it restarts such a sample from position 0 under the long factors' prefix-cache key), so every
token a sample computes uses the factors of its length at that moment, as in transformers. vLLM
instead picks one factor set per request from its prompt length plus max_tokens and never
switches (docs/models.md).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from pagedserve.core.errors import UnsupportedModel

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")
_LENGTH_DEPENDENT = ("dynamic", "longrope")


def rope_type_of(params: dict[str, Any] | None) -> str:
    params = params or {}
    return params.get("rope_type", params.get("type", "default")) or "default"


def rotary_dim(head_dim: int, params: dict[str, Any] | None) -> int:
    """Dims of a head that rotate: int(head_dim * partial_rotary_factor), as transformers."""
    return int(head_dim * float((params or {}).get("partial_rotary_factor", 1.0) or 1.0))


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are stretched by `factor`, short ones kept, the band between interpolated.
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _yarn(base: float, dim: int, params: dict[str, Any], max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """YaRN: high frequencies extrapolated, low ones interpolated by `factor`, a linear ramp between
    (beta_fast / beta_slow rotations), and cos/sin scaled by the attention factor (mscale)."""
    factor = params.get("factor")
    original = params["original_max_position_embeddings"]
    if factor is None:
        factor = max_position_embeddings / original

    def get_mscale(scale: float, mscale: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1 where the frequency is extrapolated (kept as trained)
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor


def _longrope_attention_factor(params: dict[str, Any], max_position_embeddings: int) -> float:
    original = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:  # Phi-3 states the ratio through max_position_embeddings instead
        factor = max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return attention_factor


def _longrope_inv_freq(base: float, dim: int, ext_factors: list[float]) -> torch.Tensor:
    if len(ext_factors) != dim // 2:
        raise UnsupportedModel(f"longrope factors have {len(ext_factors)} entries; rotary dim {dim} needs {dim // 2}")
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(ext_factors, dtype=torch.float32) * base**shape)


def _dynamic_inv_freq(base: float, dim: int, factor: float, max_position_embeddings: int, seq_len: int) -> torch.Tensor:
    """NTK-aware base for a sequence of seq_len tokens. transformers computes it from a 0-dim int64
    tensor (torch.max(position_ids) + 1), so the new base is a float32 tensor: the same here."""
    length = torch.maximum(torch.tensor(seq_len), torch.tensor(max_position_embeddings))
    new_base = base * ((factor * length / max_position_embeddings) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (new_base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))


def compute_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None,
                     max_position_embeddings: int | None = None, seq_len: int | None = None
                     ) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim // 2] fp32, attention factor) as transformers' rope init function of
    the type computes them; seq_len: the length the frequencies are for (dynamic, longrope), None
    for the frequencies transformers starts with."""
    params = dict(rope_scaling or {})
    rope_type = rope_type_of(params)
    base = float(params.get("rope_theta") or rope_theta)
    dim = rotary_dim(head_dim, params)
    if rope_type == "default":
        return _default_inv_freq(base, dim), 1.0
    if rope_type == "linear":
        return _default_inv_freq(base, dim) / params["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(_default_inv_freq(base, dim), params), 1.0
    if rope_type == "yarn":
        return _yarn(base, dim, params, _need(max_position_embeddings))
    if rope_type == "longrope":
        long = seq_len is not None and seq_len > params["original_max_position_embeddings"]
        factors = params["long_factor"] if long else params["short_factor"]
        return _longrope_inv_freq(base, dim, factors), _longrope_attention_factor(params, _need(max_position_embeddings))
    if rope_type == "dynamic":
        max_pos = _need(max_position_embeddings)
        if seq_len is None or seq_len <= max_pos:
            return _default_inv_freq(base, dim), 1.0
        return _dynamic_inv_freq(base, dim, params["factor"], max_pos, seq_len), 1.0
    raise UnsupportedModel(
        f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)}); "
        "remove rope_scaling from config.json to run at the native context length"
    )


def _need(max_position_embeddings: int | None) -> int:
    assert max_position_embeddings is not None, "this rope type needs max_position_embeddings"
    return max_position_embeddings


def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * attention_factor, emb.sin() * attention_factor


class RotaryEmbedding:
    """cos/sin of one rope configuration, in the model dtype, for positions [0, max_position)."""

    def __init__(self, head_dim: int, max_position: int, rope_theta: float, rope_scaling: dict[str, Any] | None,
                 device: torch.device, max_position_embeddings: int | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        self.params = dict(rope_scaling or {})
        self.rope_type = rope_type_of(self.params)
        self.head_dim, self.rope_theta, self.dtype, self.device = head_dim, rope_theta, dtype, device
        self.rotary_dim = rotary_dim(head_dim, self.params)
        self.max_position = max_position
        self.max_position_embeddings = max_position_embeddings or max_position
        positions = torch.arange(max_position)
        inv_freq, factor = compute_inv_freq(head_dim, rope_theta, self.params, self.max_position_embeddings)
        cos, sin = _cos_sin(positions, inv_freq, factor)
        if self.rope_type == "longrope":
            # Rows [max_position, 2 * max_position): the long factors' table, for tokens of
            # sequences past original_max_position_embeddings (rows() picks the half).
            long_freq, _ = compute_inv_freq(head_dim, rope_theta, self.params, self.max_position_embeddings,
                                            seq_len=self.params["original_max_position_embeddings"] + 1)
            long_cos, long_sin = _cos_sin(positions, long_freq, factor)
            cos, sin = torch.cat((cos, long_cos)), torch.cat((sin, long_sin))
        self.cos = cos.to(device=device, dtype=dtype).contiguous()
        self.sin = sin.to(device=device, dtype=dtype).contiguous()

    @property
    def switch_length(self) -> int | None:
        """Longrope: original_max_position_embeddings, the longest sequence on the short factors (a
        sample growing past it recomputes its K/V on the long ones, see the module docstring)."""
        return self.params["original_max_position_embeddings"] if self.rope_type == "longrope" else None

    @property
    def length_dependent(self) -> bool:
        """Whether a token's rotation depends on its sequence's length (see the module docstring)."""
        return self.rope_type in _LENGTH_DEPENDENT

    def prefix_cache_key(self, prompt_len: int) -> str | None:
        """What must also match for two prompts to share cached K/V: None when the rotation of a
        prompt's tokens does not depend on its length."""
        if self.rope_type == "longrope" and prompt_len > self.params["original_max_position_embeddings"]:
            return "longrope:long"
        if self.rope_type == "dynamic" and prompt_len > self.max_position_embeddings:
            return f"dynamic:{prompt_len}"
        return None

    def rows(self, positions: torch.Tensor, rope_lengths: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cos, sin, index) for one forward: token i rotates by cos[index[i]], sin[index[i]].
        rope_lengths: per token, its sample's length as the module docstring defines it
        (length-dependent types only)."""
        if self.rope_type == "longrope":
            assert rope_lengths is not None, "longrope needs the batch's rope_lengths"
            long = rope_lengths > self.params["original_max_position_embeddings"]
            return self.cos, self.sin, positions + long.to(positions.dtype) * self.max_position
        if self.rope_type != "dynamic" or rope_lengths is None or not bool(
                (rope_lengths > self.max_position_embeddings).any()):
            return self.cos, self.sin, positions
        # Dynamic NTK past max_position_embeddings: each distinct length has its own base; the rows
        # are computed for this forward's tokens only (index = 0..n-1).
        cos = torch.empty((positions.shape[0], self.cos.shape[1]), dtype=self.dtype, device=positions.device)
        sin = torch.empty_like(cos)
        for length in torch.unique(rope_lengths).tolist():
            sel = rope_lengths == length
            inv_freq, factor = compute_inv_freq(self.head_dim, self.rope_theta, self.params,
                                                self.max_position_embeddings, seq_len=int(length))
            c, s = _cos_sin(positions[sel].cpu(), inv_freq, factor)
            cos[sel], sin[sel] = c.to(cos), s.to(sin)
        return cos, sin, torch.arange(positions.shape[0], device=positions.device)
