"""Request and sample state inside the engine, and who owns it.

`EngineRequest` is the engine's one record of a client request, from `LLMEngine.add_request` until
its last sample's final output: `LLMEngine` keeps them in its only map by request_id. It owns the
request's samples: one `Sample` per sequence (n > 1 gives n), each the single source of truth for
that sequence, its scheduling state (status, tokens, computed tokens) and its output state
(detokenizer, timing, logprobs) alike. A sample is identified by its `seq_id`, an int unique in the
process (the client's request_id is shared by all samples, so it identifies none of them); samples
2..n wait until the first (the leader) has computed the prompt, then take its prompt blocks.

Who writes what (everything runs on the engine thread):

* the scheduler alone changes `status` (admit, preempt, finish) and the token counts;
* the output processor fills the output fields and tells the engine which samples a stop string
  ended; the engine then finishes them through the scheduler;
* other components keep state of their own per sample only where it is theirs, keyed by seq_id:
  the KV cache manager's block tables (freed and forgotten by the scheduler as it finishes the
  sample), and the sampler's seeded generators and cached prompts and the structured-output
  grammar matchers (dropped when SchedulerOutput.finished_seq_ids reports the sample finished).
  The scheduler's `samples` index maps a step's seq_ids back to their samples; `Deadlines` holds
  the samples that have one in a heap. Both hold references, not state.

Beyond the engine, delivery keeps one entry per request_id: AsyncLLMEngine's stream (where the
outputs go, on the caller's event loop) and the Triton model's response sender (the platform's
handle). They end with the request's last final output.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from pagedserve.core.sampling_params import SamplingParams


class SampleStatus(enum.Enum):
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
    SampleStatus.FINISHED_STOPPED: "stop",
    SampleStatus.FINISHED_LENGTH: "length",
    SampleStatus.FINISHED_ABORTED: "abort",
    SampleStatus.FINISHED_TIMEOUT: "timeout",
    SampleStatus.FINISHED_UNSATISFIABLE: "unsatisfiable",
}


_seq_ids = itertools.count()
"""Source of Sample.seq_id: unique in the process, increasing in creation (arrival) order."""


@dataclass(slots=True, eq=False)
class Sample:
    """One sample (sequence) of a request: what the scheduler schedules and the runner computes."""

    request_id: str
    """The client's request id, shared by every sample of the request."""
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    eos_token_id: int | None
    max_tokens: int
    """sampling_params.max_tokens, resolved against max_model_len."""
    index: int = 0
    """Which of the request's n samples (0 when n == 1)."""
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    """This sample's key in every per-sample map (scheduler, KV cache, runner, structured output)."""
    arrival_time: float = field(default_factory=time.monotonic)
    status: SampleStatus = SampleStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    """Tokens whose K/V are in the cache; catches up with num_tokens (prefill, decode, recompute)."""
    num_preemptions: int = 0
    cache_salt: str | None = None
    """Prefix-cache namespace: requests with different salts never share KV blocks."""
    use_prefix_cache: bool = True
    prompt_leader: "Sample | None" = None
    """For samples 2..n of an n > 1 request: the sample that computes the shared prompt."""
    stop_reason: str | int | None = None
    first_scheduled_time: float | None = None
    num_cached_tokens: int | None = None
    """Prompt tokens not computed at first admission: prefix-cache hits (for samples 2..n, the
    leader's prompt blocks). None until admitted; a recompute after preemption leaves it as is."""
    deadline: float | None = None
    """time.monotonic() after which the request ends with finish_reason "timeout"; None: never."""
    # -- written by the output processor (core/output_processor.py) only --
    detokenizer: Any = None
    """core.detokenizer.IncrementalDetokenizer, or None when the request asked for token ids only."""
    first_token_time: float | None = None
    last_token_time: float | None = None
    cumulative_logprob: float = 0.0
    prompt_logprobs: list | None = None
    """list[TokenLogprobs | None] while the request scores its prompt (prompt_logprobs), else None."""
    sent_prompt_logprobs: bool = False

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


@dataclass(slots=True, eq=False)
class EngineRequest:
    """One client request from add_request to its last final output (see the module docstring)."""

    request_id: str
    samples: tuple[Sample, ...]

    @property
    def finished(self) -> bool:
        """Whether every sample has finished (each has had, or is getting, its final output)."""
        return all(sample.status.finished for sample in self.samples)
