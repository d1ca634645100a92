"""ModelArch: the few numbers the decoder needs, read from a Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.core.errors import UnsupportedModel

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


@dataclass(frozen=True)
class ModelArch:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    """Qwen2/2.5 (and Llama with attention_bias) add a bias to q, k and v."""
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    """Qwen3 RMS-normalises q and k per head before RoPE."""
    sliding_windows: tuple[int | None, ...]
    """Per layer: attention window in tokens, or None for full attention."""
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "ModelArch":
        archs = list(getattr(cfg, "architectures", None) or [])
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModel(
                f"architectures={archs} is not supported; pagedserve runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModel(f"hidden_act={act!r} is not supported (only silu)")
        num_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
        rope_theta = getattr(cfg, "rope_theta", None) or (rope or {}).get("rope_theta", 10000.0)
        eos = getattr(cfg, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        return cls(
            architecture=arch,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=float(rope_theta),
            rope_scaling=dict(rope) if rope else None,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or bool(getattr(cfg, "attention_bias", False)),
            o_bias=not is_qwen2 and bool(getattr(cfg, "attention_bias", False)),
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            sliding_windows=_sliding_windows(cfg, arch),
            eos_token_ids=eos_ids,
            bos_token_id=getattr(cfg, "bos_token_id", None),
        )


def _sliding_windows(cfg: Any, arch: str) -> tuple[int | None, ...]:
    n = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types:  # newer configs spell it out per layer
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if arch == "MistralForCausalLM":
        return (window,) * n
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and getattr(cfg, "use_sliding_window", False):
        first = getattr(cfg, "max_window_layers", n)
        return tuple(window if i >= first else None for i in range(n))
    return (None,) * n
