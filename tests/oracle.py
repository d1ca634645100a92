"""Hugging Face transformers as the independent oracle for greedy token ids."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch


@lru_cache(maxsize=8)
def hf_model(path: Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    # Ignore EOS by having none: min_new_tokens would instead mask EOS logits, which changes the
    # argmax whenever EOS is the most likely token.
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(path: Path, prompt_ids: list[int] | tuple[int, ...], max_new_tokens: int) -> list[int]:
    """transformers generate(), greedy, EOS ignored: exactly max_new_tokens new ids."""
    return list(_hf_greedy_cached(path, tuple(prompt_ids), max_new_tokens))


@lru_cache(maxsize=4096)
def _hf_greedy_cached(path: Path, prompt_ids: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    model = hf_model(path)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=0,
        )
    return tuple(out[0, len(prompt_ids):].tolist())


def hf_processed_greedy(path: Path, prompt: list[int], max_new_tokens: int, *, bias: dict[int, float] | None = None,
                        bad_words: list[list[int]] | None = None, min_tokens: int = 0,
                        eos_token_id: int | None = None) -> list[int]:
    """Greedy decoding with transformers' forward and its own logits processors: logit bias
    (SequenceBiasLogitsProcessor), bad words (NoBadWordsLogitsProcessor), min_tokens
    (MinNewTokensLengthLogitsProcessor, banning eos_token_id). Stops after eos_token_id when one
    is given. No KV cache: for tiny models."""
    from transformers import (LogitsProcessorList, MinNewTokensLengthLogitsProcessor, NoBadWordsLogitsProcessor,
                              SequenceBiasLogitsProcessor)

    model = hf_model(path)
    processors = LogitsProcessorList()
    if bias:
        processors.append(SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()}))
    if bad_words:
        processors.append(NoBadWordsLogitsProcessor(bad_words, eos_token_id=None))
    if min_tokens:
        assert eos_token_id is not None, "min_tokens bans the EOS id: name it"
        processors.append(MinNewTokensLengthLogitsProcessor(len(prompt), min_tokens, eos_token_id))
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(max_new_tokens):
            scores = processors(ids, model(ids).logits[:, -1, :].float())
            token = int(scores.argmax(-1))
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
            if token == eos_token_id:
                break
    return ids[0, len(prompt):].tolist()


def hf_prompt_logprobs(path: Path, prompt: list[int], top: int) -> list[tuple[float, list[int]] | None]:
    """Per prompt position: None for the first, then (logprob of that token given the ones before
    it, the ids of the `top` most likely tokens there), from one transformers forward."""
    model = hf_model(path)
    with torch.no_grad():
        logprobs = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    out: list[tuple[float, list[int]] | None] = [None]
    for j in range(1, len(prompt)):
        row = logprobs[j - 1]
        out.append((float(row[prompt[j]]), row.topk(top).indices.tolist()))
    return out
