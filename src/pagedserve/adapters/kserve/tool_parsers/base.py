"""The incremental parser every tool-call parser is: content held back until decided, calls sent
once their JSON parsed (see the package docstring), and the JSON helpers the parsers share."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCallDelta:
    """One fragment of a tool call: the first of each call carries its id and name."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def as_json(self) -> dict[str, Any]:
        """OpenAI's delta.tool_calls[] entry."""
        function: dict[str, Any] = {"arguments": self.arguments}
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out.update(id=self.id, type="function")
            function = {"name": self.name, **function}
        return {**out, "function": function}


@dataclass
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __iadd__(self, other: "ParsedDelta") -> "ParsedDelta":
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


def random_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def json_end(text: str, start: int) -> int | None:
    """The index just past the JSON object or array opening at text[start], or None if the text
    ends first. Counts brackets outside strings only; json.loads judges the slice afterwards."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def load_json(text: str) -> Any:
    """The JSON value of `text`, or None when it does not parse."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def call_fields(obj: Any, args_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a call object, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    found = [k for k in args_keys if k in obj]
    if len(found) > 1 or set(obj) - {"name", *args_keys}:
        return None
    arguments = obj[found[0]] if found else {}
    if not isinstance(arguments, dict):
        return None
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


def _held_prefix(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that could begin one of `markers` (held back)."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if marker.startswith(text[-n:]):
                best = n
                break
    return best


class ToolParser:
    """Base: content bookkeeping shared by every format. Subclasses implement `_scan(final)`,
    which consumes `self._buf` as far as it is decided and reports through `_content` / `_call`."""

    name = ""
    needs_special_tokens = False
    """True when the format's markers are special tokens the detokenizer must keep."""

    def __init__(self, parallel: bool = True) -> None:
        self.parallel = parallel
        """False: only the first call is returned (parallel_tool_calls=false); later ones are dropped."""
        self._buf = ""
        self._out = ParsedDelta()
        self._pending_ws = ""
        """Trailing whitespace of content, held: dropped if a call follows, else sent later."""
        self._after_call = False
        self.num_calls = 0

    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        return self._take(final=False)

    def finish(self) -> ParsedDelta:
        out = self._take(final=True)
        if not self.num_calls:  # no call: the text is returned exactly as generated
            out.content += self._pending_ws
        self._pending_ws = ""
        return out

    def _take(self, final: bool) -> ParsedDelta:
        self._scan(final)
        out, self._out = self._out, ParsedDelta()
        return out

    def _scan(self, final: bool) -> None:
        raise NotImplementedError

    def _content(self, text: str) -> None:
        if self._after_call:  # whitespace right after a call is dropped
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        body = text.rstrip()
        if not body:
            self._pending_ws += text
            return
        self._out.content += self._pending_ws + body
        self._pending_ws = text[len(body):]

    def _new_id(self) -> str:
        return random_tool_call_id()

    def _call(self, name: str, arguments: str) -> None:
        self._pending_ws, self._after_call = "", True
        if self.num_calls and not self.parallel:
            return
        self._out.tool_calls.append(ToolCallDelta(self.num_calls, "", self._new_id(), name))
        self._out.tool_calls.append(ToolCallDelta(self.num_calls, arguments))
        self.num_calls += 1

    def _advance_to(self, marker: str, held: tuple[str, ...], final: bool) -> bool:
        """Emit the text before `marker` as content and leave the buffer starting at it (True). With
        no marker, emit all but a tail that may still grow into one of `held` (False)."""
        at = self._buf.find(marker)
        if at < 0:
            keep = 0 if final else _held_prefix(self._buf, held)
            self._content(self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            return False
        self._content(self._buf[:at])
        self._buf = self._buf[at:]
        return True
