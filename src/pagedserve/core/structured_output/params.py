"""What a request constrains its output to, and the request keys that ask for it.

One constraint per request: a JSON schema, any JSON object, a regular expression, one of a list
of strings, or an EBNF grammar. Every adapter hands the same keys to `parse_structured_output`
(through SamplingParams.from_dict), so the same request gets the same answer everywhere:

    guided_json / guided_regex / guided_choice / guided_grammar     vLLM's request extras
    structured_outputs: {json | json_object | regex | choice | grammar}   newer vLLM's spelling
    guided_decoding:    {json | json_object | regex | choice | grammar}   Triton vllm_backend's

The two object spellings may also arrive as a JSON string (vllm_backend sends them that way).
OpenAI's `response_format` is the KServe adapter's to translate (`json_schema_constraint`,
`json_object_constraint`). Only the shape is checked here; whether a schema, pattern or grammar
compiles is the compiler's call (compiler.py), and its error names the same field.
"""

from __future__ import annotations

import enum
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pagedserve.core.errors import InvalidRequest
from pagedserve.core.validation import parse_json

GUIDED_KEYS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
OBJECT_KEYS = ("structured_outputs", "guided_decoding")
ALL_KEYS = (*GUIDED_KEYS, *OBJECT_KEYS)
_OBJECT_FIELDS = ("json", "json_object", "regex", "choice", "grammar")
_GUIDED_DECODING_BACKENDS = ("xgrammar", "auto")
"""vllm_backend's guided_decoding.backend values that name what pagedserve uses anyway."""


class ConstraintKind(enum.Enum):
    JSON_SCHEMA = "json"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"


@dataclass(frozen=True)
class StructuredOutputParams:
    """One output constraint. `value`: the schema as compact JSON text, the pattern, the grammar,
    the choices, or "" for json_object. Equal constraints share one compiled grammar."""

    kind: ConstraintKind
    value: str | tuple[str, ...]
    param: str = field(default="", compare=False)
    """The request field it came from ("guided_json", "response_format.json_schema.schema"), so a
    schema that does not compile is reported under the name the client used."""

    @property
    def cache_key(self) -> tuple[str, str | tuple[str, ...]]:
        return self.kind.value, self.value


def _load_json(text: str, param: str, fix: str) -> Any:
    return parse_json(text, functools.partial(InvalidRequest, param=param), param, fix)


def json_schema_constraint(schema: Any, param: str) -> StructuredOutputParams:
    """A JSON schema given as an object or as JSON text. Key order is kept: it is the order the
    grammar generates properties in."""
    if isinstance(schema, str):
        schema = _load_json(schema, param, "send a JSON schema object")
    if not isinstance(schema, Mapping):
        raise InvalidRequest(f"{param}: expected a JSON schema object, got {type(schema).__name__}", param=param)
    text = json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    return StructuredOutputParams(ConstraintKind.JSON_SCHEMA, text, param)


def json_object_constraint(param: str) -> StructuredOutputParams:
    """Any JSON object (OpenAI's response_format {"type": "json_object"})."""
    return StructuredOutputParams(ConstraintKind.JSON_OBJECT, "", param)


def _text(value: Any, param: str, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{param}: expected {what} as a non-empty string, got {value!r}", param=param)
    return value


def _choices(value: Any, param: str) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, (list, tuple)) or not value:
        raise InvalidRequest(f"{param}: expected a non-empty list of strings, got {value!r}", param=param)
    for i, choice in enumerate(value):
        if not isinstance(choice, str):
            raise InvalidRequest(f"{param}[{i}]: expected a string, got {choice!r}", param=f"{param}[{i}]")
    return tuple(value)


def build_constraint(kind: str, value: Any, param: str) -> StructuredOutputParams | None:
    """kind: json, json_object, regex, choice or grammar (the structured_outputs field names);
    None for json_object false."""
    if kind == "json":
        return json_schema_constraint(value, param)
    if kind == "json_object":
        if not isinstance(value, bool):
            raise InvalidRequest(f"{param}: expected true or false, got {value!r}", param=param)
        return json_object_constraint(param) if value else None
    if kind == "regex":
        return StructuredOutputParams(ConstraintKind.REGEX, _text(value, param, "a regular expression"), param)
    if kind == "choice":
        return StructuredOutputParams(ConstraintKind.CHOICE, _choices(value, param), param)
    if kind == "grammar":
        return StructuredOutputParams(ConstraintKind.GRAMMAR, _text(value, param, "an EBNF grammar"), param)
    raise AssertionError(kind)


def _object_constraints(key: str, value: Any) -> list[StructuredOutputParams]:
    """structured_outputs / guided_decoding: an object (or its JSON text) of constraint fields."""
    if isinstance(value, str):
        value = _load_json(value, key, 'send an object such as {"regex": "[0-9]+"}')
    if not isinstance(value, Mapping):
        raise InvalidRequest(f"{key}: expected an object with one of {', '.join(_OBJECT_FIELDS)}, "
                             f"got {type(value).__name__}", param=key)
    value = dict(value)
    if key == "guided_decoding" and "backend" in value:
        backend = value.pop("backend")
        if backend is not None and backend not in _GUIDED_DECODING_BACKENDS:
            raise InvalidRequest(f"{key}.backend={backend!r} is not available: pagedserve decodes with "
                                 f"xgrammar; omit backend or send one of {_GUIDED_DECODING_BACKENDS}",
                                 param=f"{key}.backend")
    unknown = sorted(set(value) - set(_OBJECT_FIELDS))
    if unknown:
        raise InvalidRequest(f"{key}: unknown or unsupported field(s) {', '.join(map(repr, unknown))}; "
                             f"supported: {', '.join(_OBJECT_FIELDS)}", param=f"{key}.{unknown[0]}")
    built = (build_constraint(k, v, f"{key}.{k}") for k, v in value.items() if v is not None)
    return [c for c in built if c is not None]


def parse_structured_output(data: Mapping[str, Any]) -> tuple[dict[str, Any], StructuredOutputParams | None]:
    """Split the structured-output keys off a request dict: (the other keys, the constraint).
    Raises InvalidRequest naming the field for a malformed value or for more than one constraint."""
    rest = {k: v for k, v in data.items() if k not in ALL_KEYS}
    found: list[StructuredOutputParams] = []
    for key in ALL_KEYS:
        value = data.get(key)
        if value is None:
            continue
        if key in OBJECT_KEYS:
            found += _object_constraints(key, value)
        else:
            found.append(build_constraint(key.removeprefix("guided_"), value, key))
    return rest, one_constraint(*found)


def one_constraint(*constraints: StructuredOutputParams | None) -> StructuredOutputParams | None:
    """The single constraint among those given (None if none); two are an error naming both."""
    found = [c for c in constraints if c is not None]
    if len(found) > 1:
        raise InvalidRequest(f"{found[0].param} and {found[1].param} both constrain the output; send one "
                             "structured output constraint per request", param=found[1].param)
    return found[0] if found else None
