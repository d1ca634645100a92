"""Turn the scheduler's per-sample tokens into RequestOutput deltas.

Runs on the engine thread after every step: incremental detokenization, stop strings, logprobs,
per-request timing and the latency histograms. Its state per sample lives on the sample itself
(the output fields of core.request.Sample); it never changes a sample's status. A stop string it
finds is reported back (ProcessedOutputs.stopped) and the engine has the scheduler finish the
sample, so its blocks are freed in the same step, as vLLM's output processor returns
`reqs_to_abort`. Where the token that completes a stop string also ended the sample in the
scheduler (max_tokens), the output still says finish_reason "stop": the stop string wins.
"""

from __future__ import annotations

import time

from pagedserve.core.detokenizer import IncrementalDetokenizer
from pagedserve.core.metrics import EngineMetrics
from pagedserve.core.outputs import RequestOutput, RequestTiming, TokenLogprobs
from pagedserve.core.request import Sample, SampleStatus
from pagedserve.core.step_types import ProcessedOutputs, RunnerOutput, StepUpdate


class OutputProcessor:
    def __init__(self, tokenizer, metrics: EngineMetrics) -> None:
        self.tokenizer = tokenizer
        self.metrics = metrics

    def add(self, request: Sample, detokenize: bool) -> None:
        """Set up a new sample's output state."""
        params = request.sampling_params
        if detokenize:
            request.detokenizer = IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                stop=params.stop, include_stop_str_in_output=params.include_stop_str_in_output,
                min_tokens=params.min_tokens)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]  # the first prompt token has no context to be scored in

    def process(self, updates: list[StepUpdate], runner_out: RunnerOutput) -> ProcessedOutputs:
        now = time.monotonic()
        outputs: list[RequestOutput] = []
        stopped: list[tuple[Sample, str]] = []
        prompt_logprobs = runner_out.prompt_logprobs
        for request, token in updates:
            if prompt_logprobs and request.prompt_logprobs is not None:
                request.prompt_logprobs.extend(prompt_logprobs.get(request.seq_id, ()))
            if token is None:
                continue
            self._observe_timing(request, now)
            logprobs = runner_out.logprobs.get(request.seq_id)
            if logprobs is not None:
                request.cumulative_logprob += logprobs.logprob
            stop = request.detokenizer.update([token]) if request.detokenizer is not None else None
            if stop is not None:
                # Ends the sample as "stop", even where the same token also hit max_tokens.
                stopped.append((request, stop))
            outputs.append(self._output(request, (token,), (logprobs,) if logprobs is not None else None, now, stop))
        return ProcessedOutputs(outputs, stopped)

    def final_output(self, request: Sample) -> RequestOutput:
        """The final output of a sample the scheduler finished outside a sampled token (abort,
        timeout, unsatisfiable constraint)."""
        return self._output(request, (), None, time.monotonic(), None)

    def _observe_timing(self, request: Sample, now: float) -> None:
        if request.first_token_time is None:
            request.first_token_time = now
            self.metrics.observe_first_token(now - request.arrival_time)
        else:
            self.metrics.observe_inter_token(now - request.last_token_time)
        request.last_token_time = now

    def _output(self, request: Sample, tokens: tuple[int, ...], logprobs: tuple[TokenLogprobs, ...] | None,
                now: float, stop: str | None) -> RequestOutput:
        """stop: a stop string this step's token completed (the sample ends as "stop")."""
        status, stop_reason = request.status, request.stop_reason
        if stop is not None:
            status, stop_reason = SampleStatus.FINISHED_STOPPED, stop
        finished = status.finished
        detok = request.detokenizer
        text = detok.get_delta(finished) if detok is not None else ""
        if finished and detok is not None and detok.matched_stop is not None and status != SampleStatus.FINISHED_STOPPED:
            # text held back until the end completed a stop string: it ends the sample as a stop
            status, stop_reason = SampleStatus.FINISHED_STOPPED, detok.matched_stop
        prompt_logprobs = None
        if request.prompt_logprobs is not None and not request.sent_prompt_logprobs and (tokens or finished):
            prompt_logprobs = tuple(request.prompt_logprobs)
            request.sent_prompt_logprobs = True
        timing = None
        if finished:
            timing = RequestTiming(request.arrival_time, request.first_scheduled_time, request.first_token_time, now)
            self.metrics.observe_finished(status.finish_reason, now - request.arrival_time)
        wants_logprobs = request.sampling_params.logprobs is not None
        return RequestOutput(
            request_id=request.request_id,
            index=request.index,
            new_token_ids=tokens,
            text=text,
            finished=finished,
            finish_reason=status.finish_reason,
            stop_reason=stop_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            prompt_token_ids=request.prompt_token_ids,
            logprobs=logprobs if wants_logprobs else None,
            cumulative_logprob=request.cumulative_logprob if wants_logprobs else None,
            prompt_logprobs=prompt_logprobs,
            timing=timing,
            num_cached_tokens=request.num_cached_tokens or 0,
        )
