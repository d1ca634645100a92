"""Chat responses with tool calls: engine deltas -> `message.tool_calls` / `delta.tool_calls`.

Each choice's text goes through its own tool parser (the tool_parsers package); what comes back is content
and tool-call fragments. Streamed, a call arrives as OpenAI sends it: `{"index", "id", "type",
"function": {"name", "arguments": ""}}` first, then `{"index", "function": {"arguments": ...}}`
fragments; the non-streaming body joins the same fragments, so the openai SDK's stream helpers
assemble exactly the non-streamed message. A delta whose text the parser holds back (it may still
become a call) yields no chunk, unless it carries logprobs or ends the choice.
"""

from __future__ import annotations

from typing import Any

from pagedserve.adapters.kserve.responses import ChatRenderer, Decode, _Choice
from pagedserve.adapters.kserve.tool_calls import ToolPlan
from pagedserve.adapters.kserve.tool_parsers import ParsedDelta, ToolParser
from pagedserve.core.outputs import RequestOutput


class ToolChatRenderer(ChatRenderer):
    def __init__(self, request_id: str, model: str, decode: Decode, n: int, want_logprobs: bool,
                 plan: ToolPlan, want_prompt_logprobs: bool = False) -> None:
        super().__init__(request_id, model, decode, n, want_logprobs, want_prompt_logprobs)
        assert plan.new_parser is not None
        self.plan = plan
        self._parsers: dict[int, ToolParser] = {}
        self._calls: dict[int, list[dict[str, Any]]] = {}
        """choice index -> its calls as the message lists them."""
        self._started: set[int] = set()
        """choices whose first chunk (the one with the role) went out. It is sent with the first
        content or call: a call's message has content null, a text's first chunk has its text."""

    def _accumulate(self, index: int, parsed: ParsedDelta) -> None:
        calls = self._calls.setdefault(index, [])
        for tc in parsed.tool_calls:
            if tc.id is not None:
                calls.append({"id": tc.id, "type": "function", "function": {"name": tc.name, "arguments": ""}})
            calls[tc.index]["function"]["arguments"] += tc.arguments

    def _finish_reason(self, index: int, reason: str) -> str:
        if reason == "stop" and self._calls.get(index) and self.plan.finish_as_tool_calls:
            return "tool_calls"
        return reason

    def chunk(self, prompt_index: int, out: RequestOutput) -> dict[str, Any] | None:
        index, choice, _first = self._update(prompt_index, out)
        parser = self._parsers.get(index)
        if parser is None:
            parser = self._parsers[index] = self.plan.new_parser()
        parsed = parser.feed(out.text)
        if out.finished:
            parsed += parser.finish()
        self._accumulate(index, parsed)
        rows = [{**self._logprob(e.token_id, e.logprob), "top_logprobs": [self._logprob(t, lp) for t, lp in e.top]}
                for e in out.logprobs or ()] if self.want_logprobs else []
        choice.text.append(parsed.content)
        choice.logprob_rows += rows
        finish_reason = None
        if out.finished:
            finish_reason = choice.finish_reason = self._finish_reason(index, out.finish_reason)
        if not (parsed.content or parsed.tool_calls or rows or finish_reason):
            return None  # held back: nothing to say yet (the role goes with the first real chunk)
        delta: dict[str, Any] = {} if index in self._started else {"role": "assistant", "content": None}
        self._started.add(index)
        if parsed.content:
            delta["content"] = parsed.content
        elif finish_reason and not self._calls.get(index) and not any(choice.text):
            delta["content"] = ""  # an empty answer is "" (as non-streamed), not null
        if parsed.tool_calls:
            delta["tool_calls"] = [tc.as_json() for tc in parsed.tool_calls]
        return self._envelope(self.chunk_object_name, [{
            "index": index, "delta": delta, "logprobs": {"content": rows} if self.want_logprobs else None,
            "finish_reason": finish_reason}])

    def _final_choice(self, index: int, choice: _Choice) -> dict[str, Any]:
        content = "".join(choice.text)
        calls = self._calls.get(index)
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not calls else None}
        if calls:
            message["tool_calls"] = calls
        return {"index": index, "message": message,
                "logprobs": {"content": choice.logprob_rows} if self.want_logprobs else None,
                "finish_reason": choice.finish_reason}


def chat_renderer(request_id: str, model: str, decode: Decode, n: int, want_logprobs: bool,
                  plan: ToolPlan, want_prompt_logprobs: bool = False) -> ChatRenderer:
    """The renderer a chat request needs: plain, or with tool calls."""
    if plan.new_parser is None:
        return ChatRenderer(request_id, model, decode, n, want_logprobs, want_prompt_logprobs)
    return ToolChatRenderer(request_id, model, decode, n, want_logprobs, plan, want_prompt_logprobs)
