"""Choose the kernel backend for a device: the module whose paged_attention, reshape_and_cache and
decoder-layer ops (rms_norm, add_rms_norm, silu_and_mul, rotary_qkv) the model calls."""

from __future__ import annotations

import importlib
import logging
from types import ModuleType

import torch

from pagedserve.core.errors import ConfigError

logger = logging.getLogger(__name__)


def select_attention_backend(name: str, device: torch.device) -> ModuleType:
    """auto: Triton kernels on CUDA; on CPU the C++ kernels, falling back to the pure-torch
    reference (with a warning) where they cannot be built, e.g. no compiler in the image."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "cpu-or-reference"
    if name in ("triton", "cpu") and (device.type == "cuda") != (name == "triton"):
        raise ConfigError(f"attention_backend={name!r} does not run on {device.type}; use 'auto'")
    if name == "reference":
        return importlib.import_module("pagedserve.kernels.reference")
    if name in ("cpu", "cpu-or-reference"):
        from pagedserve.kernels.cpu import CpuKernelsUnavailable, load_extension

        try:
            load_extension()
        except CpuKernelsUnavailable as exc:
            if name == "cpu":
                raise ConfigError(f"attention_backend='cpu': {exc}") from exc
            logger.warning("using the pure-torch attention (slower): %s", exc)
            return importlib.import_module("pagedserve.kernels.reference")
        return importlib.import_module("pagedserve.kernels.cpu")
    try:
        return importlib.import_module("pagedserve.kernels.triton")
    except ImportError as exc:
        raise ConfigError(f"attention_backend='triton' is unavailable ({exc}); pip install triton") from exc
