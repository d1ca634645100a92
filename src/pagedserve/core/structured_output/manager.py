"""Per-request grammar state on the engine thread, and the token masks of one step.

Each constrained sample (each of n) has its own xgrammar GrammarMatcher. One engine step:

    prepare(scheduler_output)  -> StructuredStep: a bitmask row for every constrained request that
                                  samples this step (None when there is none: an unconstrained batch
                                  costs one dict check)
    runner: GrammarBitmask.apply(logits)   disallowed tokens -> -inf before the sampler, so greedy,
                                  random sampling and the logprobs all see the masked distribution
    accept(step, sampled)      -> advance each grammar by its sampled token

A request whose grammar allows no token at all (an empty-language pattern, or min_tokens banning
the end token where the grammar allows nothing else) gets no token: the engine finishes it with
finish_reason "unsatisfiable" instead of sampling from an all -inf row. A grammar that terminated
(its stop token accepted, e.g. with ignore_eos) ends its request as "stop".

Preemption keeps a request's output tokens, so its grammar state stays valid; should the two ever
disagree (the matcher has accepted a different number of tokens than the request has), prepare()
resets the matcher and replays the output tokens before masking.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from pagedserve.core.structured_output.compiler import GrammarCompiler
from pagedserve.core.structured_output.masking import apply_bitmask_rows

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StructuredOutputStats:
    """Where constrained decoding spends the engine thread's time (bench/structured.py reports it)."""

    num_steps: int = 0
    """Steps with at least one constrained row."""
    num_rows: int = 0
    fill_s: float = 0.0
    """Computing the token bitmasks (xgrammar)."""
    apply_s: float = 0.0
    """Masking the logits rows."""
    accept_s: float = 0.0
    """Advancing the grammars by the sampled tokens."""


@dataclass(slots=True, eq=False)
class _GrammarState:
    matcher: Any
    """xgrammar.GrammarMatcher"""
    num_accepted: int = 0


@dataclass(frozen=True, slots=True)
class GrammarBitmask:
    """The token masks of one step's constrained requests; the runner applies them to the logits."""

    bitmask: Tensor
    """int32 [rows, ceil(vocab / 32)] on the CPU; bit j of a row set = token j allowed."""
    rows: dict[int, int]
    """seq_id -> its row in `bitmask`."""
    stats: StructuredOutputStats

    def apply(self, logits: Tensor, seq_ids: Sequence[int]) -> None:
        """Set the disallowed tokens of every constrained row of logits [len(seq_ids), vocab]
        to -inf, in place (masking.py: one vectorized op). Rows of unconstrained samples are not
        touched."""
        t0 = time.perf_counter()
        positions, mask_rows = [], []
        for i, seq_id in enumerate(seq_ids):
            row = self.rows.get(seq_id)
            if row is not None:
                positions.append(i)
                mask_rows.append(row)
        if positions:
            ordered = mask_rows == list(range(self.bitmask.shape[0]))  # prepare() keeps the batch order
            apply_bitmask_rows(logits, positions, self.bitmask if ordered else self.bitmask[mask_rows])
        self.stats.apply_s += time.perf_counter() - t0


