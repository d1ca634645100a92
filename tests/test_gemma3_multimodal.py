"""Gemma3ForConditionalGeneration (the multimodal Gemma 3 4B/12B/27B config: text_config nested, the
text decoder's weights under language_model.*, a vision tower beside them) served as its text
decoder: greedy tokens equal transformers' generate() on the same checkpoint in fp32, for both
tensor layouts transformers writes; image inputs are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedserve.core.config import EngineConfig
from pagedserve.core.engine import LLMEngine
from pagedserve.core.errors import InvalidRequest
from pagedserve.core.sampling_params import SamplingParams

from tests.oracle import hf_greedy
from tests.test_engine_vs_transformers import assert_all_free, random_prompts
from tests.tiny_models import VOCAB_SIZE, build_tokenizer

IMAGE_TOKEN = VOCAB_SIZE - 1
MAX_NEW = 16


def build_tiny_multimodal_gemma3(path: Path) -> Path:
    """Random weights (tests/tiny_models.py's scheme), a window of 16 under prompts of up to 60,
    local and global rope thetas, head_dim 256, a one-layer SigLIP tower and its projector."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    text = Gemma3TextConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=256, query_pre_attn_scalar=64, sliding_window=16,
        max_position_embeddings=1024, rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=2, eos_token_id=1,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}})
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                          image_token_index=IMAGE_TOKEN, boi_token_index=IMAGE_TOKEN - 2,
                          eoi_token_index=IMAGE_TOKEN - 1)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.25 if p.dim() > 1 else 0.1)
    model.save_pretrained(path, safe_serialization=True)
    build_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def multimodal_dir(tmp_path_factory) -> Path:
    return build_tiny_multimodal_gemma3(tmp_path_factory.mktemp("gemma3-mm"))


@pytest.fixture(scope="module")
def renamed_dir(multimodal_dir, tmp_path_factory) -> Path:
    """The same checkpoint in the layout transformers 4.52-4.57 saved: model.language_model.*,
    model.vision_tower.*, model.multi_modal_projector.*, lm_head.* at the top."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("gemma3-mm-renamed")
    for f in multimodal_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    tensors = load_file(str(multimodal_dir / "model.safetensors"))
    renames = (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
               ("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."))

    def rename(name: str) -> str:
        for old, new in renames:
            if name.startswith(old):
                return new + name[len(old):]
        return name

    renamed = {rename(k): v for k, v in tensors.items()}
    assert not any(k.startswith("language_model.") for k in renamed)
    save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def make_engine(path: Path, backend: str, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig.from_dict({"model": str(path), "dtype": "float32", "attention_backend": backend,
                                             **overrides}))


def prompts() -> list[list[int]]:
    # Token ids below the image markers (they would be refused); lengths across the window of 16.
    return [[t % (IMAGE_TOKEN - 2) for t in p] for p in random_prompts(4, 3, 60, seed=31)]


@pytest.mark.parametrize("backend,budget", [("cpu", 2048), ("cpu", 19), ("reference", 2048)])
def test_text_decoder_matches_transformers(multimodal_dir, backend, budget):
    engine = make_engine(multimodal_dir, backend, max_num_batched_tokens=budget)
    assert engine.arch.multimodal_text and engine.arch.architecture == "Gemma3ForConditionalGeneration"
    ps = prompts()
    results = engine.generate(ps, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    for prompt, res in zip(ps, results):
        assert list(res.token_ids) == hf_greedy(multimodal_dir, prompt, MAX_NEW), f"prompt of {len(prompt)} tokens"
    assert_all_free(engine)


def test_the_oracle_is_the_multimodal_class(multimodal_dir):
    from tests.oracle import hf_model

    assert type(hf_model(multimodal_dir)).__name__ == "Gemma3ForConditionalGeneration"


def test_newer_tensor_layout_loads_the_same(multimodal_dir, renamed_dir):
    engine = make_engine(renamed_dir, "cpu")
    ps = prompts()[:2]
    results = engine.generate(ps, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    for prompt, res in zip(ps, results):
        assert list(res.token_ids) == hf_greedy(multimodal_dir, prompt, MAX_NEW)


def test_image_inputs_are_refused_by_name(multimodal_dir):
    """The image placeholder token in a prompt (ids or text) is refused naming it; the engine
    keeps serving."""
    engine = make_engine(multimodal_dir, "cpu")
    with pytest.raises(InvalidRequest, match=f"token id {IMAGE_TOKEN}, this model's image placeholder.*takes no images"):
        engine.add_request("img", [5, 6, IMAGE_TOKEN, 7], SamplingParams(max_tokens=2))
    text = engine.tokenizer.decode([5, IMAGE_TOKEN])
    if IMAGE_TOKEN in engine.tokenizer.encode(text):
        with pytest.raises(InvalidRequest, match="image placeholder"):
            engine.add_request("img-text", text, SamplingParams(max_tokens=2))
    prompt = prompts()[0]
    res = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert list(res.token_ids) == hf_greedy(multimodal_dir, prompt, 4)


def test_chat_image_parts_are_refused_by_name():
    from pagedserve.adapters.kserve.errors import OpenAIError
    from pagedserve.adapters.kserve.protocol import ChatCompletionRequest

    request = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "What is in it?"},
                                     {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]})
    with pytest.raises(OpenAIError, match=r"messages\[0\].content\[1\] is a 'image_url' part.*takes no images") as err:
        request.template_messages()
    assert err.value.status == 400 and err.value.param == "messages[0].content[1]"
    text_only = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert text_only.template_messages() == [{"role": "user", "content": "ab"}]


@pytest.mark.timeout(300)
def test_served_on_kserve_with_images_refused(multimodal_dir, tmp_path_factory):
    """A real kserve ModelServer serving the multimodal checkpoint, through the stock openai
    client: text completions equal transformers' greedy tokens; an image_url part and a prompt
    holding the image placeholder get a 400 naming them, and the server keeps serving."""
    import openai

    from tests.kserve_server import start_server, with_chat_template

    model = with_chat_template(multimodal_dir, tmp_path_factory.mktemp("gemma3-mm-chat") / "model")
    server = start_server(model, tmp_path_factory.mktemp("gemma3-mm-log") / "server.log", "gemma3mm")
    try:
        client = openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=120)
        prompt = prompts()[1]
        out = client.completions.create(model="gemma3mm", prompt=prompt, max_tokens=8, temperature=0.0,
                                        extra_body={"ignore_eos": True})
        want = hf_greedy(multimodal_dir, prompt, 8)
        assert out.choices[0].text == decode(model, want) and out.choices[0].text.strip()
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model="gemma3mm", max_tokens=4, messages=[{"role": "user", "content": [
                {"type": "text", "text": "Describe"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}])
        assert err.value.param == "messages[0].content[1]" and "takes no images" in err.value.message
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="gemma3mm", prompt=[5, IMAGE_TOKEN, 6], max_tokens=4)
        assert "image placeholder" in err.value.message
        chat = client.chat.completions.create(model="gemma3mm", max_tokens=4, temperature=0.0,
                                              messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
        assert chat.choices[0].finish_reason in ("length", "stop")
    finally:
        server.stop()


def decode(model_dir: Path, token_ids: list[int]) -> str:
    """The text of token ids as the server's tokenizer decodes a completion."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).decode(token_ids, skip_special_tokens=True)
