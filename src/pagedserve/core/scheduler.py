"""Token-budget scheduler: continuous batching and chunked prefill as one mechanism.

Every request has num_computed_tokens catching up with num_tokens. Each iteration the scheduler
gives running requests their next tokens first (a decode is 1 token, an unfinished prefill is a
chunk), then admits waiting requests while the token budget, max_num_seqs and free blocks allow.
When blocks run out, the most recently admitted running request is preempted by recompute: its
blocks are freed and it goes back to the front of the waiting queue, keeping its output tokens.

The scheduler builds and owns the KV cache manager: the engine asks it, not the manager, whether a
request can ever fit, how much is queued, and to reset the cache after a failed step. It decides
every finish in one place per step (update_from_output): length, EOS, stop tokens, a grammar that
terminated or that no token can continue, an expired deadline; a stop string, which only the
output stage can see, is handed back through finish_sample, as an abort is.

Each SchedulerOutput is a delta against what the model runner already holds (core/step_types.py):
a sample's static data when it is admitted (again, after a preemption), then per step only its
tokens and the block ids its tables gained, so a step costs O(batch), not O(context).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass

from pagedserve.core.config import SchedulerConfig
from pagedserve.core.kv_cache.layout import KVCacheLayout
from pagedserve.core.kv_cache.manager import KVCacheManager
from pagedserve.core.limits import Deadlines
from pagedserve.core.request import Sample, SampleStatus
from pagedserve.core.scheduling_policy import Admission, make_policy
from pagedserve.core.step_types import NewSample, ScheduledSample, SchedulerOutput, StepResult, StepUpdate
from pagedserve.core.structured_output.manager import GrammarBitmask, StructuredOutputManager, StructuredStep


@dataclass(slots=True)
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions_total: int = 0
    num_prompt_tokens_total: int = 0
    """Prompt tokens of requests that reached their first output token (each prompt counted once)."""
    num_computed_prompt_tokens_total: int = 0
    """Prompt positions actually run through the model: prefix-cache hits excluded, recompute after
    preemption included. What prefix caching saves shows here."""
    num_generation_tokens_total: int = 0
    num_steps_total: int = 0
    prefix_cache_queries_total: int = 0
    """Prompt tokens looked up in the prefix cache."""
    prefix_cache_hits_total: int = 0
    """Of those, tokens served from cached blocks."""
    num_evicted_blocks_total: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, max_model_len: int, *, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool, layout: KVCacheLayout | None = None,
                 max_chunk_tokens: int | None = None,
                 structured_output: StructuredOutputManager | None = None,
                 rope_switch: tuple[int, str] | None = None, max_loras: int | None = None) -> None:
        """The KV cache arguments are KVCacheManager's (core/kv_cache/manager.py).
        structured_output: the constrained samples' grammars; their masks and accepts run here.
        rope_switch: a longrope model's (original_max_position_embeddings, prefix-cache key of its
        long factors): see _switch_to_long_rope.
        max_loras: the most distinct LoRA adapters the running requests may use (None: LoRA off)."""
        self.max_loras = max_loras
        self.config = config
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching, layout, max_chunk_tokens)
        self.structured_output = structured_output
        self.deadlines = Deadlines()
        self._ended: list[Sample] = []  # finished since the last update without a token of theirs
        self._grammar: StructuredStep | None = None  # this step's masks, for update_from_output
        self.max_model_len = max_model_len
        self.waiting: deque[Sample] = deque()
        self.running: list[Sample] = []
        self.samples: dict[int, Sample] = {}
        """seq_id -> live sample: maps a step's seq_ids back to their samples (the samples
        themselves belong to the engine's EngineRequest, core/request.py)."""
        self._finished_since_last_step: list[int] = []
        self._runner_table_lengths: dict[int, int] = {}
        """seq_id -> block table entries the runner holds for a running sample (its step deltas
        send the rest); absent for a sample the runner does not hold: it is sent as new."""
        self.stats = SchedulerStats()
        self.policy = make_policy(config.scheduling_policy, config.scheduling_age_bound_s)
        self.rope_switch = rope_switch
        self._long_rope: set[int] = set()
        """seq_ids of samples restarted on the long rope factors (_switch_to_long_rope)."""
        self._restarted: list[int] = []
        """Running samples restarted since the last step, which the runner must drop."""

    # -- samples in and out ----------------------------------------------------------------
    def add_sample(self, request: Sample) -> None:
        self.samples[request.seq_id] = request
        self.waiting.append(request)
        self.deadlines.add(request)

    def finish_sample(self, request: Sample, status: SampleStatus,
                       stop_reason: str | int | None = None) -> bool:
        """Finish a live sample from outside (abort, timeout, stop string, grammar) and free its
        blocks at once. Returns False, changing nothing, if it had already finished."""
        if self.samples.get(request.seq_id) is not request:
            return False
        if request.status == SampleStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.stop_reason = stop_reason
        self._finish(request, status)
        self._refresh_stats()
        return True

    def max_fitting_tokens(self, num_tokens: int) -> int | None:
        """None when a sample of `num_tokens` (prompt + max_tokens) fits the whole KV cache;
        otherwise the most tokens one sample can hold, for the error."""
        return None if self.kv.can_fit(num_tokens) else self.kv.max_fitting_tokens(num_tokens)

    def backlog_beyond_free_slots(self, arriving: int) -> tuple[int, int] | None:
        """(samples, tokens still to compute) queued beyond the running batch's free slots if
        `arriving` more samples came now; None when they would all start at once (a burst that
        arrives between two steps into free slots is no overload)."""
        free_slots = max(self.config.max_num_seqs - len(self.running), 0)
        if len(self.waiting) + arriving <= free_slots:
            return None
        queued = list(itertools.islice(self.waiting, free_slots, None))
        return len(queued), sum(r.num_tokens - r.num_computed_tokens for r in queued)

    def reset_after_abort_all(self) -> None:
        """After every request was aborted (a failed step): forget every prefix-cache entry (the
        step may have left blocks half written) and check nothing is scheduled or held."""
        if self.samples or self.waiting or self.running:
            raise RuntimeError("requests are still scheduled after aborting every request")
        self.deadlines.clear()
        self._ended.clear()
        self.kv.reset_prefix_cache()
        self.kv.check_invariants()
        if self.kv.num_used_blocks:
            raise RuntimeError(f"{self.kv.num_used_blocks} KV blocks still in use after aborting every request")

    def has_unfinished_requests(self) -> bool:
        return bool(self.samples)

    # -- one iteration -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        # 0. Samples past their deadline end ("timeout") before anything is scheduled.
        for request in self.deadlines.pop_expired():
            if self.finish_sample(request, SampleStatus.FINISHED_TIMEOUT):
                self._ended.append(request)
        budget = self.config.max_num_batched_tokens
        num_new: dict[int, int] = {}
        """seq_id -> tokens scheduled this step."""
        preempted: list[Sample] = []

        # 1. Running requests first, in admission order, so decodes never wait behind prefills.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            self._switch_to_long_rope(request)
            n = self._num_tokens_to_compute(request, budget)
            while self.kv.allocate_slots(request, n) is None:
                victim = self.running.pop()  # the most recently admitted
                self._preempt(victim)
                preempted.append(victim)
                num_new.pop(victim.seq_id, None)
                if victim is request:
                    break
            else:
                num_new[request.seq_id] = n
                budget -= n
                i += 1
                continue
            break  # the request itself was preempted: nothing after it is running

        # 2. Admit waiting requests in the policy's order, unless this iteration already had to preempt.
        #    Samples 2..n of a request wait (without blocking others) until their leader has
        #    computed the prompt, then start from the leader's prompt blocks.
        #    The policy orders the queue and may defer a request or stop admission (fcfs never does).
        skipped: list[Sample] = []
        if not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            reordered = self.policy.order(self.waiting, self.running, self.kv)
            if reordered is not None:
                self.waiting.clear()
                self.waiting.extend(reordered)
        # A request whose LoRA adapter would be one more than max_loras among the running ones
        # waits (without blocking others) until a running adapter's requests have all left.
        adapters = {r.lora_id for r in self.running if r.lora_id} if self.max_loras is not None else set()
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if self._waits_for_leader(request) or self._waits_for_lora_slot(request, adapters):
                skipped.append(self.waiting.popleft())
                continue
            self._switch_to_long_rope(request)  # before the prefix lookup: it changes the salt
            hits, num_hit_tokens, from_leader = self._reusable_blocks(request)
            admission = self.policy.admit(request, hits, num_new, self.running, self.kv)
            if admission is Admission.DEFER:
                skipped.append(self.waiting.popleft())
                continue
            if admission is Admission.STOP:
                break
            n = self._num_tokens_to_compute(request, budget, already=num_hit_tokens)
            if self.kv.allocate_slots(request, n, hits) is None:
                break
            self.waiting.popleft()
            if request.num_computed_tokens == 0 and not from_leader:
                self.kv.record_prefix_lookup(request, num_hit_tokens)  # once, on admission
            request.num_computed_tokens += num_hit_tokens
            request.status = SampleStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
                request.num_cached_tokens = num_hit_tokens
            self.running.append(request)
            if request.lora_id:
                adapters.add(request.lora_id)
            num_new[request.seq_id] = n
            budget -= n
        self.waiting.extendleft(reversed(skipped))

        new_samples: list[NewSample] = []
        scheduled = tuple(self._scheduled(r, num_new[r.seq_id], new_samples) for r in self.running
                          if r.seq_id in num_new)
        total = sum(num_new.values())
        if scheduled or self.samples:  # a step with nothing left to run (all just timed out) is none
            self.stats.num_steps_total += 1
        finished, self._finished_since_last_step = tuple(self._finished_since_last_step), []
        self._refresh_stats()
        dropped = (*(r.seq_id for r in preempted), *self._restarted)
        self._restarted.clear()
        return SchedulerOutput(tuple(new_samples), scheduled, total, dropped, finished)

    def _waits_for_lora_slot(self, request: Sample, adapters: set[int]) -> bool:
        return (self.max_loras is not None and request.lora_id != 0 and request.lora_id not in adapters
                and len(adapters) >= self.max_loras)

    @staticmethod
    def _waits_for_leader(request: Sample) -> bool:
        leader = request.prompt_leader
        return (leader is not None and not leader.status.finished
                and leader.num_computed_tokens < leader.num_prompt_tokens)

    def _reusable_blocks(self, request: Sample):
        """KV blocks a newly admitted request can start from: its leader's prompt blocks when it is
        a sample of an n > 1 request whose leader is running, else prefix-cache hits.
        Returns (blocks, their tokens, whether they came from the leader)."""
        if request.num_computed_tokens != 0:
            return [], 0, False
        leader = request.prompt_leader
        # A sample restarted on the long rope factors cannot use its leader's short-factor prompt blocks.
        if leader is not None and leader.status == SampleStatus.RUNNING and request.seq_id not in self._long_rope:
            blocks, num_tokens = self.kv.get_shared_prompt_blocks(leader, request)
            # A sliding-window group may have freed what the sample needs: try the prefix cache then.
            if num_tokens or self.kv.null_block is None:
                return blocks, num_tokens, True
        return (*self.kv.get_computed_blocks(request), False)

    def _num_tokens_to_compute(self, request: Sample, budget: int, already: int = 0) -> int:
        n = request.num_tokens - request.num_computed_tokens - already
        if self.config.long_prefill_token_threshold is not None:
            n = min(n, self.config.long_prefill_token_threshold)
        return max(min(n, budget), 0)

    def _scheduled(self, request: Sample, n: int, new_samples: list[NewSample]) -> ScheduledSample:
        """The sample's step delta for the runner; its static data goes to new_samples first if the
        runner does not hold it (admitted now, or back after a preemption)."""
        known = self._runner_table_lengths.get(request.seq_id)
        if known is None:
            new_samples.append(NewSample(request.seq_id, request.prompt_token_ids, request.sampling_params,
                                         request.eos_token_id, tuple(request.output_token_ids), request.lora_id))
            known = 0
        new_block_ids, num_null, self._runner_table_lengths[request.seq_id] = self.kv.table_delta(request, known)
        start = request.num_computed_tokens
        return ScheduledSample(
            seq_id=request.seq_id,
            token_ids=tuple(request.token_ids_slice(start, start + n)),
            start_position=start,
            sample=start + n == request.num_tokens,
            new_block_ids=new_block_ids,
            num_null_blocks=num_null,
        )

    def _switch_to_long_rope(self, request: Sample) -> None:
        """Phi-3's longrope as transformers generates: a sample whose prompt fits
        original_max_position_embeddings runs on the short factors; once it grows past that length,
        transformers discards its cache and recomputes every token on the long factors
        (Phi3ForCausalLM.prepare_inputs_for_generation). Here the sample's blocks are freed and it
        recomputes its whole sequence from position 0, as a recompute after preemption does (the
        runner rotates by the sample's current length, now past the switch), under the prefix-cache
        salt of long-factor prompts, which its blocks may now be shared with. Once per sample."""
        switch = self.rope_switch
        if (switch is None or request.num_prompt_tokens > switch[0] or request.num_tokens <= switch[0]
                or request.seq_id in self._long_rope):
            return
        self._long_rope.add(request.seq_id)
        self.kv.free(request)
        # The runner drops its copy (sent with the preempted ids) and gets the sample anew.
        if self._runner_table_lengths.pop(request.seq_id, None) is not None:
            self._restarted.append(request.seq_id)
        self.kv.forget(request)  # its block hashes are salted for the short factors
        request.num_computed_tokens = 0
        request.cache_salt = f"{request.cache_salt or ''}\x00{switch[1]}"

    def _preempt(self, request: Sample) -> None:
        self.kv.free(request)
        self._runner_table_lengths.pop(request.seq_id, None)  # the runner drops it too (preempted_seq_ids)
        request.num_computed_tokens = 0
        request.status = SampleStatus.PREEMPTED
        request.num_preemptions += 1
        self.stats.num_preemptions_total += 1
        self.waiting.appendleft(request)

    # -- after the forward pass ----------------------------------------------------------------
    def grammar_bitmask(self, scheduler_output: SchedulerOutput) -> GrammarBitmask | None:
        """The token masks of this step's constrained samples, or None when none samples; their
        grammars accept the sampled tokens in update_from_output."""
        so = self.structured_output
        if so is None:
            self._grammar = None
        else:  # the samples that sample this step, looked up only when some sample has a grammar
            sampling = (self.samples[s.seq_id] for s in scheduler_output.scheduled if s.sample)
            self._grammar = so.prepare(sampling, scheduler_output.finished_seq_ids)
        return self._grammar.bitmask if self._grammar is not None else None

    def update_from_output(self, scheduler_output: SchedulerOutput, sampled: dict[int, int]) -> StepResult:
        """Accept the constrained samples' tokens in their grammars, advance computed tokens, append
        sampled tokens, and decide every finish of the step (EOS, stop token ids, length, a grammar
        terminated or unsatisfiable; deadlines were decided in schedule()), freeing the blocks of
        finished samples. `updates`: (sample, new token or None) for every scheduled sample, in
        batch order; `ended`: the samples that finished without a token of theirs."""
        grammar, self._grammar = self._grammar, None
        if grammar is not None:
            sampled = self.structured_output.accept(grammar, sampled)  # unsatisfiable ones get no token
        updates = self._apply_tokens(scheduler_output, sampled)
        if grammar is not None:
            for request, _token in updates:
                # A grammar that accepted its stop token is complete: the sample stops there, even
                # where the token rules would go on (ignore_eos, a second EOS id).
                if request.seq_id in grammar.terminated:
                    self.finish_sample(request, SampleStatus.FINISHED_STOPPED)
            for seq_id in grammar.unsatisfiable:  # no token fits the constraint: end it, say why
                request = self.samples.get(seq_id)
                if request is not None and self.finish_sample(request, SampleStatus.FINISHED_UNSATISFIABLE):
                    self._ended.append(request)
        ended, self._ended = self._ended, []
        return StepResult(updates, ended)

    def _apply_tokens(self, scheduler_output: SchedulerOutput, sampled: dict[int, int]) -> list[StepUpdate]:
        """Advance computed tokens, append sampled tokens, apply the token-level stop rules."""
        outputs: list[StepUpdate] = []
        for sched in scheduler_output.scheduled:
            request = self.samples[sched.seq_id]
            n = len(sched.token_ids)
            self.stats.num_computed_prompt_tokens_total += max(
                0, min(request.num_prompt_tokens, sched.start_position + n) - sched.start_position
            )
            request.num_computed_tokens += n
            token = sampled.get(sched.seq_id) if sched.sample else None
            if token is None:
                outputs.append((request, None))
                continue
            if request.num_output_tokens == 0:
                self.stats.num_prompt_tokens_total += request.num_prompt_tokens
            request.output_token_ids.append(token)
            self.stats.num_generation_tokens_total += 1
            status = self._check_stop(request, token)
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
            outputs.append((request, token))
        self._refresh_stats()
        return outputs

    def _check_stop(self, request: Sample, token: int) -> SampleStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token == request.eos_token_id and not params.ignore_eos:
                return SampleStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                request.stop_reason = token
                return SampleStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return SampleStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Sample, status: SampleStatus) -> None:
        request.status = status
        self.kv.free(request)
        self.kv.forget(request)
        self._runner_table_lengths.pop(request.seq_id, None)
        self._long_rope.discard(request.seq_id)
        del self.samples[request.seq_id]
        self._finished_since_last_step.append(request.seq_id)

    def _refresh_stats(self) -> None:
        s = self.stats
        s.num_running = len(self.running)
        s.num_waiting = len(self.waiting)
        kv = self.kv
        s.kv_cache_usage = kv.usage
        s.prefix_cache_queries_total = kv.prefix_stats.queries
        s.prefix_cache_hits_total = kv.prefix_stats.hits
        s.num_evicted_blocks_total = kv.num_evicted_blocks
