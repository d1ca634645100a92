"""The records one engine step passes from stage to stage; every stage imports them from here.

Data flows one way, once per step (core/engine.py, LLMEngine.step):

    Scheduler.schedule()            -> SchedulerOutput     (what to compute: frozen, self-contained;
                                                            expired deadlines end first)
    Scheduler.grammar_bitmask(...)  -> the constrained samples' token masks, or None
    ModelRunner.execute(...)        -> RunnerOutput        (sampled tokens, logprobs)
    Scheduler.update_from_output()  -> StepResult          (grammar accepts, tokens appended, every
                                                            finish but a stop string's decided)
    OutputProcessor.process(...)    -> ProcessedOutputs    (deltas for the adapters, and the samples
                                                            a stop string ended: the engine hands
                                                            them back to the scheduler to finish)

No stage imports another stage for its types, so the runner knows nothing of the output stage and
the scheduler nothing of the runner. Samples are named by `Sample.seq_id` throughout (an int unique
in the process; the client's request_id is shared by the samples of an n > 1 request).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.core.outputs import RequestOutput, TokenLogprobs
from pagedserve.core.request import Sample
from pagedserve.core.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One sample's share of an iteration; self-contained so the runner needs nothing else."""

    seq_id: int
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
    group_block_ids: tuple[tuple[int, ...], ...] = ()
    """Block ids of layer groups 1.. (core/kv_cache/layout.py); block_ids is group 0's. Empty with one group."""


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    requests: tuple[ScheduledRequest, ...]
    num_batched_tokens: int
    preempted_seq_ids: tuple[int, ...]
    finished_seq_ids: tuple[int, ...] = ()
    """Samples that finished or were aborted since the previous step (the runner, the sampler and
    structured output drop their state for them)."""

    @property
    def is_empty(self) -> bool:
        return not self.requests


@dataclass(frozen=True, slots=True)
class RunnerOutput:
    """Keyed by seq_id."""

    sampled: dict[int, int]
    logprobs: dict[int, TokenLogprobs]
    """Per sample that asked for logprobs and sampled this step."""
    prompt_logprobs: dict[int, list[TokenLogprobs | None]]
    """Per sample that asked for prompt logprobs: entries for the prompt tokens this step covered."""


StepUpdate = tuple[Sample, "int | None"]
"""(sample, the token it sampled) for each scheduled sample after the step, in batch order. The
token is None when it sampled none: a prefill chunk short of the prompt's end, or structured output
found no allowed token. A plain tuple: one is built per sample and step."""


@dataclass(frozen=True, slots=True)
class StepResult:
    updates: list[StepUpdate]
    ended: list[Sample]
    """Samples the scheduler finished this step without a token of theirs (an expired deadline, a
    grammar no token can continue): each gets a final output of its own."""


@dataclass(frozen=True, slots=True)
class ProcessedOutputs:
    outputs: list[RequestOutput]
    stopped: list[tuple[Sample, str]]
    """Samples a stop string ended, with the string; the engine finishes them through the scheduler
    (their outputs already say finish_reason "stop")."""
