"""Model output text -> OpenAI tool calls, one incremental parser per choice.

A parser is fed the text deltas of one sample as the engine produces them (`feed`) and told when
the sample ends (`finish`); each call returns a `ParsedDelta`: content text that is settled, and
tool-call fragments. The non-streaming route feeds the same deltas and joins what comes back, so a
streamed message assembles to exactly the non-streamed one by construction: the result never
depends on how the text was split (tests/test_tool_parsers.py checks every split of its cases).

To keep that promise a parser never takes anything back. Text that may still turn out to be a
tool call (a partial `<tool_c`, a call whose JSON is not complete yet) is held back until it is
decided; a call is sent, id and name first, arguments next, only once its JSON parsed. Text that
looked like a call but does not parse (malformed JSON, a cut-off call) is content, as vLLM leaves
it. Arguments are the model's JSON re-serialized (`json.dumps`, non-ASCII kept), as vLLM sends them.

Parsers for "auto" (`--tool-call-parser`, vLLM's names):
    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>   Qwen2.5, Qwen3, Hermes
    llama3_json  {"name": ..., "parameters": {...}}; {...}  (optionally after <|python_tag|>)
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]  or  [TOOL_CALLS]name{...}
Parsers of forced output (tool_choice "required" / a named function; the grammar shapes it):
    RequiredParser   [{"name": ..., "parameters": {...}}, ...]   (vLLM's "required" format)
    NamedParser      the output is the arguments object itself
Content next to calls: whitespace between or around calls is dropped; other text stays content.
"""

from __future__ import annotations

import json
import random
import re
import string
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


