"""SamplingParams: how one request is decoded. Frozen; `from_dict` is the one strict parser
every adapter uses, so the same bad input gets the same error everywhere.

Names and meanings follow vLLM / the OpenAI API. Allowed ranges (checked in __post_init__):

    n                   [1, 128]          parallel samples of one prompt
    temperature         [0, 100]          0 (or below 1e-5) means greedy
    top_k               -1 or >= 0        0 and -1 disable it; larger than the vocabulary = disabled
    top_p               (0, 1]
    min_p               [0, 1]            relative to the most likely token's probability
    repetition_penalty  (0, 100]          1 disables it (HF semantics, prompt + output tokens)
    presence_penalty    [-2, 2]           OpenAI semantics, output tokens only
    frequency_penalty   [-2, 2]
    seed                64-bit integer    [-2**63, 2**64 - 1]
    max_tokens          >= 1 or None      None: up to max_model_len
    min_tokens          [0, max_tokens]
    stop                <= 16 non-empty strings (from_dict also takes one string)
    stop_token_ids      token ids >= 0
    logprobs            None or [0, 20]   top-N per generated token; the sampled token is always reported
    prompt_logprobs     None or [0, 20]
    logit_bias          token id -> bias in [-100, 100]   added to the logits before sampling (OpenAI)
    bad_words           <= 128 non-empty strings          never generated (vLLM; see bad_words_token_ids)

`logit_bias` (OpenAI's) is stored as (token id, bias) pairs; from_dict takes OpenAI's JSON object,
whose keys are token ids as strings. Ids past the vocabulary are refused when the request is added
(the engine knows the vocabulary; `LLMEngine.prepare_params`). The bias changes what is sampled,
not the reported logprobs (those are of the raw distribution, as vLLM's default).

`bad_words` (vLLM's) are tokenized by the engine (`LLMEngine.prepare_params`, off the engine
thread when served) into `bad_words_token_ids`, each word both as it is and after a space (a word
starts the text or follows a space: two tokenizations). A word's last token is banned wherever the
output so far ends with the tokens before it; a one-token word is banned everywhere. As in vLLM,
only those token sequences are banned: the same text spelled with other tokens is not.

`from_dict` also takes the structured-output keys (guided_json, guided_regex, guided_choice,
guided_grammar, structured_outputs, guided_decoding; core/structured_output/params.py), which
become `structured_output`: at most one constraint the output must satisfy.

`from_dict` also takes `best_of` (OpenAI / vLLM: draw best_of samples, return the n best). It is
accepted only as a no-op, omitted or equal to n: pagedserve returns every sample it draws. One
rule for every adapter, so Triton and KServe answer the same request the same way.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedserve.core.errors import InvalidRequest
from pagedserve.core.structured_output.params import ALL_KEYS as STRUCTURED_OUTPUT_KEYS
from pagedserve.core.structured_output.params import StructuredOutputParams, parse_structured_output
from pagedserve.core.validation import build_strict, check_range

_GREEDY_EPS = 1e-5
MAX_STOP_STRINGS = 16
MAX_LOGPROBS = 20
MAX_N = 128
MAX_BAD_WORDS = 128
MAX_LOGIT_BIAS = 100.0


def _check_float(field: str, value: float, low: float, high: float, **kwargs: Any) -> None:
    if not math.isfinite(value):  # NaN passes every comparison in check_range
        raise InvalidRequest(f"{field}={value!r} is not a finite number", param=field)
    check_range(InvalidRequest, field, value, low, high, **kwargs)


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    """0 means greedy (argmax)."""
    top_k: int = 0
    """0 (or -1, stored as 0) disables top-k."""
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    """Per-request seed: the same tokens whatever else shares the batch."""
    max_tokens: int | None = 16
    """Most tokens to generate; None means up to max_model_len."""
    min_tokens: int = 0
    """EOS and stop_token_ids cannot be sampled before this many output tokens."""
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    """Top-N raw logprobs per generated token (0: only the sampled token's); None: none."""
    prompt_logprobs: int | None = None
    structured_output: StructuredOutputParams | None = None
    """The output must match this JSON schema / regex / choice / grammar (None: unconstrained)."""
    logit_bias: tuple[tuple[int, float], ...] = ()
    """(token id, bias) pairs added to the logits before sampling; a mapping is accepted too."""
    bad_words: tuple[str, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    """The engine's tokenization of bad_words (filled by LLMEngine.prepare_params, never by clients)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "logit_bias", _parse_logit_bias(self.logit_bias))
        bad_words = (self.bad_words,) if isinstance(self.bad_words, str) else tuple(self.bad_words)
        object.__setattr__(self, "bad_words", bad_words)
        object.__setattr__(self, "bad_words_token_ids", tuple(tuple(w) for w in self.bad_words_token_ids))
        if len(bad_words) > MAX_BAD_WORDS:
            raise InvalidRequest(f"bad_words has {len(bad_words)} words; allowed at most {MAX_BAD_WORDS}",
                                 param="bad_words")
        for i, word in enumerate(bad_words):
            if not isinstance(word, str) or not word.strip():
                raise InvalidRequest(f"bad_words[{i}]={word!r}: bad words must be non-blank strings",
                                     param=f"bad_words[{i}]")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        check_range(InvalidRequest, "n", self.n, 1, MAX_N)
        _check_float("temperature", self.temperature, 0.0, 100.0, hint="use 0 for greedy")
        check_range(InvalidRequest, "top_k", self.top_k, -1, hint="use 0 or -1 to disable top-k")
        _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True, hint="use 1 to disable top-p")
        _check_float("min_p", self.min_p, 0.0, 1.0, hint="use 0 to disable min-p")
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, 100.0, low_open=True,
                     hint="use 1 to disable it")
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        check_range(InvalidRequest, "seed", self.seed, -(2**63), 2**64 - 1, hint="use a 64-bit integer")
        check_range(InvalidRequest, "max_tokens", self.max_tokens, 1, hint="ask for at least one token")
        check_range(InvalidRequest, "min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequest(f"min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}; "
                                 "lower min_tokens or raise max_tokens", param="min_tokens")
        if len(stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(f"stop has {len(stop)} strings; allowed at most {MAX_STOP_STRINGS}", param="stop")
        for i, s in enumerate(stop):
            if not s:
                raise InvalidRequest(f"stop[{i}]={s!r}: stop strings must be non-empty", param=f"stop[{i}]")
        for i, tok in enumerate(self.stop_token_ids):
            check_range(InvalidRequest, f"stop_token_ids[{i}]", tok, 0)
        check_range(InvalidRequest, "logprobs", self.logprobs, 0, MAX_LOGPROBS)
        check_range(InvalidRequest, "prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        if self.top_k == -1:  # vLLM's spelling of "disabled"; the sampler only tests top_k > 0
            object.__setattr__(self, "top_k", 0)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SamplingParams":
        best_of = structured_output = None
        logit_bias: Any = ()
        if isinstance(data, Mapping):
            if "logit_bias" in data:  # a JSON object: build_strict has no mapping type
                data = dict(data)
                logit_bias = _parse_logit_bias(data.pop("logit_bias"))
            if "bad_words" in data and isinstance(data["bad_words"], str):
                data = {**data, "bad_words": [data["bad_words"]]}
            # OpenAI's `stop` is "string, array or null"; the dataclass holds a tuple.
            if "stop" in data and (data["stop"] is None or isinstance(data["stop"], str)):
                data = {**data, "stop": [] if data["stop"] is None else [data["stop"]]}
            if "best_of" in data:
                data = dict(data)
                best_of = data.pop("best_of")
            if "bad_words_token_ids" in data and not data["bad_words_token_ids"]:  # dataclasses.asdict's
                data = {k: v for k, v in data.items() if k != "bad_words_token_ids"}
            if "structured_output" in data and data["structured_output"] is None:  # dataclasses.asdict's
                data = {k: v for k, v in data.items() if k != "structured_output"}
            data, structured_output = parse_structured_output(data)
        # structured_output is built from its request spellings above, never taken as it is.
        params = build_strict(cls, data, InvalidRequest, "sampling parameters",
                              internal=("structured_output", "logit_bias", "bad_words_token_ids"),
                              also_known=(*STRUCTURED_OUTPUT_KEYS, "best_of", "logit_bias"))
        _check_best_of(best_of, params.n)
        if logit_bias:
            params = dataclasses.replace(params, logit_bias=logit_bias)
        if isinstance(data, Mapping) and structured_output is not None:
            params = dataclasses.replace(params, structured_output=structured_output)
        return params


def _check_best_of(best_of: Any, n: int) -> None:
    """best_of is a no-op when it equals n (nothing extra drawn, nothing discarded)."""
    if best_of is None:
        return
    if isinstance(best_of, bool) or not isinstance(best_of, int):
        raise InvalidRequest(f"best_of: expected an integer, got {best_of!r} ({type(best_of).__name__})",
                             param="best_of")
    if best_of != n:
        raise InvalidRequest(f"best_of={best_of} is not supported: pagedserve returns every sample it draws "
                             f"(best_of must equal n={n}); omit best_of, or ask for n={best_of} samples and "
                             "pick among them", param="best_of")


def _parse_logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} (keys strings or ints), or (token id, bias) pairs -> sorted pairs.
    None and {} mean no bias."""
    if value is None:
        return ()
    fix = 'send an object of token ids to biases in [-100, 100], e.g. {"50256": -100}'
    if isinstance(value, Mapping):
        items = list(value.items())
    elif isinstance(value, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in value):
        items = [tuple(p) for p in value]
    else:
        raise InvalidRequest(f"logit_bias: expected an object, got {value!r}; {fix}", param="logit_bias")
    out: dict[int, float] = {}
    for key, bias in items:
        token = key
        if isinstance(key, str) and key.strip().isdigit():
            token = int(key)
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise InvalidRequest(f"logit_bias: key {key!r} is not a token id (a non-negative integer); {fix}",
                                 param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias) \
                or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
            raise InvalidRequest(f"logit_bias[{key!r}]={bias!r} is out of range: allowed [-100, 100]; {fix}",
                                 param="logit_bias")
        out[token] = float(bias)
    return tuple(sorted(out.items()))
