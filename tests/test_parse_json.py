"""core/validation.py parse_json / parse_json_object: the one wording every JSON text we are handed
gets on a syntax error (request parameters, batch lines, engine and workload files), in the
caller's own error type. Positions are counted by hand from the texts, not taken from json."""

from __future__ import annotations

import functools

import pytest

from pagedserve.adapters.kserve.errors import OpenAIError
from pagedserve.core.errors import ConfigError, InvalidRequest
from pagedserve.core.validation import parse_json, parse_json_object


def test_valid_text_parses_as_json_does():
    assert parse_json('[1, "a", null]', ConfigError, "x") == [1, "a", None]
    assert parse_json(b'{"a": {"b": 2}}', ConfigError, "x") == {"a": {"b": 2}}
    assert parse_json_object('{"max_tokens": 4}', ConfigError, "x") == {"max_tokens": 4}


def test_a_syntax_error_names_what_where_and_the_fix():
    with pytest.raises(ConfigError) as info:
        parse_json('{"a": }', ConfigError, "engine.json", "send an object")
    assert str(info.value) == "engine.json is not valid JSON (Expecting value at column 7); send an object"


def test_several_lines_give_the_line_too():
    with pytest.raises(ConfigError, match=r"\(Expecting ':' delimiter at line 3 column 7\)$"):
        parse_json('{\n  "a": 1,\n  "b" 2\n}\n', ConfigError, "f.json")


def test_only_an_object_will_do():
    with pytest.raises(ConfigError) as info:
        parse_json_object("[1, 2]", ConfigError, "line 4", "each line must be one JSON object")
    assert str(info.value) == "line 4 must be a JSON object, got list; each line must be one JSON object"


def test_the_callers_error_type_and_fields():
    with pytest.raises(InvalidRequest) as info:
        parse_json("{", functools.partial(InvalidRequest, param="guided_json"), "guided_json")
    assert info.value.param == "guided_json" and "column 2" in str(info.value)
    with pytest.raises(OpenAIError) as info:
        parse_json_object('"text"', functools.partial(OpenAIError, 400, param="sampling_parameters"),
                          "sampling_parameters")
    assert (info.value.status, info.value.param) == (400, "sampling_parameters")
    assert info.value.message == "sampling_parameters must be a JSON object, got str"
