"""The parsers of tool_choice "auto", chosen by --tool-call-parser (vLLM's names)."""

from __future__ import annotations

import random
import re
import string

from .base import ToolParser, call_fields, json_end, load_json


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
            call = call_fields(load_json(body.strip()), ("arguments",))
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
            call = call_fields(load_json(buf[i:end]), self.ARGS_KEYS)
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
            calls = load_json(body[:end])
            parsed = [call_fields(c, ("arguments",)) for c in calls] if isinstance(calls, list) and calls else [None]
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
        call = call_fields({"name": name.group(), "arguments": load_json(body[after:end])}, ("arguments",))
        if call is None:
            return -1
        self._call(*call)
        return end


AUTO_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}
"""--tool-call-parser NAME -> the parser of tool_choice "auto"."""
