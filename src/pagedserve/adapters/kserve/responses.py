"""Engine deltas (RequestOutput) -> OpenAI completion / chat bodies and SSE chunks.

One renderer per HTTP request. Streaming turns each delta into a chunk; non-streaming feeds the
same deltas in and renders one body at the end, so both paths share every formatting rule
(choice index = prompt_index * n + sample index, echo, logprobs, usage).
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedserve.adapters.vllm_logprobs import logprobs_json
from pagedserve.core.outputs import RequestOutput, TokenLogprobs

MIN_LOGPROB = -9999.0
"""A token a structured-output constraint forbids has logprob -inf, which JSON cannot carry; it is
reported as this value instead, as vLLM's OpenAI server does."""
Decode = Callable[[Sequence[int]], str]


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


class StreamUsage(enum.Enum):
    """What usage a stream reports: none; one extra last chunk (OpenAI's include_usage; every other
    chunk then says "usage": null); or also the running total on every chunk (vLLM's
    continuous_usage_stats)."""

    OFF = enum.auto()
    FINAL = enum.auto()
    EVERY_CHUNK = enum.auto()


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    logprob_rows: list[dict[str, Any]] = field(default_factory=list)
    offset: int = 0
    """Characters of this choice so far (completions' text_offset)."""
    finish_reason: str | None = None
    num_output_tokens: int = 0


class ResponseRenderer:
    """One response's bodies (non-streamed) and chunks (streamed) from the engine's outputs; the
    completions and chat routes each have a subclass."""
    object_name = ""
    chunk_object_name = ""

    def __init__(self, request_id: str, model: str, decode: Decode, n: int, want_logprobs: bool,
                 want_prompt_logprobs: bool = False) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.decode = decode
        """Token ids -> text (AsyncLLMEngine.decode): logprob tokens, echoed token-id prompts."""
        self.n = n
        self.want_logprobs = want_logprobs
        self.choices: dict[int, _Choice] = {}
        self.prompt_tokens: dict[int, int] = {}
        """prompt index -> its token count (counted once however many samples it has)."""
        self.cached_tokens: dict[int, int] = {}
        """prompt index -> its prompt tokens served from the prefix cache (sample 0's count)."""
        self.want_prompt_logprobs = want_prompt_logprobs
        """The client sent vLLM's prompt_logprobs: report them (vLLM's shape) beside the choices."""
        self.prompt_logprobs: dict[int, list[Any]] = {}
        """prompt index -> its prompt logprobs, rendered (they come with sample 0's first delta)."""

    def _token_str(self, token_id: int) -> str:
        return self.decode([token_id])

    def _take_prompt_logprobs(self, prompt_index: int, out: RequestOutput) -> list[Any] | None:
        """The rendered prompt logprobs if this delta brings them and the client asked, else None."""
        if not self.want_prompt_logprobs or out.prompt_logprobs is None:
            return None
        rendered = self.prompt_logprobs[prompt_index] = logprobs_json(out.prompt_logprobs, self._token_str)
        return rendered

    def _update(self, prompt_index: int, out: RequestOutput) -> tuple[int, _Choice, bool]:
        index = prompt_index * self.n + out.index
        first = index not in self.choices
        choice = self.choices.setdefault(index, _Choice())
        self.prompt_tokens[prompt_index] = out.num_prompt_tokens
        if out.index == 0:
            self.cached_tokens[prompt_index] = out.num_cached_tokens
        choice.num_output_tokens = out.num_output_tokens
        if out.finished:
            choice.finish_reason = out.finish_reason
        return index, choice, first

    def usage(self) -> dict[str, Any]:
        prompt = sum(self.prompt_tokens.values())
        completion = sum(c.num_output_tokens for c in self.choices.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens.values())}}

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def usage_chunk(self) -> dict[str, Any]:
        """The extra last chunk of stream_options.include_usage: no choices, only usage."""
        return {**self._envelope(self.chunk_object_name, []), "usage": self.usage()}

    def stream_chunk(self, prompt_index: int, out: RequestOutput, usage: StreamUsage) -> dict[str, Any] | None:
        """The SSE chunk of a delta; None when there is nothing to send yet (a tool parser holds text)."""
        chunk = self.chunk(prompt_index, out)
        if chunk is not None and usage is not StreamUsage.OFF:  # OpenAI: "usage": null on every chunk but the usage chunk
            chunk["usage"] = self.usage() if usage is StreamUsage.EVERY_CHUNK else None
        return chunk

    def add(self, prompt_index: int, out: RequestOutput) -> None:
        """Non-streaming: accumulate a delta."""
        self.chunk(prompt_index, out)

    def body(self) -> dict[str, Any]:
        choices = [self._final_choice(i, self.choices[i]) for i in sorted(self.choices)]
        return {**self._envelope(self.object_name, choices), "usage": self.usage()}

    def chunk(self, prompt_index: int, out: RequestOutput) -> dict[str, Any] | None:
        raise NotImplementedError

    def _final_choice(self, index: int, choice: _Choice) -> dict[str, Any]:
        raise NotImplementedError


