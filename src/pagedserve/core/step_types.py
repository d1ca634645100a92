"""The records one engine step passes from stage to stage; every stage imports them from here.

Data flows one way, once per step (core/engine.py, LLMEngine.step):

    Scheduler.schedule()            -> SchedulerOutput     (what to compute, as a delta: new samples'
                                                            static data once, then per step only the
                                                            step's tokens and new block ids; expired
                                                            deadlines end first)
    Scheduler.grammar_bitmask(...)  -> the constrained samples' token masks, or None
    ModelRunner.execute(...)        -> RunnerOutput        (sampled tokens, logprobs)
    Scheduler.update_from_output()  -> StepResult          (grammar accepts, tokens appended, every
                                                            finish but a stop string's decided)
    OutputProcessor.process(...)    -> ProcessedOutputs    (deltas for the adapters, and the samples
                                                            a stop string ended: the engine hands
                                                            them back to the scheduler to finish)

No stage imports another stage for its types, so the runner knows nothing of the output stage and
the scheduler nothing of the runner. The runner keeps its own copy of each live sample (block
tables, output history: core/runner_batch.py), built from these deltas, so a step costs O(batch),
not O(context), on the host. Samples are named by `Sample.seq_id` throughout (an int unique
in the process; the client's request_id is shared by the samples of an n > 1 request).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.core.outputs import RequestOutput, TokenLogprobs
from pagedserve.core.request import Sample
from pagedserve.core.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class NewSample:
    """A sample the runner does not hold yet (first admission, or back after a preemption): its
    static data, sent once; the runner keeps it until the sample finishes or is preempted.
    Per-sample static data belongs here, one field each."""

    seq_id: int
    prompt_token_ids: tuple[int, ...]
    sampling_params: SamplingParams
    eos_token_id: int | None
    output_token_ids: tuple[int, ...]
    """Tokens generated before this admission (a preempted sample's; empty at first): the start of
    the runner's own history, which it extends with the tokens it samples (penalties, min_tokens)."""
    lora_id: int = 0
    """The sample's LoRA adapter (core/lora/manager.py); 0: the base model."""


@dataclass(frozen=True, slots=True)
class ScheduledSample:
    """One sample's share of an iteration: what changed since the runner last saw it."""

    seq_id: int
    token_ids: tuple[int, ...]
    """The tokens to compute this step: positions [start_position, start_position + len)."""
    start_position: int
    sample: bool
    """True when this step reaches the sample's last known token, so a new token is sampled."""
    new_block_ids: tuple[tuple[int, ...], ...]
    """Per layer group (core/kv_cache/layout.py), the block ids appended to the sample's table
    since the previous step (its whole table when it is new); empty tuples on most decode steps."""
    num_null_blocks: tuple[int, ...] = ()
    """Per layer group, the leading table entries that are now the null block (a sliding window
    has passed them and their blocks went back to the pool). Empty when no group frees blocks."""


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    new_samples: tuple[NewSample, ...]
    """Samples in `scheduled` that the runner does not hold yet; listed before it needs them."""
    scheduled: tuple[ScheduledSample, ...]
    num_batched_tokens: int
    preempted_seq_ids: tuple[int, ...]
    """Samples the runner drops before this step's new ones: those preempted this step, and running
    ones restarted from position 0 (a longrope switch); both come back as new samples."""
    finished_seq_ids: tuple[int, ...] = ()
    """Samples that finished or were aborted since the previous step (the runner, the sampler and
    structured output drop their state for them)."""

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


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
