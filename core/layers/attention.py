"""Choose the attention kernel pair (reshape_and_cache + paged_attention) for a device."""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from pagedserve.core.errors import ConfigError


def select_attention_backend(name: str, device: torch.device) -> ModuleType:
    """auto: Triton kernels on CUDA, the pure-torch reference elsewhere."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "reference"
    if name == "triton" and device.type != "cuda":
        raise ConfigError("attention_backend='triton' needs a CUDA device; use 'reference' (or 'auto') on CPU")
    if name == "reference":
        return importlib.import_module("pagedserve.kernels.reference")
    try:
        return importlib.import_module("pagedserve.kernels.triton")
    except ImportError as exc:
        raise ConfigError(f"attention_backend='triton' is unavailable ({exc}); pip install triton") from exc
