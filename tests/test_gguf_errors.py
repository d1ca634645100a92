"""GGUF files pagedserve must refuse, each with one clear message and no cache entry left behind;
and `--model PATH.gguf` resolution through the cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.gguf_fixtures import write_gguf
from tests.gguf_oracle import transformers_gguf
from pagedserve.core.errors import ModelNotFound, UnsupportedModel
from pagedserve.core.models import default_model as dm
from pagedserve.core.models.gguf import CorruptModelFile, cache, ensure_gguf_model

# The storage types issue 31 names; one llama file holds them all (matrices take them in turn).
REQUIRED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


def _entries(root):
    """What a failed conversion might leave: anything but the lock files."""
    return sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock")) if root.exists() else []


def test_every_required_quant_type_converts_like_transformers(tmp_path):
    path = write_gguf(tmp_path / "mixed.gguf", "llama", REQUIRED_TYPES)
    converted = ensure_gguf_model(path, cache_dir=tmp_path / "cache", progress=False)
    ours = load_file(str(converted / "model.safetensors"))
    _, expected = transformers_gguf(path)
    assert set(ours) == set(expected)
    assert all(torch.equal(ours[name], tensor) for name, tensor in expected.items())
    import gguf

    stored = {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert set(REQUIRED_TYPES) <= stored  # the file really holds every type


def test_model_path_gguf_converts_once_then_reuses(tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "tiny.gguf", "qwen2")
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    first = dm.resolve_model_path(str(path))
    assert first.parent == tmp_path / "cache" and (first / "config.json").is_file()

    def must_not_convert(*args, **kwargs):
        raise AssertionError("reconverted although the cache was complete")

    from pagedserve.core.models.gguf import convert

    monkeypatch.setattr(convert, "convert_gguf_to_hf", must_not_convert)
    assert dm.resolve_model_path(str(path)) == first


def test_folder_with_one_gguf_is_served_like_the_file(tmp_path, monkeypatch):
    """KServe's storage initializer puts a storageUri's .gguf into /mnt/models, the --model folder."""
    folder = tmp_path / "mnt-models"
    folder.mkdir()
    path = write_gguf(folder / "tiny.gguf", "qwen3")
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path / "cache"))
    assert dm.resolve_model_path(str(folder)) == dm.resolve_model_path(str(path))
    write_gguf(folder / "other.gguf", "qwen3")
    with pytest.raises(ModelNotFound, match="several GGUF files"):
        dm.resolve_model_path(str(folder))


def test_missing_gguf_and_non_gguf_file(tmp_path):
    with pytest.raises(ModelNotFound, match="no-such.gguf"):
        dm.resolve_model_path(str(tmp_path / "no-such.gguf"))
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ModelNotFound, match="not a .gguf file"):
        dm.resolve_model_path(str(other))


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    import gguf

    path = tmp_path / "falcon.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModel) as err:
        ensure_gguf_model(path, cache_dir=tmp_path / "cache", progress=False)
    message = str(err.value)
    assert "'falcon'" in message
    for arch in ("llama", "qwen2", "qwen3", "gemma2", "gemma3", "phi3"):
        assert arch in message
    assert _entries(tmp_path / "cache") == []


def test_unsupported_storage_type_is_refused_before_converting(tmp_path):
    path = write_gguf(tmp_path / "f64.gguf", "llama",
                      extra_tensors={"blk.0.attn_q.bias": np.zeros(256)})  # fmt: skip
    # Rewrite that bias as F64, a type the `gguf` package cannot dequantize.
    import gguf

    src = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(tmp_path / "f64b.gguf"), "llama")
    for field in src.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    for tensor in src.tensors:
        data = np.asarray(tensor.data)
        if tensor.name == "blk.0.attn_q.bias":
            data = data.astype(np.float64)
        elif tensor.tensor_type.name not in ("F32", "F16"):
            writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
            continue
        writer.add_tensor(tensor.name, data)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModel) as err:
        ensure_gguf_model(tmp_path / "f64b.gguf", cache_dir=tmp_path / "cache", progress=False)
    assert "F64" in str(err.value) and "blk.0.attn_q.bias" in str(err.value) and "Q4_K" in str(err.value)
    assert _entries(tmp_path / "cache") == []


@pytest.mark.parametrize("keep", [0.5, 0.97])
def test_truncated_file_is_refused_and_leaves_no_cache_entry(tmp_path, keep):
    path = write_gguf(tmp_path / "cut.gguf", "llama", ("Q8_0",))
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])  # an interrupted download
    with pytest.raises(CorruptModelFile) as err:
        ensure_gguf_model(path, cache_dir=tmp_path / "cache", progress=False)
    assert str(path) in str(err.value) and ("truncated" in str(err.value))
    assert _entries(tmp_path / "cache") == []


@pytest.mark.parametrize("content", [b"", b"GGUF\x03\x00\x00\x00" + bytes(range(200)), b"<html>Not found</html>"])
def test_corrupt_file_is_refused_and_leaves_no_cache_entry(tmp_path, content):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(CorruptModelFile) as err:
        ensure_gguf_model(path, cache_dir=tmp_path / "cache", progress=False)
    assert "bad.gguf" in str(err.value) and "download it again" in str(err.value)
    assert _entries(tmp_path / "cache") == []
