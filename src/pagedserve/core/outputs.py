"""What the engine hands out: frozen deltas per step, and results of offline generate()."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Logprobs of one position under the raw model distribution (before penalties/temperature)."""

    token_id: int
    logprob: float
    rank: int
    """1 + the number of tokens strictly more likely than token_id."""
    top: tuple[tuple[int, float], ...]
    """The N most likely (token_id, logprob), most likely first (N = the request's logprobs)."""


@dataclass(frozen=True, slots=True)
class RequestTiming:
    """Monotonic timestamps (time.monotonic) of one sample's life, for TTFT / ITL / e2e."""

    arrival: float
    first_scheduled: float | None
    first_token: float | None
    finished: float | None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """One step's news for one sample of a request. Concatenating `text` over a stream gives the
    sample's whole output text; exactly one output per sample has finished=True."""

    request_id: str
    index: int
    """Which of the request's n samples (0 when n == 1)."""
    new_token_ids: tuple[int, ...]
    text: str
    """Text delta: characters that became final in this step."""
    finished: bool
    finish_reason: str | None
    """"stop", "length" or "abort" once finished, else None."""
    stop_reason: str | int | None
    """The stop string or stop token id that ended the sample, if any (None for EOS)."""
    num_prompt_tokens: int
    num_output_tokens: int
    """Tokens generated so far in this sample, this delta included."""
    prompt_token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprobs, ...] | None = None
    """One entry per new token when the request asked for logprobs."""
    cumulative_logprob: float | None = None
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
    """Per prompt token (None for the first), in the first output of sample 0 only."""
    timing: RequestTiming | None = None
    """Set on the final output."""
    num_cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache when the sample was first scheduled (for
    samples 2..n: from sample 0's prompt blocks); OpenAI's usage.prompt_tokens_details.cached_tokens."""


@dataclass(frozen=True)
class CompletionResult:
    """One finished sample from offline `LLMEngine.generate`."""

    request_id: str
    index: int
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: tuple[TokenLogprobs, ...] | None = None
    cumulative_logprob: float | None = None
    prompt_logprobs: tuple[TokenLogprobs | None, ...] | None = None