def _load(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _call_fields(obj: Any, args_keys: tuple[str, ...]) -> tuple[str, str] | None:
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


class HermesToolParser(ToolParser):
    """<tool_call>JSON</tool_call> blocks anywhere in the text (Qwen2.5/Qwen3/Hermes templates)."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self._inside = False

    def _scan(self, final: bool) -> None:
        while True:
            if not self._inside:
                if not self._advance_to(self.START, (self.START,), final):
                    return
                self._inside = True
            end = self._buf.find(self.END)
            if end < 0 and not final:
                return
            block = self._buf if end < 0 else self._buf[:end + len(self.END)]
            body = block[len(self.START):] if end < 0 else block[len(self.START):-len(self.END)]
            self._buf, self._inside = self._buf[len(block):], False
            call = _call_fields(_load(body.strip()), ("arguments",))
            if call is None:
                self._content(block)
            else:
                self._call(*call)
            if not self._buf:
                return


class Llama3JsonToolParser(ToolParser):
    """Output that opens with a JSON object (after optional <|python_tag|>) is calls separated by
    ";"; anything else is content. Keys: "name" and "parameters" (or "arguments")."""

    name = "llama3_json"
    TAG = "<|python_tag|>"
    ARGS_KEYS = ("parameters", "arguments")

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self._mode = "start"  # start -> calls | content
        self._pos = 0
        """calls mode: where the next call (or ";") starts in _buf."""

    def _scan(self, final: bool) -> None:
        if self._mode == "start":
            head = self._buf.lstrip()
            if head.startswith(self.TAG):
                head = head[len(self.TAG):].lstrip()
            elif self.TAG.startswith(head) and not final:  # nothing yet, or part of the tag
                return
            if not head and not final:
                return
            self._mode = "calls" if head.startswith("{") else "content"
            self._pos = len(self._buf) - len(head)
        if self._mode == "content":
            self._content(self._buf)
            self._buf = ""
            return
        buf = self._buf
        while True:
            i = self._skip_ws(self._pos)
            if self.num_calls:  # after a call: the end, or ";" and the next call
                if i == len(buf):
                    return
                if buf[i] != ";":
                    return self._give_up()
                i = self._skip_ws(i + 1)
                if i == len(buf):
                    return self._give_up() if final else None
            if buf[i] != "{":
                return self._give_up()
            end = json_end(buf, i)
            if end is None:
                return self._give_up() if final else None
            call = _call_fields(_load(buf[i:end]), self.ARGS_KEYS)
            if call is None:
                return self._give_up()
            self._call(*call)
            self._pos = end

    def _skip_ws(self, i: int) -> int:
        while i < len(self._buf) and self._buf[i].isspace():
            i += 1
        return i

    def _give_up(self) -> None:
        """What remains is no call: content (all of the text when no call came before it)."""
        self._mode = "content"
        self._content(self._buf if not self.num_calls else self._buf[self._pos:].lstrip(" ;\n\t\r"))
        self._buf = ""


class MistralToolParser(ToolParser):
    """Text, then [TOOL_CALLS] followed by a JSON array of calls (Mistral 7B v0.3 and the like) or
    by name{arguments} / name[ARGS]{arguments} (later Mistral tokenizers), possibly repeated.
    [TOOL_CALLS] is a special token: this parser keeps special tokens, and drops the EOS text."""

    name = "mistral"
    needs_special_tokens = True
    MARKER, ARGS, EOS = "[TOOL_CALLS]", "[ARGS]", "</s>"
    _NAME = re.compile(r"[A-Za-z0-9_.\-]+")
    _ID_CHARS = string.ascii_letters + string.digits

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self._inside = False

    def _new_id(self) -> str:
        return "".join(random.choices(self._ID_CHARS, k=9))  # Mistral's templates check 9 alphanumerics

    def _scan(self, final: bool) -> None:
        self._buf = self._buf.replace(self.EOS, "")
        while True:
            if not self._inside:
                if not self._advance_to(self.MARKER, (self.MARKER, self.EOS), final):
                    return
                self._inside = True
            body = self._buf[len(self.MARKER):]
            lead = len(body) - len(body.lstrip())
            body = body.lstrip()
            consumed = self._one(body, final)
            if consumed is None:
                return
            if consumed < 0:  # not a call: the marker and what follows it are content
                self._content(self._buf)
                self._buf, self._inside = "", False
                return
            self._buf = self._buf[len(self.MARKER) + lead + consumed:]
            self._inside = False
            if not self._buf:
                return

    def _one(self, body: str, final: bool) -> int | None:
        """Characters of `body` that hold the calls after one marker: None = wait for more text,
        -1 = not a call."""
        if body.startswith("["):
            end = json_end(body, 0)
            if end is None:
                return -1 if final else None
            calls = _load(body[:end])
            parsed = [_call_fields(c, ("arguments",)) for c in calls] if isinstance(calls, list) and calls else [None]
            if any(c is None for c in parsed):
                return -1
            for c in parsed:
                self._call(*c)
            return end
        name = self._NAME.match(body)
        if name is None:
            return -1 if body or final else None
        after = name.end()
        if body.startswith(self.ARGS, after):
            after += len(self.ARGS)
        elif after == len(body) or self.ARGS.startswith(body[after:]):
            return -1 if final else None
        if after == len(body):
            return -1 if final else None
        if body[after] != "{":
            return -1
        end = json_end(body, after)
        if end is None:
            return -1 if final else None
        call = _call_fields({"name": name.group(), "arguments": _load(body[after:end])}, ("arguments",))
        if call is None:
            return -1
        self._call(*call)
        return end


class RequiredParser(ToolParser):
    """tool_choice "required": the grammar makes the output a JSON array of {"name", "parameters"}."""

    name = "required"

    def __init__(self, parallel: bool = True) -> None:
        super().__init__(parallel)
        self._pos = 0
        self._done = False

    def _scan(self, final: bool) -> None:
        while not self._done:
            rest = self._buf[self._pos:]
            stripped = rest.lstrip()
            pos = self._pos + len(rest) - len(stripped)
            if not stripped:
                break
            c = stripped[0]
            if c in "[,":
                self._pos = pos + 1
                continue
            if c == "]":
                self._done, self._pos = True, pos + 1
                break
            end = json_end(self._buf, pos) if c == "{" else None
            if end is None:
                break
            call = _call_fields(_load(self._buf[pos:end]), ("parameters",))
            if call is None:
                break
            self._call(*call)
            self._pos = end
        if final and not self._done:  # cut off (max_tokens): what is left is content
            self._content(self._buf[self._pos:])
            self._buf, self._pos = "", 0


class NamedParser(ToolParser):
    """tool_choice naming a function: the grammar makes the whole output its arguments object,
    sent as one call whose arguments stream as they come."""

    def __init__(self, function_name: str) -> None:
        super().__init__(parallel=False)
        self.function_name = function_name

    def _scan(self, final: bool) -> None:
        if not self.num_calls and (self._buf or final):
            self._out.tool_calls.append(ToolCallDelta(0, "", self._new_id(), self.function_name))
            self.num_calls = 1
        if self._buf:
            self._out.tool_calls.append(ToolCallDelta(0, self._buf))
            self._buf = ""


AUTO_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}
"""--tool-call-parser NAME -> the parser of tool_choice "auto"."""
