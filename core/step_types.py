"""The records one engine step passes from stage to stage; every stage imports them from here.

Data flows one way, once per step (core/engine.py, LLMEngine.step):

    Scheduler.schedule()            -> SchedulerOutput     (what to compute: frozen, self-contained)
    ModelRunner.execute(...)        -> RunnerOutput        (sampled tokens, logprobs)
    Scheduler.update_from_output()  -> list[SampledToken]  (tokens appended, token-level stops applied)
    OutputProcessor.process(...)    -> list[RequestOutput] (deltas for the adapters)

No stage imports another stage for its types, so the runner knows nothing of the output stage and
the scheduler nothing of the runner.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.core.outputs import TokenLogprobs
from pagedserve.core.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of an iteration; self-contained so the runner needs nothing else."""

    request_id: str
    token_ids: tuple[int, ...]
    """The tokens to compute this step: positions [start_position, start_position + len)."""
    start_position: int
    block_ids: tuple[int, ...]
    sample: bool
    """True when this step reaches the request's last known token, so a new token is sampled."""
    sampling_params: SamplingParams
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    """Tokens generated so far (for penalties); empty until the first sample."""
    eos_token_id: int | None


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    requests: tuple[ScheduledRequest, ...]
    num_batched_tokens: int
    preempted_request_ids: tuple[str, ...]
    finished_request_ids: tuple[str, ...] = ()
    """Requests that finished or were aborted since the previous step (the runner drops their state)."""

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass(frozen=True, slots=True)
class RunnerOutput:
    sampled: dict[str, int]
    logprobs: dict[str, TokenLogprobs]
    """Per request that asked for logprobs and sampled this step."""
    prompt_logprobs: dict[str, list[TokenLogprobs | None]]
    """Per request that asked for prompt logprobs: entries for the prompt tokens this step covered."""
