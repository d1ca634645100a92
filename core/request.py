"""Request: the single source of truth for one sequence's state inside the engine.

A user request with n > 1 becomes n Requests (samples) sharing one prompt; the first is the
leader, the others wait until it has computed the prompt and then take its prompt blocks.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagedserve.core.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_TIMEOUT = enum.auto()
    FINISHED_UNSATISFIABLE = enum.auto()
    """The request's structured-output constraint allows no next token (core/structured_output)."""

    @property
    def finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_TIMEOUT: "timeout",
    RequestStatus.FINISHED_UNSATISFIABLE: "unsatisfiable",
}


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    eos_token_id: int | None
    max_tokens: int
    """sampling_params.max_tokens, resolved against max_model_len."""
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    """Tokens whose K/V are in the cache; catches up with num_tokens (prefill, decode, recompute)."""
    num_preemptions: int = 0
    cache_salt: str | None = None
    """Prefix-cache namespace: requests with different salts never share KV blocks."""
    use_prefix_cache: bool = True
    prompt_leader: "Request | None" = None
    """For samples 2..n of an n > 1 request: the sample that computes the shared prompt."""
    stop_reason: str | int | None = None
    first_scheduled_time: float | None = None
    num_cached_tokens: int | None = None
    """Prompt tokens not computed at first admission: prefix-cache hits (for samples 2..n, the
    leader's prompt blocks). None until admitted; a recompute after preemption leaves it as is."""
    deadline: float | None = None
    """time.monotonic() after which the request ends with finish_reason "timeout"; None: never."""

    def __post_init__(self) -> None:
        self.prompt_token_ids = tuple(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without building the whole concatenation."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return list(self.prompt_token_ids[start:end])
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return list(self.prompt_token_ids[start:]) + self.output_token_ids[: end - n_prompt]
