"""ModelArch: the few numbers the decoder needs, read from a Hugging Face config.json.

One decoder (core/models/llama.py) runs every supported family; what differs is said here:
Llama / Mistral / Qwen2 / Qwen3 (pre-norm blocks, SiLU MLP), Gemma 2 / Gemma 3 text (four norms
per layer computing weight * (1 + w), embeddings times sqrt(hidden_size), tanh-GELU MLP, scores
scaled by query_pre_attn_scalar ** -0.5, sliding-window layers in a pattern; Gemma 2 softcaps
attention and final logits, Gemma 3 normalises q and k and gives its sliding layers their own
rope) and Phi-3 (fused qkv_proj / gate_up_proj in the checkpoint, longrope, partial rotary).
Gemma3ForConditionalGeneration (the multimodal Gemma 3) runs as its text decoder, from text_config.
A config feature the decoder does not implement raises UnsupportedModel naming it.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

from pagedserve.core.errors import UnsupportedModel
from pagedserve.core.layers.rotary import SUPPORTED_ROPE_TYPES, rope_type_of

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
)
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


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
    """The rope parameters (transformers' rope_parameters: rope_type, rope_theta, scaling keys,
    partial_rotary_factor) of full-attention layers; None for plain rope."""
    local_rope_scaling: dict[str, Any] | None
    """Gemma 3: the rope parameters of its sliding-window layers (their own theta, 10k); None when
    every layer uses rope_scaling."""
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
    hidden_act: str = "silu"
    """silu, or gelu_pytorch_tanh (Gemma)."""
    gemma_norms: bool = False
    """Gemma: every RMSNorm multiplies by (1 + weight); four norms per layer (post-attention and
    pre/post-feedforward beside the input norm); embeddings scaled by sqrt(hidden_size)."""
    attn_scale: float | None = None
    """Scores' scale; None: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)."""
    attn_softcap: float | None = None
    """Gemma 2: scores become tanh(s / c) * c before the softmax."""
    final_softcap: float | None = None
    """Gemma 2: logits become tanh(l / c) * c."""
    fused_checkpoint: bool = False
    """Phi-3: the checkpoint stores qkv_proj and gate_up_proj already fused."""
    multimodal_text: bool = False
    """Gemma3ForConditionalGeneration: the text decoder of a multimodal checkpoint (its weights
    under language_model.*, the vision tower's left unread; the loader maps the names)."""
    image_token_id: int | None = None
    """The multimodal checkpoint's image placeholder token (image_token_index): prompts holding it
    are refused, since no vision tower runs to fill it."""

    @property
    def rope_extends_context(self) -> bool:
        """Whether the rope is scaled (any type but default), so max_model_len may pass max_position_embeddings."""
        return rope_type_of(self.rope_scaling) != "default"

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "ModelArch":
        archs = list(getattr(cfg, "architectures", None) or [])
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None and "Gemma3ForConditionalGeneration" in archs:
            return _gemma3_text_of_multimodal(cls, cfg)
        if arch is None:
            raise UnsupportedModel(
                f"architectures={archs} is not supported; pagedserve runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        gemma = arch in _GEMMA
        act = (getattr(cfg, "hidden_activation", None) if gemma else None) or getattr(cfg, "hidden_act", "silu")
        if act not in _ACTIVATIONS:
            raise UnsupportedModel(f"hidden_act={act!r} is not supported (supported: {', '.join(_ACTIVATIONS)})")
        _refuse_unsupported(cfg, arch)
        num_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
        local_rope = None
        if rope and "full_attention" in rope:  # per layer type (Gemma 3)
            local_rope = dict(rope.get("sliding_attention") or {}) or None
            rope = rope["full_attention"]
        rope_theta = getattr(cfg, "rope_theta", None) or (rope or {}).get("rope_theta", 10000.0)
        for params in (rope, local_rope):
            if rope_type_of(params) not in SUPPORTED_ROPE_TYPES:
                raise UnsupportedModel(
                    f"rope type {rope_type_of(params)!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
        eos = getattr(cfg, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        pre_attn = getattr(cfg, "query_pre_attn_scalar", None) if gemma else None
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
            local_rope_scaling=local_rope,
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or bool(getattr(cfg, "attention_bias", False)),
            o_bias=not is_qwen2 and bool(getattr(cfg, "attention_bias", False)),
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
            sliding_windows=_sliding_windows(cfg, arch),
            eos_token_ids=eos_ids,
            bos_token_id=getattr(cfg, "bos_token_id", None),
            hidden_act=act,
            gemma_norms=gemma,
            attn_scale=float(pre_attn) ** -0.5 if pre_attn else None,
            attn_softcap=getattr(cfg, "attn_logit_softcapping", None) if gemma else None,
            final_softcap=getattr(cfg, "final_logit_softcapping", None) if gemma else None,
            fused_checkpoint=arch == "Phi3ForCausalLM",
        )


def _gemma3_text_of_multimodal(cls, cfg: Any) -> ModelArch:
    """Gemma 3 4B/12B/27B (Gemma3ForConditionalGeneration): its text decoder, which is
    Gemma3ForCausalLM's, configured by the nested text_config. Token ids the top level sets (eos,
    bos) win over text_config's, as in the checkpoints Google publishes ([1, 106]: <eos>,
    <end_of_turn>)."""
    text = getattr(cfg, "text_config", None)
    if text is None:
        raise UnsupportedModel("Gemma3ForConditionalGeneration config.json has no text_config; cannot find its "
                               "text decoder")
    text = copy.deepcopy(text)
    text.architectures = ["Gemma3ForCausalLM"]
    for name in ("eos_token_id", "bos_token_id"):
        if getattr(cfg, name, None) is not None:
            setattr(text, name, getattr(cfg, name))
    image_token = getattr(cfg, "image_token_index", None)
    if image_token is None:
        image_token = getattr(cfg, "image_token_id", None)
    return dataclasses.replace(cls.from_hf_config(text), architecture="Gemma3ForConditionalGeneration",
                               multimodal_text=True, image_token_id=image_token)


def _refuse_unsupported(cfg: Any, arch: str) -> None:
    """Config features that would change the outputs but that the decoder does not implement."""
    unsupported = []
    if getattr(cfg, "use_bidirectional_attention", False):
        unsupported.append("use_bidirectional_attention=True (Gemma 3 embedding models)")
    if arch not in _GEMMA:
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(cfg, name, None) is not None:
                unsupported.append(f"{name}={getattr(cfg, name)} on {arch}")
    if unsupported:
        raise UnsupportedModel(f"config.json sets what pagedserve does not implement: {'; '.join(unsupported)}")


def _sliding_windows(cfg: Any, arch: str) -> tuple[int | None, ...]:
    n = cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types:  # newer configs spell it out per layer
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if arch in ("MistralForCausalLM", "Phi3ForCausalLM"):  # every layer, when the config sets a window
        return (window,) * n
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and getattr(cfg, "use_sliding_window", False):
        first = getattr(cfg, "max_window_layers", n)
        return tuple(window if i >= first else None for i in range(n))
    return (None,) * n
