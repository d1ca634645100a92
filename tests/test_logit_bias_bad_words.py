"""logit_bias, bad_words and min_tokens through the engine, against transformers' own logits
processors (SequenceBiasLogitsProcessor, NoBadWordsLogitsProcessor, MinNewTokensLengthLogitsProcessor)
over transformers' forward of the same tiny model: an independent greedy loop.

Every backend that runs on CPU: `reference` (torch's argmax) and `cpu` (the C++ extension's
argmax_rows). The bias and bans are applied to the logits before either argmax.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.core.config import EngineConfig
from pagedserve.core.engine import LLMEngine
from pagedserve.core.errors import InvalidRequest
from pagedserve.core.sampler import bad_word_bans
from pagedserve.core.sampling_params import SamplingParams

from tests.oracle import hf_model, hf_processed_greedy
from tests.tiny_models import VOCAB_SIZE

BACKENDS = ["reference", "cpu"]
EOS = 0  # the tiny models' EOS
PROMPT = [17, 203, 45, 99, 310, 7, 64, 150, 88, 23, 5, 271]


@pytest.fixture(scope="module")
def path(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module", params=BACKENDS)
def engine(request, path):
    return LLMEngine(EngineConfig.from_dict({"model": str(path), "dtype": "float32", "device": "cpu",
                                             "attention_backend": request.param}))


def hf_generate(path, prompt: list[int], max_new_tokens: int, *, stop_at_eos: bool = False, **kw) -> list[int]:
    return hf_processed_greedy(path, prompt, max_new_tokens, eos_token_id=EOS if stop_at_eos or kw.get("min_tokens")
                               else None, **kw)


def run(engine: LLMEngine, prompt, **params):
    (result,) = engine.generate([prompt], SamplingParams(temperature=0.0, **params))
    return result


# -- logit_bias ---------------------------------------------------------------------------------------------
def test_logit_bias_plus_100_makes_a_token_the_greedy_choice_and_minus_100_bans_it(engine, path):
    plain = list(run(engine, PROMPT, max_tokens=8, ignore_eos=True).token_ids)
    assert plain == hf_generate(path, PROMPT, 8)
    favourite = next(t for t in range(3, VOCAB_SIZE) if t not in plain)
    forced = list(run(engine, PROMPT, max_tokens=8, ignore_eos=True, logit_bias={favourite: 100}).token_ids)
    assert forced == [favourite] * 8 == hf_generate(path, PROMPT, 8, bias={favourite: 100.0})
    banned = {plain[0]: -100.0, plain[1]: -100.0}
    out = list(run(engine, PROMPT, max_tokens=8, ignore_eos=True, logit_bias=banned).token_ids)
    assert not set(out) & set(banned) and out != plain
    assert out == hf_generate(path, PROMPT, 8, bias=banned)


def test_moderate_biases_match_transformers_and_leave_logprobs_raw(engine, path):
    bias = {t: b for t, b in zip(range(40, 400, 37), (3.0, -2.5, 4.0, 1.5, -7.0, 6.0, 2.0, 5.5, -1.0, 3.5))
            if t < VOCAB_SIZE}
    out = run(engine, PROMPT, max_tokens=10, ignore_eos=True, logit_bias={str(t): b for t, b in bias.items()},
              logprobs=0)
    assert list(out.token_ids) == hf_generate(path, PROMPT, 10, bias=bias)
    # logprobs stay those of the raw model distribution (vLLM's default): the same with and without bias
    model = hf_model(path)
    with torch.no_grad():
        ids = torch.tensor([PROMPT + list(out.token_ids)])
        raw = model(ids).logits[0, len(PROMPT) - 1:-1].float().log_softmax(-1)
    expected = raw.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in out.logprobs]), expected, atol=1e-4, rtol=0)


def test_logit_bias_is_checked_and_named():
    assert SamplingParams.from_dict({"logit_bias": {"5": 100, "7": -100.0}}).logit_bias == ((5, 100.0), (7, -100.0))
    assert SamplingParams.from_dict({"logit_bias": None}).logit_bias == ()
    for bad, message in (({"5": 101}, "out of range"), ({"x": 1}, "not a token id"), ({"-1": 1}, "not a token id"),
                         ([1, 2], "expected an object"), ({"5": "1"}, "out of range"), ({"5": float("nan")}, "range")):
        with pytest.raises(InvalidRequest, match=message) as exc:
            SamplingParams.from_dict({"logit_bias": bad})
        assert exc.value.param == "logit_bias"


def test_logit_bias_past_the_vocabulary_is_refused(engine):
    with pytest.raises(InvalidRequest, match=f"token id {VOCAB_SIZE} is outside the vocabulary") as exc:
        engine.add_request("too-far", PROMPT, SamplingParams(logit_bias={VOCAB_SIZE: 1.0}))
    assert exc.value.param == "logit_bias" and not engine.has_unfinished_requests()


# -- bad_words ----------------------------------------------------------------------------------------------
def test_bad_word_bans_follow_vllms_rule():
    words = ((5,), (7, 8), (1, 2, 3))
    assert bad_word_bans(words, []) == [5]
    assert bad_word_bans(words, [4, 7]) == [5, 8]
    assert bad_word_bans(words, [1, 2]) == [5, 3]
    assert bad_word_bans(words, [2]) == [5]


def test_bad_words_are_tokenized_in_both_spellings(engine):
    tok = engine.tokenizer
    params = engine.prepare_params(SamplingParams(bad_words=["cache", " blocks"]))
    expected = {tuple(tok.encode(w, add_special_tokens=False)) for w in ("cache", " cache", "blocks", " blocks")}
    assert set(params.bad_words_token_ids) == expected
    assert engine.prepare_params(params) is params  # prepared once
    for bad in (["  "], [""], [3]):
        with pytest.raises(InvalidRequest, match="bad_words"):
            SamplingParams.from_dict({"bad_words": bad})


def _word_the_model_writes(engine, tokens: list[int], length: int) -> tuple[str, tuple[int, ...]]:
    """A `length`-token stretch of the greedy output whose text the engine tokenizes back to it."""
    for i in range(len(tokens) - length + 1):
        ids = tuple(tokens[i:i + length])
        word = engine.tokenizer.decode(list(ids))
        if word.strip() and ids in engine.prepare_params(SamplingParams(bad_words=[word])).bad_words_token_ids:
            return word, ids
    raise AssertionError(f"no {length}-token word in {tokens}")


@pytest.mark.parametrize("length", [1, 2])
def test_bad_words_never_appear_even_where_greedy_would_write_them(engine, path, length):
    text_prompt = "The paged KV cache hands out"
    prompt = engine.tokenizer.encode(text_prompt)
    plain = run(engine, prompt, max_tokens=16, ignore_eos=True)
    word, ids = _word_the_model_writes(engine, list(plain.token_ids), length)
    out = run(engine, prompt, max_tokens=16, ignore_eos=True, bad_words=[word])
    tokens = list(out.token_ids)
    assert all(tuple(tokens[i:i + length]) != ids for i in range(len(tokens) - length + 1)), (word, tokens)
    assert word.strip() not in out.text and word.strip() in plain.text
    word_ids = [list(w) for w in engine.prepare_params(SamplingParams(bad_words=[word])).bad_words_token_ids]
    assert tokens == hf_generate(path, prompt, 16, bad_words=word_ids)


# -- min_tokens ---------------------------------------------------------------------------------------------
def test_min_tokens_holds_back_eos_and_stop_ids_until_reached(engine, path):
    push_eos = {EOS: 100.0}  # EOS becomes the greedy choice at every step
    assert list(run(engine, PROMPT, max_tokens=10, logit_bias=push_eos).token_ids) == [EOS]
    out = run(engine, PROMPT, max_tokens=10, logit_bias=push_eos, min_tokens=4)
    assert list(out.token_ids) == hf_generate(path, PROMPT, 10, bias=push_eos, min_tokens=4, stop_at_eos=True)
    assert len(out.token_ids) == 5 and out.token_ids[-1] == EOS and out.finish_reason == "stop"
    stop_id = 42
    out = run(engine, PROMPT, max_tokens=10, ignore_eos=True, logit_bias={stop_id: 100.0}, stop_token_ids=[stop_id],
              min_tokens=3)
    assert len(out.token_ids) == 4 and out.token_ids[-1] == stop_id and stop_id not in out.token_ids[:-1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_min_tokens_holds_back_stop_strings_until_reached(engine):
    plain = run(engine, PROMPT, max_tokens=12, ignore_eos=True)
    first = engine.tokenizer.decode([plain.token_ids[0]])
    assert first.strip(), "the first token must render text"
    stop = first.strip()
    early = run(engine, PROMPT, max_tokens=12, ignore_eos=True, stop=[stop])
    assert len(early.token_ids) == 1 and early.finish_reason == "stop"
    held = run(engine, PROMPT, max_tokens=12, ignore_eos=True, stop=[stop], min_tokens=3)
    tokens = list(held.token_ids)
    assert len(tokens) > 3 and tokens == list(plain.token_ids[:len(tokens)])
    if held.finish_reason == "stop":  # a later occurrence ended it: in the text after the first 3 tokens
        assert stop in engine.tokenizer.decode(tokens)[len(engine.tokenizer.decode(tokens[:3])) - len(stop) + 1:]
    else:
        assert held.finish_reason == "length" and len(tokens) == 12
