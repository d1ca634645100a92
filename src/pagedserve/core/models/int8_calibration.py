"""`quantization: int8` with calibrated rounding: the codes chosen so that each layer's outputs move least.

Rounding every weight to its nearest int8 code is what costs per-channel int8 its accuracy on a small
model (docs/quantization.md: SmolLM2-135M's argmax agreement with fp32 95.5% against 97.6% for bf16).
Given the second moments of a projection's inputs, H = sum x x^T, error feedback (GPTQ; the numerics are
kernels/reference/int8_linear.py: error_feedback_codes) picks, weight by weight, whichever code leaves
the layer's output closest: the same format, scales and kernels, only other codes.

H comes from a calibration run: the first start of a model with `quantization: int8` starts the same
model unquantized in float32 (a second engine, built by the caller so that this module does not import
the engine; float32 so that H is the model's own, whatever dtype serves it), generates greedily from
CALIBRATION_PROMPTS (in the model's chat template where it has one) while every projection and the LM
head add their inputs to their H, and drops it. The codes and scales made from H are stored in the
cache folder (`$PAGEDSERVE_CACHE_DIR`, else ~/.cache/pagedserve) as
`int8/<model>-<digest of its files>-v<CALIBRATION_VERSION>.safetensors`; later starts, in any dtype,
read that file and run nothing. A cache that cannot be written costs the run on every start (a warning
says so); an unreadable file is calibrated again and replaced.
"""

from __future__ import annotations

import gc
import hashlib
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from pagedserve.core.models.gguf.cache import CACHE_ENV, content_digest, default_cache_root, file_stem
from pagedserve.core.sampling_params import SamplingParams
from pagedserve.kernels.reference.int8_linear import Int8Weight, quantize_per_channel

logger = logging.getLogger(__name__)

CALIBRATION_VERSION = 1
"""Bump when what a cached file holds changes (prompts, lengths, damping, keys): old files are then
ignored."""
CALIBRATION_TOKENS = 96
"""Greedy tokens generated per prompt (fewer where the model ends its answer)."""
# Everyday requests a chat model serves; none of them is among the prompts tests/test_int8_weights.py
# measures the agreement on (tests/test_kv_quant_e2e.py's PROMPTS), so the figure is not fitted.
CALIBRATION_PROMPTS = (
    "How does a rainbow form?", "Write a limerick about a lazy dog.", "What is the speed of light?",
    "Explain how vaccines work.", "Give three tips for a job interview.", "What is the capital of Japan?",
    "Describe the water cycle.", "Why do cats purr?", "What is an API in programming?",
    "Write a short story about a robot learning to paint.", "How do airplanes fly?",
    "List five fruits that are red.", "What is inflation in economics?", "Translate 'thank you' into French.",
    "How do I make a cup of tea?", "What is DNA?", "Summarize the causes of World War I.",
    "Write a Python function that reverses a string.", "What are the benefits of reading books?",
    "Explain gravity to a ten-year-old.", "What is the largest ocean?", "How does the internet work?",
    "Give me a packing list for a beach trip.", "What is a prime number?",
)


