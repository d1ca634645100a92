"""core/models/int8_calibration.py: `quantization: int8`'s calibration run, its cache file, and what
happens when the cache is missing, stale, unreadable or unwritable. The numerics of the rounding are
tests/kernels/test_int8_error_feedback.py; the engine computing what its codes say,
tests/test_int8_weights.py (transformers on the dequantized codes); SmolLM2's accuracy, there too."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.core.config import EngineConfig
from pagedserve.core.engine import LLMEngine
from pagedserve.core.models import int8_calibration as calibration
from pagedserve.core.sampling_params import SamplingParams
from pagedserve.kernels.reference.int8_linear import quantize_per_channel

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 33, 2, 71, 8], [44, 45, 46]]


def int8_engine(path, dtype: str = "float32") -> LLMEngine:
    # The reference backend: its layers keep their Int8Weight (the CPU kernels keep only their packing).
    return LLMEngine(EngineConfig.from_dict({"model": str(path), "dtype": dtype, "quantization": "int8",
                                             "attention_backend": "reference", "kv_cache_memory": 1 << 22}))


def codes(engine: LLMEngine):
    model = engine.runner.model
    return [getattr(layer, name).kernel.int8_weight for layer in model.layers for name in calibration.PROJECTIONS] + [
        model.lm_head[0].kernel.int8_weight]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_first_start_calibrates_and_later_starts_read_the_file(tiny_model_dir, cache, monkeypatch):
    path = tiny_model_dir("llama3")
    first = int8_engine(path)
    file = calibration.cache_file(path)
    assert file.is_file() and file.parent == cache / "int8"
    # Calibrated: the scales are round-to-nearest's, the codes are not all its codes.
    q_proj = load_file(str(path / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"]
    qkv = first.runner.model.layers[0].qkv.kernel.int8_weight
    nearest = quantize_per_channel(q_proj)
    assert torch.equal(qkv.scales[:, :q_proj.shape[0]], nearest.scales)
    assert not torch.equal(qkv.qweight[:q_proj.shape[0]], nearest.qweight)
    tokens = [o.token_ids for o in first.generate(PROMPTS, GREEDY)]

    def no_second_run():
        raise AssertionError("a cached calibration must not start the unquantized model")

    monkeypatch.setattr(LLMEngine, "_unquantized_engine", lambda self: no_second_run())
    again = int8_engine(path)
    for a, b in zip(codes(first), codes(again)):
        assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scales, b.scales)
    assert [o.token_ids for o in again.generate(PROMPTS, GREEDY)] == tokens
    # Calibrated in float32 whatever the dtype served: a bf16 start reads the same file.
    for a, b in zip(codes(first), codes(int8_engine(path, "bfloat16"))):
        assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scales, b.scales)


def test_the_file_is_named_after_the_model_contents(tiny_model_dir, tmp_path, cache):
    def named(folder):  # <folder>-<contents>-v<version>: all but the folder
        return calibration.cache_file(folder).name.rsplit("-", 2)[1:]

    path = tiny_model_dir("llama")
    copy = shutil.copytree(path, tmp_path / "copy")
    assert named(copy) == named(path)
    tensors = load_file(str(copy / "model.safetensors"))
    tensors["model.layers.0.mlp.down_proj.weight"] *= 2  # a fine-tuned checkpoint in the same folder
    save_file(tensors, str(copy / "model.safetensors"), metadata={"format": "pt"})
    assert named(copy) != named(path)


def test_an_unreadable_file_is_calibrated_again_and_replaced(tiny_model_dir, cache, caplog):
    path = tiny_model_dir("llama3")
    file = calibration.cache_file(path)
    file.parent.mkdir(parents=True)
    file.write_bytes(b"not a safetensors file")  # e.g. a disk that filled up mid-write elsewhere
    with caplog.at_level(logging.WARNING):
        engine = int8_engine(path)
    assert "unreadable" in caplog.text
    assert len(engine.generate(PROMPTS, GREEDY)[0].token_ids) == 8
    assert set(load_file(str(file))) >= {"lm_head.codes", "layers.0.qkv.scales"}


def test_an_unwritable_cache_only_costs_the_run(tiny_model_dir, tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(blocker / "cache"))  # below a file: cannot be created
    with caplog.at_level(logging.WARNING):
        engine = int8_engine(tiny_model_dir("llama3"))
    assert "not cached" in caplog.text and "PAGEDSERVE_CACHE_DIR" in caplog.text
    assert len(engine.generate(PROMPTS, GREEDY)[0].token_ids) == 8


def test_the_run_records_every_projection_and_the_lm_head(tiny_model_dir):
    engine = LLMEngine(EngineConfig.from_dict({"model": str(tiny_model_dir("llama3")), "dtype": "float32",
                                               "kv_cache_memory": 1 << 22}))
    model = engine.runner.model
    widths = {name: getattr(model.layers[0], name).in_features for name in calibration.PROJECTIONS}
    sums = calibration.collect_hessians(engine)
    expected = {f"layers.{i}.{n}" for i in range(len(model.layers)) for n in calibration.PROJECTIONS} | {"lm_head"}
    assert set(sums) == expected
    for key, h in sums.items():
        n = widths[key.rsplit(".", 1)[1]] if key != "lm_head" else model.lm_head[0].in_features
        assert h.shape == (n, n) and h.dtype == torch.float64
        assert torch.equal(h, h.T) and (torch.diagonal(h) > 0).all()


def test_recording_sums_x_transpose_x_and_passes_the_layer_through():
    class Double:
        in_features = 3

        def __call__(self, x):
            return 2 * x

        def act_and_mul(self, x, *args):
            return 3 * x

    sums = {}
    recording = calibration._Recording(Double(), "k", sums)
    chunks = [torch.randn(n, 3) for n in (1, 400, 200, 7, 1)]  # flushed once past FLUSH_ROWS, then at the end
    for i, x in enumerate(chunks):
        out = recording(x) if i % 2 else recording.act_and_mul(x, "silu")
        assert torch.equal(out, (2 if i % 2 else 3) * x)
    assert recording.in_features == 3
    recording.flush()
    x = torch.cat(chunks).double()
    torch.testing.assert_close(sums["k"], x.T @ x, rtol=1e-5, atol=1e-5)  # products in float32


def test_a_failed_write_leaves_no_partial_file(tiny_model_dir, cache, monkeypatch, caplog):
    def disk_full(tensors, path, metadata=None):
        open(path, "wb").write(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(calibration, "save_file", disk_full)
    with caplog.at_level(logging.WARNING):
        engine = int8_engine(tiny_model_dir("llama3"))
    assert "No space left" in caplog.text
    assert list((cache / "int8").iterdir()) == []  # neither the file nor its temp copy
    assert len(engine.generate(PROMPTS, GREEDY)[0].token_ids) == 8
