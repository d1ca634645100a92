"""SamplingParams: one strict parser; every rejection names the field, the value and the range."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedserve.core.errors import InvalidRequest
from pagedserve.core.sampling_params import SamplingParams


def test_defaults():
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_k, p.top_p, p.min_p) == (1, 1.0, 0, 1.0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.seed, p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids) == (None, 16, 0, (), ())
    assert (p.ignore_eos, p.include_stop_str_in_output, p.skip_special_tokens) == (False, False, True)
    assert (p.logprobs, p.prompt_logprobs) == (None, None)
    assert not p.greedy and not p.uses_penalties
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=1e-6).greedy
    assert SamplingParams(frequency_penalty=0.1).uses_penalties
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5  # type: ignore[misc]


def test_from_dict_full_and_normalised():
    data = {
        "n": 2, "temperature": 0.7, "top_k": 40, "top_p": 0.9, "min_p": 0.05, "repetition_penalty": 1.1,
        "presence_penalty": -0.5, "frequency_penalty": 0.5, "seed": 2**64 - 1, "max_tokens": None,
        "min_tokens": 3, "stop": ["\n\n", "###"], "stop_token_ids": [2, 3], "ignore_eos": True,
        "include_stop_str_in_output": True, "skip_special_tokens": False, "logprobs": 20, "prompt_logprobs": 0,
        "logit_bias": {"9": -100, "4": 2.5}, "bad_words": ["cat", "big dog"],
    }
    p = SamplingParams.from_dict(data)
    assert p.logit_bias == ((4, 2.5), (9, -100.0)) and p.bad_words == ("cat", "big dog")
    assert p.stop == ("\n\n", "###") and p.stop_token_ids == (2, 3) and p.max_tokens is None
    assert p == SamplingParams.from_dict(dataclasses.asdict(p))
    assert SamplingParams.from_dict({"stop": "END"}).stop == ("END",)  # one string, OpenAI style
    assert SamplingParams.from_dict({"stop": None}).stop == ()
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams.from_dict({"top_k": -1}).top_k == 0  # vLLM's "disabled"
    assert SamplingParams.from_dict({"temperature": 1, "max_tokens": 8.0}).max_tokens == 8  # lossless only
    assert SamplingParams.from_dict({"seed": -(2**63)}).seed == -(2**63)


KNOWN = "known keys: bad_words, best_of, frequency_penalty, guided_choice, guided_decoding, guided_grammar, guided_json"

# (input, field the message must name, further text it must contain)
BAD = [
    ({"temprature": 0.5}, "temprature", KNOWN),
    # wrong types
    ({"n": 2.5}, "n", "expected an integer, got 2.5"),
    ({"temperature": "hot"}, "temperature", "expected a number, got 'hot'"),
    ({"temperature": None}, "temperature", "expected a number, got None"),
    ({"top_k": "5"}, "top_k", "expected an integer, got '5'"),
    ({"top_k": 1.5}, "top_k", "expected an integer"),
    ({"top_p": [0.9]}, "top_p", "expected a number"),
    ({"min_p": True}, "min_p", "expected a number, got True"),
    ({"repetition_penalty": "1.1"}, "repetition_penalty", "expected a number"),
    ({"presence_penalty": None}, "presence_penalty", "expected a number"),
    ({"frequency_penalty": {}}, "frequency_penalty", "expected a number"),
    ({"seed": "42"}, "seed", "expected an integer, got '42'"),
    ({"seed": 1.5}, "seed", "expected an integer"),
    ({"max_tokens": "16"}, "max_tokens", "expected an integer"),
    ({"min_tokens": 2.5}, "min_tokens", "expected an integer"),
    ({"stop": 5}, "stop", "expected a list, got 5"),
    ({"stop": ["ok", 7]}, "stop[1]", "expected a string, got 7"),
    ({"stop_token_ids": "3"}, "stop_token_ids", "expected a list"),
    ({"stop_token_ids": [1, 1.5]}, "stop_token_ids[1]", "expected an integer"),
    ({"ignore_eos": "yes"}, "ignore_eos", "expected true or false"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output", "expected true or false"),
    ({"skip_special_tokens": 0}, "skip_special_tokens", "expected true or false"),
    ({"logprobs": True}, "logprobs", "expected an integer"),
    ({"prompt_logprobs": "5"}, "prompt_logprobs", "expected an integer"),
    # out of range
    ({"n": 0}, "n=0", "allowed [1, 128]"),
    ({"n": 129}, "n=129", "allowed [1, 128]"),
    ({"temperature": -0.1}, "temperature=-0.1", "allowed [0.0, 100.0]"),
    ({"temperature": 101}, "temperature=101.0", "allowed [0.0, 100.0]"),
    ({"temperature": math.nan}, "temperature=nan", "not a finite number"),
    ({"temperature": math.inf}, "temperature=inf", "not a finite number"),
    ({"top_k": -2}, "top_k=-2", "allowed [-1, inf]"),
    ({"top_p": 0}, "top_p=0.0", "allowed (0.0, 1.0]"),
    ({"top_p": 1.01}, "top_p=1.01", "allowed (0.0, 1.0]"),
    ({"min_p": -0.1}, "min_p=-0.1", "allowed [0.0, 1.0]"),
    ({"min_p": 1.5}, "min_p=1.5", "allowed [0.0, 1.0]"),
    ({"repetition_penalty": 0}, "repetition_penalty=0.0", "allowed (0.0, 100.0]"),
    ({"repetition_penalty": -1.2}, "repetition_penalty=-1.2", "allowed (0.0, 100.0]"),
    ({"presence_penalty": 2.5}, "presence_penalty=2.5", "allowed [-2.0, 2.0]"),
    ({"frequency_penalty": -3}, "frequency_penalty=-3.0", "allowed [-2.0, 2.0]"),
    ({"frequency_penalty": math.nan}, "frequency_penalty=nan", "not a finite number"),
    ({"seed": 2**64}, "seed=18446744073709551616", "allowed [-9223372036854775808, 18446744073709551615]"),
    ({"seed": -(2**63) - 1}, "seed=-9223372036854775809", "allowed"),
    ({"max_tokens": 0}, "max_tokens=0", "allowed [1, inf]"),
    ({"min_tokens": -1}, "min_tokens=-1", "allowed [0, inf]"),
    ({"min_tokens": 5, "max_tokens": 3}, "min_tokens=5", "exceeds max_tokens=3"),
    ({"stop": [""]}, "stop[0]=''", "non-empty"),
    ({"stop": ""}, "stop[0]=''", "non-empty"),
    ({"stop": [f"s{i}" for i in range(17)]}, "stop", "17 strings; allowed at most 16"),
    ({"stop_token_ids": [5, -1]}, "stop_token_ids[1]=-1", "allowed [0, inf]"),
    ({"logprobs": 21}, "logprobs=21", "allowed [0, 20]"),
    ({"logprobs": -1}, "logprobs=-1", "allowed [0, 20]"),
    ({"prompt_logprobs": 21}, "prompt_logprobs=21", "allowed [0, 20]"),
    # best_of: accepted only equal to n (the rule every adapter shares)
    ({"best_of": 2}, "best_of=2", "best_of must equal n=1"),
    ({"best_of": 2, "n": 3}, "best_of=2", "best_of must equal n=3"),
    ({"best_of": True}, "best_of", "expected an integer"),
]


@pytest.mark.parametrize("data,field,needle", BAD, ids=[str(d)[:60] for d, _, _ in BAD])
def test_bad_inputs_name_the_field(data, field, needle):
    with pytest.raises(InvalidRequest) as exc:
        SamplingParams.from_dict(data)
    msg = str(exc.value)
    assert field in msg and needle in msg, msg
    assert exc.value.param == field.split("=")[0]  # adapters report it (OpenAI's error.param)


def test_best_of_equal_to_n_is_accepted_and_dropped():
    assert SamplingParams.from_dict({"best_of": 1}) == SamplingParams()
    assert SamplingParams.from_dict({"best_of": 4, "n": 4}) == SamplingParams(n=4)
    assert SamplingParams.from_dict({"best_of": None, "n": 2}).n == 2


def test_direct_construction_is_validated_too():
    with pytest.raises(InvalidRequest, match="top_p=0"):
        SamplingParams(top_p=0.0)
    with pytest.raises(InvalidRequest, match="stop_token_ids"):
        SamplingParams(stop_token_ids=(-3,))


@pytest.mark.parametrize("data", [None, [("temperature", 1.0)], "temperature=1"])
def test_not_a_dict(data):
    with pytest.raises(InvalidRequest, match="expected an object/dict"):
        SamplingParams.from_dict(data)


def test_invalid_request_is_a_value_error():
    assert issubclass(InvalidRequest, ValueError)


@given(st.floats(allow_nan=True, allow_infinity=True), st.floats(allow_nan=True, allow_infinity=True))
def test_any_float_is_accepted_in_range_or_rejected_naming_the_field(temperature, top_p):
    """Never a TypeError or a silently accepted out-of-range value."""
    try:
        p = SamplingParams.from_dict({"temperature": temperature, "top_p": top_p})
    except InvalidRequest as exc:
        bad_t = not (0 <= temperature <= 100)  # NaN compares false: bad
        assert ("temperature" in str(exc)) if bad_t else ("top_p" in str(exc))
    else:
        assert 0 <= p.temperature <= 100 and 0 < p.top_p <= 1
