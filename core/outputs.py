"""RequestOutput: the frozen delta the engine hands an adapter after every step."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    new_token_ids: tuple[int, ...]
    """Tokens generated in this step (usually one)."""
    finished: bool
    finish_reason: str | None
    """"stop", "length" or "abort" once finished, else None."""
    num_prompt_tokens: int
    num_output_tokens: int
    """All tokens generated so far, this delta included."""


@dataclass(frozen=True)
class CompletionResult:
    """What offline `LLMEngine.generate` returns for one prompt."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: str | None
