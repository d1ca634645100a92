"""Strict construction of frozen dataclasses from untrusted dicts, and of JSON from untrusted text.

Shared by EngineConfig and SamplingParams so every adapter gets the same rules: unknown keys are
rejected with the list of known ones, and wrong types name the field, the value and the type wanted.
Every JSON text a client or a user hands us (a request parameter, a batch line, an engine or
workload file) is parsed by parse_json, so a syntax error reads the same everywhere: what, where
it stopped parsing, and how to send it right.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from pagedserve.core.errors import PagedServeError

T = TypeVar("T")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(field: str, value: Any, tp: Any, error_cls: type[PagedServeError]) -> Any:
    """Return `value` as type `tp`, or raise error_cls naming the field. Only lossless coercions."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(field, value, arg, error_cls)
            except error_cls as exc:
                errors.append(exc)
        raise errors[0]
    if origin in (tuple, list):
        (item_tp, *_rest) = typing.get_args(tp) or (Any,)
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            raise error_cls(f"{field}: expected a list, got {value!r} ({type(value).__name__})", param=field)
        return tuple(_coerce(f"{field}[{i}]", v, item_tp, error_cls) for i, v in enumerate(value))
    if origin is dict:
        key_tp, value_tp = typing.get_args(tp) or (Any, Any)
        if not isinstance(value, Mapping):
            raise error_cls(f"{field}: expected an object, got {value!r} ({type(value).__name__})", param=field)
        return {_coerce(f"{field} key", k, key_tp, error_cls): _coerce(f"{field}[{k!r}]", v, value_tp, error_cls)
                for k, v in value.items()}
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise error_cls(f"{field}: expected true or false, got {value!r} ({type(value).__name__})", param=field)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise error_cls(f"{field}: expected an integer, got {value!r} ({type(value).__name__})", param=field)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise error_cls(f"{field}: expected a number, got {value!r} ({type(value).__name__})", param=field)
    if tp is str:
        if isinstance(value, str):
            return value
        raise error_cls(f"{field}: expected a string, got {value!r} ({type(value).__name__})", param=field)
    raise TypeError(f"no coercion for {field}: {_type_name(tp)}")  # a bug in the dataclass, not input


def build_strict(cls: type[T], data: Mapping[str, Any], error_cls: type[PagedServeError], what: str,
                 *, internal: tuple[str, ...] = (), also_known: tuple[str, ...] = ()) -> T:
    """Construct dataclass `cls` from `data`, rejecting unknown keys and wrong types.
    internal: fields the caller fills itself (unknown to clients); also_known: keys the caller
    handled before (listed among the known keys in the error)."""
    if not isinstance(data, Mapping):
        raise error_cls(f"{what}: expected an object/dict, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init and f.name not in internal}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        known = ", ".join(sorted({*fields, *also_known}))
        raise error_cls(f"{what}: unknown key(s) {', '.join(map(repr, unknown))}; known keys: {known}",
                        param=unknown[0])
    hints = typing.get_type_hints(cls)
    kwargs = {name: _coerce(name, value, hints[name], error_cls) for name, value in data.items()}
    return cls(**kwargs)


def check_range(
    error_cls: type[PagedServeError],
    field: str,
    value: float | int | None,
    low: float | None = None,
    high: float | None = None,
    *,
    low_open: bool = False,
    hint: str = "",
) -> None:
    """Raise error_cls if value is outside [low, high] (or (low, high] with low_open)."""
    if value is None:
        return
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and value > high
    if too_low or too_high:
        lo = "-inf" if low is None else low
        hi = "inf" if high is None else high
        rng = f"{'(' if low_open else '['}{lo}, {hi}]"
        raise error_cls(f"{field}={value!r} is out of range: allowed {rng}{'; ' + hint if hint else ''}",
                        param=field)


def parse_json(text: str | bytes, error: Callable[[str], Exception], what: str, fix: str = "") -> Any:
    """json.loads(text), or raise error(message): `what` is not valid JSON, where the parser
    stopped (the line too when the text has several), then `fix`, how to send it right. `error` is
    the caller's error type, or a partial of it that fills its other fields (status, param)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno} column {exc.colno}" if "\n" in exc.doc.rstrip() else f"column {exc.colno}"
        raise error(f"{what} is not valid JSON ({exc.msg} at {where}){'; ' + fix if fix else ''}") from None


def parse_json_object(text: str | bytes, error: Callable[[str], Exception], what: str, fix: str = "") -> dict[str, Any]:
    """parse_json, where only a JSON object will do."""
    data = parse_json(text, error, what, fix)
    if not isinstance(data, dict):
        raise error(f"{what} must be a JSON object, got {type(data).__name__}{'; ' + fix if fix else ''}")
    return data