@dataclass(slots=True)
class StructuredStep:
    """What structured output did in one step (a per-step record, filled by prepare and accept)."""

    bitmask: GrammarBitmask | None
    unsatisfiable: set[int] = field(default_factory=set)
    """Samples (seq_ids) no token can continue: they get no token and finish as "unsatisfiable"."""
    terminated: set[int] = field(default_factory=set)
    """Samples (seq_ids) whose grammar accepted its stop token this step: they finish as "stop"."""


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.compiler = GrammarCompiler(tokenizer, vocab_size, stop_token_ids)
        self.vocab_size = vocab_size
        self._states: dict[int, _GrammarState] = {}
        """seq_id -> the sample's grammar matcher; dropped when the scheduler reports it finished."""
        self._bitmask: Tensor | None = None
        self.stats = StructuredOutputStats()

    # -- requests in and out (engine thread) -----------------------------------------------------
    def add(self, seq_id: int, compiled_grammar: Any) -> None:
        """Start the grammar state of one sample from its compiled grammar (compiler.submit)."""
        import xgrammar as xgr

        self._states[seq_id] = _GrammarState(xgr.GrammarMatcher(compiled_grammar))

    def forget(self, seq_ids: Sequence[int]) -> None:
        for seq_id in seq_ids:
            self._states.pop(seq_id, None)

    # -- one step ------------------------------------------------------------------------------
    def prepare(self, sampling: Iterable[Any], finished_seq_ids: Sequence[int]) -> StructuredStep | None:
        """The bitmask rows of the constrained samples that sample this step, or None if none does.
        sampling: the samples (core.request.Sample) that sample this step (their seq_id,
        output_token_ids, sampling_params, eos_token_id are read; iterated only when some sample
        has a grammar); finished_seq_ids: samples finished since the last step, whose states drop."""
        if self._states:
            self.forget(finished_seq_ids)
        if not self._states:
            return None
        constrained = [r for r in sampling if r.seq_id in self._states]
        if not constrained:
            return None
        t0 = time.perf_counter()
        bitmask = self._bitmask_buffer(len(constrained))
        rows: dict[int, int] = {}
        step = StructuredStep(None)
        for row, r in enumerate(constrained):
            state = self._sync(r.seq_id, r.output_token_ids)
            state.matcher.fill_next_token_bitmask(bitmask, row)
            if len(r.output_token_ids) < r.sampling_params.min_tokens:
                self._ban(bitmask[row], r)
            rows[r.seq_id] = row
        bitmask = bitmask[: len(constrained)]
        for row in torch.nonzero((bitmask == 0).all(dim=1)).flatten().tolist():
            seq_id = constrained[row].seq_id
            step.unsatisfiable.add(seq_id)
            del rows[seq_id]
        self.stats.num_steps += 1
        self.stats.num_rows += len(constrained)
        self.stats.fill_s += time.perf_counter() - t0
        if rows:
            step.bitmask = GrammarBitmask(bitmask.clone(), rows, self.stats)
        return step

    def accept(self, step: StructuredStep, sampled: dict[int, int]) -> dict[int, int]:
        """Advance each constrained sample's grammar by its sampled token. Returns `sampled` without
        the samples that get no token (step.unsatisfiable)."""
        t0 = time.perf_counter()
        for seq_id in step.bitmask.rows if step.bitmask is not None else ():
            state = self._states[seq_id]
            token = sampled[seq_id]
            if not state.matcher.accept_token(token):  # the mask allowed it: this is a bug, not input
                logger.error("structured output: sample %d sampled token %d that its grammar rejects",
                             seq_id, token)
                step.unsatisfiable.add(seq_id)
                continue
            state.num_accepted += 1
            if state.matcher.is_terminated():
                step.terminated.add(seq_id)
        self.stats.accept_s += time.perf_counter() - t0
        if step.unsatisfiable:
            sampled = {seq_id: t for seq_id, t in sampled.items() if seq_id not in step.unsatisfiable}
        return sampled

    # -- internals -----------------------------------------------------------------------------
    def _bitmask_buffer(self, rows: int) -> Tensor:
        """A reused int32 [>= rows, ceil(vocab/32)] CPU buffer (xgrammar fills rows of it)."""
        if self._bitmask is None or self._bitmask.shape[0] < rows:
            import xgrammar as xgr

            self._bitmask = xgr.allocate_token_bitmask(max(rows, 64), self.vocab_size)
        return self._bitmask

    def _sync(self, seq_id: int, output_token_ids: Sequence[int]) -> _GrammarState:
        """The sample's grammar state after exactly its output tokens, replayed if it is not."""
        state = self._states[seq_id]
        if state.num_accepted != len(output_token_ids):
            state.matcher.reset()
            state.num_accepted = 0
            for token in output_token_ids:
                if not state.matcher.accept_token(token):
                    break
                state.num_accepted += 1
        return state

    @staticmethod
    def _ban(row: Tensor, r: Any) -> None:
        """Clear the bits of the tokens min_tokens bans (the end token, stop_token_ids), so that a
        grammar that allows nothing else shows up as unsatisfiable instead of an all -inf row."""
        params = r.sampling_params
        banned = list(params.stop_token_ids)
        if r.eos_token_id is not None and not params.ignore_eos:
            banned.append(r.eos_token_id)
        for token in banned:
            word, bit = divmod(token, 32)
            if word < row.shape[0]:
                row[word] &= ~(1 << bit) if bit < 31 else 0x7FFFFFFF
