"""Parsers of forced output: tool_choice "required" or a named function (the grammar shapes it)."""

from __future__ import annotations

from .base import ToolCallDelta, ToolParser, call_fields, json_end, load_json


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
            call = call_fields(load_json(self._buf[pos:end]), ("parameters",))
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
