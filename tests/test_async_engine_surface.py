"""AsyncLLMEngine's adapter surface: what front ends call besides generate/abort (tokenize, decode,
the chat template, the model's facts), checked against the model's own tokenizer."""

from __future__ import annotations

import asyncio
import shutil
import threading

from transformers import AutoTokenizer

from pagedserve.core.async_engine import AsyncLLMEngine
from pagedserve.core.config import EngineConfig
from pagedserve.core.errors import InvalidRequest, RequestTooLong
from pagedserve.core.sampling_params import SamplingParams


async def drain(engine: AsyncLLMEngine, rid: str, prompt, params) -> int:
    return sum([len(out.new_token_ids) async for out in engine.generate(rid, prompt, params)])


def test_the_adapter_surface_answers_while_the_engine_thread_is_busy(tiny_model_dir, tmp_path):
    """tokenize / decode / apply_chat_template / model_info are the engine's own thread-safe surface
    (adapters never reach the LLMEngine): they agree with the model's tokenizer, loaded on its own
    as the oracle, and answer while the engine thread is held inside a step."""
    model = tmp_path / "chat-model"
    shutil.copytree(tiny_model_dir("llama"), model)
    oracle = AutoTokenizer.from_pretrained(model)
    oracle.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                            "{% if add_generation_prompt %}<assistant>{% endif %}")
    oracle.save_pretrained(model)
    engine = AsyncLLMEngine(EngineConfig.from_dict({"model": str(model), "dtype": "float32", "max_model_len": 256}))
    in_step, release = threading.Event(), threading.Event()
    real_step = engine._engine.step

    def held_step():
        in_step.set()
        release.wait(30)
        return real_step()

    engine._engine.step = held_step
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Paged KV?"}]

    async def main():
        running = asyncio.ensure_future(drain(engine, "busy", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0)))
        assert await asyncio.to_thread(in_step.wait, 30)
        try:
            answers = (await engine.tokenize("The paged KV cache"), await engine.tokenize([3, 4, 5]),
                       await engine.apply_chat_template(messages), engine.decode([100, 101, 102]))
        finally:
            release.set()  # answered while the step was still held
        assert await running == 2
        return answers

    ids, given_ids, chat, text = asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert ids == oracle.encode("The paged KV cache", add_special_tokens=True) and given_ids == [3, 4, 5]
    assert chat == oracle.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == oracle.decode([100, 101, 102])
    info = engine.model_info
    assert (info.model_path, info.max_model_len, info.vocab_size, info.has_chat_template) == (
        str(model), 256, len(oracle), True)
    assert not hasattr(engine, "engine")  # the LLMEngine is private

    async def refused():
        huge = [{"role": "user", "content": "x" * (info.max_prompt_chars + 1)}]
        return await asyncio.gather(engine.tokenize([0, info.vocab_size]), engine.apply_chat_template(huge),
                                    engine.apply_chat_template([{"role": "user"}]), return_exceptions=True)

    bad_id, too_long, malformed = asyncio.run(refused())
    assert isinstance(bad_id, InvalidRequest) and f"[0, {info.vocab_size})" in str(bad_id)
    assert isinstance(too_long, RequestTooLong) and "characters" in str(too_long)
    assert isinstance(malformed, InvalidRequest) and "messages[0]" in str(malformed)
    engine.shutdown()
