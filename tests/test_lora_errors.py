"""LoRA settings, flags and adapters the engine cannot serve: each refused with a clear error."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from pagedserve.core.config import EngineConfig
from pagedserve.core.engine import LLMEngine
from pagedserve.core.errors import (ConfigError, InvalidLoRAAdapter, LoRANotEnabled, UnknownLoRAAdapter)
from pagedserve.core.sampling_params import SamplingParams
from pagedserve.tools.engine_args import add_engine_args, engine_config_from_args

from tests.lora_oracle import make_adapter, peft_greedy


def flags(*argv: str) -> EngineConfig:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return engine_config_from_args(p.parse_args(list(argv)))


def test_flags_and_json_config():
    lora = flags("--enable-lora", "--max-loras", "2", "--max-lora-rank", "32", "--max-cpu-loras", "4",
                 "--lora-modules", "sql=/a/sql", '{"name": "chat", "path": "/a/chat", "base_model_name": "x"}').lora
    assert (lora.enable_lora, lora.max_loras, lora.max_lora_rank, lora.max_cpu_loras) == (True, 2, 32, 4)
    assert lora.lora_modules == {"sql": "/a/sql", "chat": "/a/chat"}
    nested = EngineConfig.from_dict({"lora": {"enable_lora": True, "lora_modules": {"sql": "/a/sql"}}})
    assert nested.lora.lora_modules == {"sql": "/a/sql"} and nested.replace(max_loras=3).lora.max_loras == 3
    with pytest.raises(ConfigError, match="add --enable-lora"):
        flags("--lora-modules", "sql=/a/sql")
    with pytest.raises(ConfigError, match="expected name=path"):
        flags("--enable-lora", "--lora-modules", "sql")
    with pytest.raises(ConfigError, match="max_cpu_loras=1 is out of range.*max_loras=2"):
        EngineConfig.from_dict({"enable_lora": True, "max_loras": 2, "max_cpu_loras": 1})
    with pytest.raises(ConfigError, match="lora: unknown key.*'max_lora'"):
        EngineConfig.from_dict({"lora": {"max_lora": 2}})
    with pytest.raises(ConfigError, match="max_lora_rank=0"):
        EngineConfig.from_dict({"max_lora_rank": 0})


@pytest.fixture(scope="module")
def base(tiny_model_dir):
    return tiny_model_dir("qwen3")


@pytest.fixture(scope="module")
def engine(base):
    return LLMEngine(EngineConfig.from_dict({"model": str(base), "dtype": "float32", "enable_lora": True,
                                             "max_lora_rank": 8}))


def test_unknown_adapter_and_lora_off(base, engine, tmp_path):
    engine.add_lora("one", str(make_adapter(base, tmp_path / "one", r=4)))
    with pytest.raises(UnknownLoRAAdapter, match=r"'two' is not loaded \(loaded: one\)"):
        engine.add_request(None, [1, 2, 3], lora_name="two")
    assert not engine.has_unfinished_requests()
    off = LLMEngine(EngineConfig.from_dict({"model": str(base), "dtype": "float32"}))
    with pytest.raises(LoRANotEnabled, match="--enable-lora"):
        off.add_request(None, [1, 2, 3], lora_name="one")
    with pytest.raises(LoRANotEnabled, match="--enable-lora"):
        off.add_lora("one", str(tmp_path / "one"))
    assert off.list_loras() == {} and off.lora_stats().max_lora == 0


def test_names_are_unique_and_loading_again_is_idempotent(base, engine, tmp_path):
    first = str(make_adapter(base, tmp_path / "first", r=4, seed=1))
    engine.add_lora("dup", first)
    engine.add_lora("dup", first)
    with pytest.raises(InvalidLoRAAdapter, match="'dup' is already loaded from"):
        engine.add_lora("dup", str(make_adapter(base, tmp_path / "second", r=4, seed=2)))
    assert engine.list_loras()["dup"] == first


def _bad_adapters(base, root):
    """(what to do to a fresh adapter directory, the error it must give)."""
    def config_edit(**changes):
        def edit(path):
            config = json.loads((path / "adapter_config.json").read_text())
            config.update(changes)
            (path / "adapter_config.json").write_text(json.dumps(config))
        return edit

    def corrupt(path):
        (path / "adapter_model.safetensors").write_bytes(b"\x00garbage")

    def no_config(path):
        (path / "adapter_config.json").unlink()

    def no_weights(path):
        (path / "adapter_model.safetensors").unlink()

    return [(config_edit(use_dora=True), "DoRA adapters are not supported"),
            (config_edit(modules_to_save=["lm_head"]), "modules_to_save"),
            (config_edit(peft_type="PROMPT_TUNING"), "only LoRA adapters"),
            (corrupt, "adapter_model.safetensors cannot be read"),
            (no_config, "has no adapter_config.json"),
            (no_weights, "has no adapter_model.safetensors")]


def test_unservable_adapters_are_refused_with_the_fix(base, engine, tmp_path, tiny_model_dir):
    with pytest.raises(InvalidLoRAAdapter, match="no such directory"):
        engine.add_lora("missing", str(tmp_path / "nowhere"))
    with pytest.raises(InvalidLoRAAdapter, match="rank r=16 exceeds max_lora_rank=8; start the engine with "
                                                 "--max-lora-rank 16"):
        engine.add_lora("big", str(make_adapter(base, tmp_path / "big", r=16)))
    with pytest.raises(InvalidLoRAAdapter, match="target_modules has 'embed_tokens'"):
        engine.add_lora("emb", str(make_adapter(base, tmp_path / "emb", r=4, targets=("q_proj", "embed_tokens"))))
    # An adapter trained for another base model (the tiny Qwen2 is wider).
    other = tiny_model_dir("qwen2")
    with pytest.raises(InvalidLoRAAdapter, match="trained for another base model"):
        engine.add_lora("other", str(make_adapter(other, tmp_path / "other", r=4)))
    for i, (damage, message) in enumerate(_bad_adapters(base, tmp_path)):
        path = make_adapter(base, tmp_path / f"bad{i}", r=4)
        damage(path)
        with pytest.raises(InvalidLoRAAdapter, match=message):
            engine.add_lora(f"bad{i}", str(path))
    assert not set(engine.list_loras()) & {"missing", "big", "emb", "other"}


def test_async_engine_adapters_at_run_time(base, tmp_path):
    from pagedserve.core.async_engine import AsyncLLMEngine

    adapter = make_adapter(base, tmp_path / "a", r=4, seed=5)
    engine = AsyncLLMEngine(EngineConfig.from_dict({"model": str(base), "dtype": "float32", "enable_lora": True}))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    async def tokens(name):
        return [t async for out in engine.generate(f"r-{name}", [4, 5, 6, 7], params, lora_name=name)
                for t in out.new_token_ids]

    async def main():
        engine.add_lora("a", str(adapter))  # from the event loop thread: loaded on the engine thread
        assert engine.list_loras() == {"a": str(adapter)}
        assert await tokens("a") == peft_greedy(base, adapter, [4, 5, 6, 7], 6)
        with pytest.raises(UnknownLoRAAdapter, match="'b' is not loaded"):
            await tokens("b")
        with pytest.raises(InvalidLoRAAdapter, match="no such directory"):
            engine.add_lora("c", str(tmp_path / "nowhere"))
        assert engine.remove_lora("a") and engine.list_loras() == {}
        stats = engine.lora_stats()
        assert (stats.running, stats.waiting, stats.max_lora) == ((), (), 1)

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