class _Recording:
    """A projection that keeps its inputs and then computes as it always does; their x^T x is added
    to sums[key] per FLUSH_ROWS rows (one matrix product for many decode steps: per step, the update
    of a 1536 x 1536 sum would cost more than the step)."""

    FLUSH_ROWS = 512

    def __init__(self, linear: Any, key: str, sums: dict[str, torch.Tensor]) -> None:
        self.linear, self.key, self.sums = linear, key, sums
        self.rows: list[torch.Tensor] = []
        self.count = 0

    def add(self, x: torch.Tensor) -> None:
        self.rows.append(x.reshape(-1, x.shape[-1]).clone())
        self.count += self.rows[-1].shape[0]
        if self.count >= self.FLUSH_ROWS:
            self.flush()

    def flush(self) -> None:
        if not self.rows:
            return
        rows = torch.cat(self.rows).float()
        self.rows, self.count = [], 0
        xtx = (rows.T @ rows).double()
        self.sums[self.key] = self.sums[self.key] + xtx if self.key in self.sums else xtx

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.add(x)
        return self.linear(x, *args, **kwargs)

    def act_and_mul(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.add(x)
        return self.linear.act_and_mul(x, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.linear, name)


PROJECTIONS = ("qkv", "o", "gate_up", "down")


def collect_hessians(engine: Any) -> dict[str, torch.Tensor]:
    """key -> sum x x^T (float64) of that projection's inputs while `engine` (an LLMEngine of the
    unquantized model) generates from CALIBRATION_PROMPTS. Keys as load_decoder's Int8Quantizer."""
    model = engine.runner.model
    sums: dict[str, torch.Tensor] = {}
    recordings = [_Recording(None, "lm_head", sums)]
    for i, layer in enumerate(model.layers):
        for name in PROJECTIONS:
            recordings.append(_Recording(getattr(layer, name), f"layers.{i}.{name}", sums))
            setattr(layer, name, recordings[-1])
    head = recordings[0]
    final_hidden = model.final_hidden

    def recorded_final_hidden(*args: Any) -> torch.Tensor:
        h = final_hidden(*args)  # the rows the LM head reads
        head.add(h)
        return h

    model.final_hidden = recorded_final_hidden
    chat = bool(engine.tokenizer.chat_template)
    prompts = [engine.tokenize(engine.apply_chat_template([{"role": "user", "content": p}]) if chat else p)
               for p in CALIBRATION_PROMPTS]
    # Within the model's context (a small model may have less than a prompt and CALIBRATION_TOKENS);
    # prompt_logprobs: the LM head then reads every prompt row too, not only each prompt's last.
    prompts = [p for p in prompts if len(p) < engine.max_model_len]
    engine.generate(prompts, [SamplingParams(max_tokens=min(CALIBRATION_TOKENS, engine.max_model_len - len(p)),
                                             temperature=0.0, prompt_logprobs=0) for p in prompts])
    for recording in recordings:
        recording.flush()
    return sums


class CalibratedQuantizer:
    """load_decoder's Int8Quantizer: from a cached file, or from a calibration run's H (then store())."""

    def __init__(self, file: Path, stored: dict[str, Int8Weight] | None = None,
                 hessians: dict[str, torch.Tensor] | None = None) -> None:
        self.file, self.stored, self.hessians = file, stored, hessians
        self.made: dict[str, Int8Weight] = {}

    def __call__(self, key: str, weight: Callable[[], torch.Tensor]) -> Int8Weight:
        if self.stored is not None:
            return self.stored[key]
        assert self.hessians is not None  # a projection the run never reached is rounded to nearest
        quantized = quantize_per_channel(weight(), self.hessians.pop(key, None))
        self.made[key] = quantized
        return quantized

    def store(self) -> None:
        """Write what this start quantized to self.file (atomically; a failure only warns)."""
        if not self.made:
            return
        tensors = {}
        for key, q in self.made.items():
            tensors[key + ".codes"], tensors[key + ".scales"] = q.qweight, q.scales
        tmp = None
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{self.file.name}.", dir=self.file.parent)
            os.close(fd)
            save_file(tensors, tmp, metadata={"calibration_version": str(CALIBRATION_VERSION)})
            os.chmod(tmp, 0o644)
            os.replace(tmp, self.file)
        except OSError as exc:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)  # e.g. a full disk: no half-written file left behind
            logger.warning("int8 calibration not cached (%s): every start recalibrates; set %s to a writable "
                           "folder", exc, CACHE_ENV)


def cache_file(model_path: Path) -> Path:
    """Where a model's calibrated int8 weights are kept: named after its files' contents."""
    digest = hashlib.sha256()
    for f in sorted(model_path.glob("*.safetensors")) + [model_path / "config.json"]:
        if f.is_file():
            digest.update(f"{f.name}:{content_digest(f)};".encode())
    name = f"{file_stem(model_path.name)}-{digest.hexdigest()[:16]}-v{CALIBRATION_VERSION}.safetensors"
    return default_cache_root() / "int8" / name


def _read(file: Path) -> dict[str, Int8Weight] | None:
    try:
        tensors = load_file(str(file))
    except Exception as exc:  # a truncated or foreign file: calibrate again, and replace it
        logger.warning("int8 calibration file %s unreadable (%s); calibrating again", file, exc)
        return None
    keys = {name.rsplit(".", 1)[0] for name in tensors}
    return {k: Int8Weight(tensors[k + ".codes"], tensors[k + ".scales"], tensors[k + ".codes"].shape[1])
            for k in keys}


def calibrated_quantizer(model_path: Path, start_unquantized: Callable[[], Any]) -> CalibratedQuantizer:
    """The cached quantizer of this model, else one from a calibration run on the engine that
    `start_unquantized()` builds (the same model, float32, no quantization), dropped before this returns."""
    file = cache_file(model_path)
    if file.is_file():
        stored = _read(file)
        if stored is not None:
            return CalibratedQuantizer(file, stored=stored)
    started = time.perf_counter()
    logger.warning("quantization int8: calibrating %s once (%d prompts through the float32 model, then "
                   "error-feedback rounding); later starts reuse %s", model_path, len(CALIBRATION_PROMPTS), file)
    engine = start_unquantized()
    hessians = collect_hessians(engine)
    del engine
    gc.collect()  # the engine's reference cycles hold the float32 model until a collection
    logger.info("int8 calibration run: %.1f s", time.perf_counter() - started)
    return CalibratedQuantizer(file, hessians=hessians)