class CompletionRenderer(ResponseRenderer):
    object_name = chunk_object_name = "text_completion"

    def __init__(self, request_id: str, model: str, decode: Decode, n: int, want_logprobs: bool,
                 echo: bool, prompts: Sequence[str | Sequence[int]], echo_only: bool = False,
                 want_prompt_logprobs: bool = False) -> None:
        super().__init__(request_id, model, decode, n, want_logprobs, want_prompt_logprobs)
        self.echo = echo
        self.prompts = prompts
        self.echo_only = echo_only
        """echo with max_tokens=0: the one token the engine samples is dropped (nothing generated)."""
        self._prompt_logprobs: dict[int, tuple[TokenLogprobs | None, ...]] = {}

    def _row(self, choice: _Choice, token: str, logprob: float | None, top: dict[str, float] | None) -> dict:
        row = {"token": token, "logprob": logprob, "top": top, "offset": choice.offset}
        choice.offset += len(token)
        return row

    def _entry_row(self, choice: _Choice, entry: TokenLogprobs) -> dict:
        # Keyed by text, as OpenAI's format is: where tokens decode alike (partial UTF-8 bytes) the
        # most likely one keeps the key. The sampled token is always listed.
        top: dict[str, float] = {}
        for token_id, logprob in ((*entry.top, (entry.token_id, entry.logprob))):
            top.setdefault(self._token_str(token_id), _finite(logprob))
        return self._row(choice, self._token_str(entry.token_id), _finite(entry.logprob), top)

    def chunk(self, prompt_index: int, out: RequestOutput) -> dict[str, Any]:
        index, choice, first = self._update(prompt_index, out)
        if out.prompt_logprobs is not None:
            self._prompt_logprobs[prompt_index] = out.prompt_logprobs
        prompt_logprobs = self._take_prompt_logprobs(prompt_index, out)
        finish_reason = out.finish_reason if out.finished else None
        if self.echo_only:
            choice.num_output_tokens = 0
            if finish_reason == "stop":  # the dropped token was EOS or a stop: max_tokens=0 ended it
                finish_reason = choice.finish_reason = "length"
            out = dataclasses.replace(out, text="", logprobs=None)
        text, rows = out.text, []
        if first and self.echo:
            prompt = self.prompts[prompt_index]
            prompt_text = prompt if isinstance(prompt, str) else self.decode(list(prompt))
            if self.want_logprobs:  # the first prompt token has no logprob (nothing precedes it)
                for tok, entry in zip(out.prompt_token_ids, self._prompt_logprobs.get(prompt_index, ())):
                    rows.append(self._entry_row(choice, entry) if entry is not None
                                else self._row(choice, self._token_str(tok), None, None))
            choice.offset = len(prompt_text)
            text = prompt_text + text
        if self.want_logprobs:
            rows += [self._entry_row(choice, e) for e in out.logprobs or ()]
        choice.text.append(text)
        choice.logprob_rows += rows
        chunk_choice = {"index": index, "text": text, "logprobs": self._columns(rows) if self.want_logprobs else None,
                        "finish_reason": finish_reason}
        if prompt_logprobs is not None:  # vLLM: on the choice, in the chunk that first has them
            chunk_choice["prompt_logprobs"] = prompt_logprobs
        return self._envelope(self.chunk_object_name, [chunk_choice])

    @staticmethod
    def _columns(rows: list[dict]) -> dict[str, list]:
        return {"tokens": [r["token"] for r in rows], "token_logprobs": [r["logprob"] for r in rows],
                "top_logprobs": [r["top"] for r in rows], "text_offset": [r["offset"] for r in rows]}

    def _final_choice(self, index: int, choice: _Choice) -> dict[str, Any]:
        body = {"index": index, "text": "".join(choice.text),
                "logprobs": self._columns(choice.logprob_rows) if self.want_logprobs else None,
                "finish_reason": choice.finish_reason}
        if self.want_prompt_logprobs:  # vLLM: every choice of a prompt carries that prompt's
            body["prompt_logprobs"] = self.prompt_logprobs.get(index // self.n)
        return body


class ChatRenderer(ResponseRenderer):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def _logprob(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self._token_str(token_id)
        return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode("utf-8"))}

    def chunk(self, prompt_index: int, out: RequestOutput) -> dict[str, Any]:
        index, choice, first = self._update(prompt_index, out)
        prompt_logprobs = self._take_prompt_logprobs(prompt_index, out)
        rows = [{**self._logprob(e.token_id, e.logprob), "top_logprobs": [self._logprob(t, lp) for t, lp in e.top]}
                for e in out.logprobs or ()] if self.want_logprobs else []
        choice.text.append(out.text)
        choice.logprob_rows += rows
        delta: dict[str, Any] = {"role": "assistant", "content": out.text} if first else {"content": out.text}
        chunk = self._envelope(self.chunk_object_name, [{
            "index": index, "delta": delta, "logprobs": {"content": rows} if self.want_logprobs else None,
            "finish_reason": out.finish_reason if out.finished else None}])
        if prompt_logprobs is not None:  # vLLM's chat: beside the choices, in the chunk that first has them
            chunk["prompt_logprobs"] = prompt_logprobs
        return chunk

    def body(self) -> dict[str, Any]:
        body = super().body()
        if self.want_prompt_logprobs:  # one prompt per chat request
            body["prompt_logprobs"] = self.prompt_logprobs.get(0)
        return body

    def _final_choice(self, index: int, choice: _Choice) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": "".join(choice.text)},
                "logprobs": {"content": choice.logprob_rows} if self.want_logprobs else None,
                "finish_reason": choice.finish_reason}
