"""Turn the scheduler's per-sample tokens into RequestOutput deltas.

Runs on the engine thread after every step: incremental detokenization, stop strings (which
finish a sample through the scheduler, so its blocks are freed in the same step), logprobs,
per-request timing and the latency histograms.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.core.detokenizer import IncrementalDetokenizer
from pagedserve.core.metrics import EngineMetrics
from pagedserve.core.outputs import RequestOutput, RequestTiming, TokenLogprobs
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.step_types import RunnerOutput


@dataclass(slots=True, eq=False)
class SampleState:
    request: Request
    parent_id: str
    index: int
    detokenizer: IncrementalDetokenizer | None
    first_token_time: float | None = None
    last_token_time: float | None = None
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    sent_prompt_logprobs: bool = False


class OutputProcessor:
    def __init__(self, tokenizer, metrics: EngineMetrics,
                 finish: Callable[[str, RequestStatus, str | int | None], Request | None]) -> None:
        self.tokenizer = tokenizer
        self.metrics = metrics
        self._finish = finish
        self.samples: dict[str, SampleState] = {}

    def add(self, request: Request, parent_id: str, index: int, detokenize: bool) -> None:
        params = request.sampling_params
        detok = None
        if detokenize:
            detok = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output)
        state = SampleState(request, parent_id, index, detok)
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]  # the first prompt token has no context to be scored in
        self.samples[request.request_id] = state

    def process(self, updates: list[tuple[Request, int]], runner_out: RunnerOutput) -> list[RequestOutput]:
        now = time.monotonic()
        for request_id, entries in runner_out.prompt_logprobs.items():
            state = self.samples.get(request_id)
            if state is not None and state.prompt_logprobs is not None:
                state.prompt_logprobs.extend(entries)
        outputs = []
        for request, token in updates:
            state = self.samples[request.request_id]
            self._observe_timing(state, now)
            logprobs = runner_out.logprobs.get(request.request_id)
            if logprobs is not None:
                state.cumulative_logprob += logprobs.logprob
            if state.detokenizer is not None:
                stop = state.detokenizer.update([token])
                if stop is not None and not request.status.finished:
                    self._finish(request.request_id, RequestStatus.FINISHED_STOPPED, stop)
                elif stop is not None:  # the same token also hit max_tokens: the stop string wins
                    request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop
            outputs.append(self._output(state, (token,), (logprobs,) if logprobs is not None else None, now))
        return outputs

    def abort(self, request: Request) -> RequestOutput:
        """The final output of a sample finished outside a sampled token (abort, unsatisfiable constraint)."""
        return self._output(self.samples[request.request_id], (), None, time.monotonic())

    def _observe_timing(self, state: SampleState, now: float) -> None:
        if state.first_token_time is None:
            state.first_token_time = now
            self.metrics.observe_first_token(now - state.request.arrival_time)
        else:
            self.metrics.observe_inter_token(now - state.last_token_time)
        state.last_token_time = now

    def _output(self, state: SampleState, tokens: tuple[int, ...],
                logprobs: tuple[TokenLogprobs, ...] | None, now: float) -> RequestOutput:
        request = state.request
        finished = request.status.finished
        text = state.detokenizer.get_delta(finished) if state.detokenizer is not None else ""
        if finished and state.detokenizer is not None and state.detokenizer.matched_stop is not None \
                and request.status != RequestStatus.FINISHED_STOPPED:
            # text held back until the end completed a stop string: it ends the sample as a stop
            request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, state.detokenizer.matched_stop
        prompt_logprobs = None
        if state.prompt_logprobs is not None and not state.sent_prompt_logprobs and (tokens or finished):
            prompt_logprobs = tuple(state.prompt_logprobs)
            state.sent_prompt_logprobs = True
        timing = None
        if finished:
            del self.samples[request.request_id]
            timing = RequestTiming(request.arrival_time, request.first_scheduled_time, state.first_token_time, now)
            self.metrics.observe_finished(request.status.finish_reason, now - request.arrival_time)
        wants_logprobs = request.sampling_params.logprobs is not None
        return RequestOutput(
            request_id=state.parent_id,
            index=state.index,
            new_token_ids=tokens,
            text=text,
            finished=finished,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            prompt_token_ids=request.prompt_token_ids,
            logprobs=logprobs if wants_logprobs else None,
            cumulative_logprob=state.cumulative_logprob if wants_logprobs else None,
            prompt_logprobs=prompt_logprobs,
            timing=timing,
            num_cached_tokens=request.num_cached_tokens or 0,
        )
