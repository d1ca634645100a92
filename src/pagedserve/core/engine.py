"""LLMEngine: add_request / abort_request / step, and an offline generate()."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from pagedserve.core.config import DEFAULT_CPU_KV_CACHE_MEMORY, EngineConfig
from pagedserve.core.cpu_threads import ThreadPlan, allowed_cpus, thread_plan
from pagedserve.core.helper_thread import HelperThread
from pagedserve.core.thread_governor import ThreadGovernor, name_compute_threads
from pagedserve.core.errors import ConfigError, DuplicateRequest, InvalidRequest, LoRANotEnabled
from pagedserve.core.kv_cache.cache_tensors import KVCacheSpec, make_kv_cache_spec
from pagedserve.core.kv_cache.layout import make_kv_cache_layout
from pagedserve.core.kv_cache.manager import KVCacheManager
from pagedserve.core.kv_cache.prefix_hash import check_cache_salt
from pagedserve.core.layers.attention import select_attention_backend
from pagedserve.core.layers.onednn_cache import bound_onednn_caches
from pagedserve.core.input_processor import InputProcessor
from pagedserve.core.limits import WaitingQueueGuard
from pagedserve.core.lora.manager import LoRAManager, LoRAStats, lora_stats
from pagedserve.core.lora.peft import projection_shapes
from pagedserve.core.lora.slots import LoRASlots
from pagedserve.core.metrics import EngineMetrics
from pagedserve.core.model_runner import ModelRunner
from pagedserve.core.models.arch import ModelArch
from pagedserve.core.models.default_model import resolve_model_path
from pagedserve.core.models.int8_calibration import CALIBRATION_PROMPTS, calibrated_quantizer
from pagedserve.core.models.loader import load_decoder, round_to_nearest
from pagedserve.core.output_processor import OutputProcessor
from pagedserve.core.outputs import CompletionResult, RequestOutput
from pagedserve.core.request import EngineRequest, Sample, SampleStatus
from pagedserve.core.sampling_params import SamplingParams
from pagedserve.core.scheduler import Scheduler, SchedulerStats
from pagedserve.core.step_types import RunnerOutput, StepResult
from pagedserve.core.workload import WorkloadRecorder
from pagedserve.core.structured_output.manager import StructuredOutputManager
from pagedserve.kernels.cpu.isa import native_bf16

logger = logging.getLogger(__name__)

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={name!r} but no CUDA device is available; use device='cpu' or 'auto'")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda" or native_bf16():  # AMX / AVX512-BF16: bf16 beats fp32
            return torch.bfloat16
        return torch.float32
    return _TORCH_DTYPES[name]


class _Stopwatch:
    """mark(name) records the seconds since the previous mark under `name`."""

    def __init__(self, into: dict[str, float]) -> None:
        self.into, self.last = into, time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.into[name] = now - self.last
        self.last = now


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        started = time.perf_counter()
        from transformers import AutoConfig, AutoTokenizer  # heavy import, only when an engine starts

        self.load_seconds: dict[str, float] = {}
        """Where construction spent its time (logged, and printed by bench/startup.py)."""
        mark = _Stopwatch(self.load_seconds)
        mark("import transformers")
        self.config = config = config or EngineConfig()
        mc, cc = config.model, config.cache
        self.model_path = resolve_model_path(mc.model)
        torch.manual_seed(mc.seed)
        self.device = resolve_device(mc.device)
        self.dtype = resolve_dtype(mc.dtype, self.device)
        hf_config = AutoConfig.from_pretrained(self.model_path, local_files_only=True)
        self.arch = ModelArch.from_hf_config(hf_config)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path, local_files_only=True)
        mark("config and tokenizer")
        self.max_model_len = mc.max_model_len or self.arch.max_position_embeddings
        if self.max_model_len > self.arch.max_position_embeddings and not self.arch.rope_extends_context:
            # A warning, as it has always been in effect (transformers 5 fills rope parameters in
            # every config, so the check never fired before rope_extends_context): rotary
            # positions are defined past the limit, and configs and tests rely on it.
            logger.warning("max_model_len=%d exceeds the model's max_position_embeddings=%d and its rope "
                           "does not extend the context: positions past %d are outside what it was trained on",
                           self.max_model_len, self.arch.max_position_embeddings, self.arch.max_position_embeddings)
        self.eos_token_id = self.arch.eos_token_ids[0] if self.arch.eos_token_ids else self.tokenizer.eos_token_id
        self.threads = self._start_threads()
        if self.device.type == "cpu":
            bound_onednn_caches()  # before the first oneDNN primitive: packing the weights
        kernels = select_attention_backend(mc.attention_backend, self.device)
        mark("kernels")
        if mc.quantization is not None and self.device.type != "cpu":
            raise ConfigError(f"quantization={mc.quantization!r} runs on CPU only (device resolved to "
                              f"{self.device}); set device to cpu, or leave quantization unset")
        calibrated = None
        if mc.quantization == "int8":  # calibrated rounding (core/models/int8_calibration.py)
            calibrated = calibrated_quantizer(self.model_path, self._unquantized_engine)
            mark("int8 calibration")
        model = load_decoder(self.model_path, self.arch, self.dtype, self.device, self.max_model_len, kernels,
                             mc.quantization, calibrated or round_to_nearest)
        if calibrated is not None:
            calibrated.store()
        mark("weights")
        # Layer groups (sliding-window layers keep only their window): core/kv_cache/layout.py.
        self.kv_layout = layout = make_kv_cache_layout(self.arch.sliding_windows,
                                                       hybrid=not cc.disable_hybrid_kv_cache_manager)
        # KV cache dtype, scales (int8/fp8) and bytes per block: core/kv_cache/cache_tensors.py.
        self.kv_cache_spec = kv_spec = make_kv_cache_spec(
            cc.kv_cache_dtype, self.dtype, self.arch.num_layers, cc.block_size, self.arch.num_kv_heads,
            self.arch.head_dim, self.model_path, layout.layers_per_block)
        self.num_kv_blocks = self._num_kv_blocks(kv_spec)
        lc = config.lora
        self.lora = LoRAManager(lc, self.arch, self.dtype) if lc.enable_lora else None
        """The loaded LoRA adapters (core/lora/manager.py); None when enable_lora is off."""
        lora_slots = None if self.lora is None else LoRASlots(
            projection_shapes(self.arch), self.arch.num_layers, lc.max_loras, lc.max_lora_rank, self.dtype,
            self.device, kernels, self.lora.weights)
        for name, path in lc.lora_modules.items():
            self.lora.add(name, path)
        self.runner = ModelRunner(model, self.num_kv_blocks, cc.block_size, kv_spec, layout, lora_slots)
        if self.threads.enabled:
            model.between_layers = self.threads.poll
        mark("KV cache")
        self._ids = itertools.count()
        self._requests: dict[str, EngineRequest] = {}
        """Every live request by request_id: the engine's one record of a request and its samples,
        from add_request until its last final output (core/request.py says who owns what)."""
        self.metrics = EngineMetrics()
        self.output_processor = OutputProcessor(self.tokenizer, self.metrics)
        self.inputs = InputProcessor(self.tokenizer, self.arch, self.max_model_len, self.model_path)
        """Prompts and parameters checked before anything is queued (thread-safe but for check_lengths)."""
        self.queue_guard = WaitingQueueGuard(config.limits, self.metrics)
        record = config.scheduler.record_workload
        self.workload_recorder = WorkloadRecorder(record) if record else None
        stop_ids = list(self.arch.eos_token_ids) or ([self.eos_token_id] if self.eos_token_id is not None else [])
        self.structured_output = StructuredOutputManager(self.tokenizer, self.arch.vocab_size, stop_ids)
        """Grammar compilation (thread-safe: `structured_output.compiler.submit`) and per-sample grammar
        state for constrained requests (core/structured_output); the scheduler masks and accepts."""
        self.scheduler = Scheduler(config.scheduler, self.max_model_len, num_blocks=self.num_kv_blocks,
                                   block_size=cc.block_size, enable_prefix_caching=cc.enable_prefix_caching,
                                   layout=layout, max_chunk_tokens=self._max_chunk_tokens(),
                                   structured_output=self.structured_output, rope_switch=self._rope_switch(),
                                   max_loras=lc.max_loras if lc.enable_lora else None)
        self._publish_metrics()
        logger.info("pagedserve engine: %s on %s in %s, %d KV blocks of %d tokens; loaded in %.2fs (%s)",
                    self.model_path, self.device, self.dtype, self.num_kv_blocks, cc.block_size,
                    time.perf_counter() - started, ", ".join(f"{k} {v:.2f}s" for k, v in self.load_seconds.items()))

    def _rope_switch(self) -> tuple[int, str] | None:
        """A longrope model's switch length and the prefix-cache key of its long factors (Scheduler)."""
        model = self.runner.model
        switch = getattr(model, "rope_switch_length", None)
        return None if switch is None else (switch, model.prefix_cache_key(switch + 1))

    def _start_threads(self) -> ThreadGovernor:
        """The compute threads: what the process may use (core/cpu_threads.py), adjusted while it
        runs to the cores other work leaves (core/thread_governor.py). Set here, on the thread that
        will step the engine: an OpenMP thread count belongs to the thread that sets it."""
        if self.device.type != "cpu":
            return ThreadGovernor(ThreadPlan(torch.get_num_threads(), False, "not a CPU engine"), torch.set_num_threads)
        plan = thread_plan()
        named = name_compute_threads()  # before the first parallel region starts the workers
        torch.set_num_threads(plan.start)
        logger.info("compute threads: %d (%s)%s", plan.start, plan.why,
                    "; adjusted to the cores other work leaves" if plan.adaptive and plan.start > 1 else "")
        helper = HelperThread.for_this_process(allowed_cpus()) if plan.adaptive and plan.start > 1 else None
        if helper is not None:  # an engine dropped while at one thread leaves no pinned thread behind
            weakref.finalize(self, helper.stop)
        return ThreadGovernor(plan, torch.set_num_threads, compute_threads_named=named, helper=helper)

    def _unquantized_engine(self) -> LLMEngine:
        """This model in float32 without quantization, for int8's calibration run (two dozen short requests)."""
        mc = self.config.model
        return LLMEngine(EngineConfig.from_dict({
            "model": str(self.model_path), "dtype": "float32", "device": mc.device, "seed": mc.seed,
            "attention_backend": mc.attention_backend, "max_model_len": min(self.max_model_len, 1024),
            "max_num_seqs": len(CALIBRATION_PROMPTS)}))

    def _max_chunk_tokens(self) -> int:
        """Most tokens one sample computes in a step (what a sliding-window group holds beyond its window)."""
        sc = self.config.scheduler
        return min(sc.max_num_batched_tokens, sc.long_prefill_token_threshold or sc.max_num_batched_tokens)

    def _num_kv_blocks(self, kv_spec: KVCacheSpec) -> int:
        """Blocks that fit the memory budget; a block's bytes include int8/fp8 scales."""
        cc = self.config.cache
        if cc.num_kv_blocks is not None:
            return cc.num_kv_blocks
        per_block = kv_spec.bytes_per_block
        if cc.kv_cache_memory is not None:
            budget = cc.kv_cache_memory
        elif self.device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(self.device)
            budget = int(free * cc.gpu_memory_utilization)
        else:
            # The CPU default is a cap, not a reservation: no more than max_num_seqs sequences of
            # max_model_len tokens can ever need (blocks are also only touched when used, see
            # cache_tensors.lazy_zeros), so kv_cache_usage_perc is a share of a pool that can fill.
            budget = DEFAULT_CPU_KV_CACHE_MEMORY
            blocks_per_seq = self.kv_layout.max_blocks_per_seq(self.max_model_len, cc.block_size,
                                                               self._max_chunk_tokens())
            budget = min(budget, self.config.scheduler.max_num_seqs * blocks_per_seq * per_block)
        # A layout that frees blocks has one more row for its null block: it comes out of the budget.
        num_blocks = kv_spec.num_blocks(budget) - int(self.kv_layout.frees_blocks)
        if num_blocks < 1:
            raise ConfigError(
                f"kv_cache_memory={budget} bytes holds no KV block ({per_block} bytes each); raise kv_cache_memory"
            )
        return num_blocks

    # -- requests --------------------------------------------------------------------------------
    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt (core/input_processor.py). Thread-safe."""
        return self.inputs.tokenize(prompt)

    def prepare_params(self, params: SamplingParams) -> SamplingParams:
        """logit_bias checked and bad_words tokenized (core/input_processor.py). Thread-safe."""
        return self.inputs.prepare_params(params)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: Sequence[dict[str, Any]] | None = None) -> str:
        """Chat messages rendered with the model's template (core/input_processor.py). Thread-safe."""
        return self.inputs.apply_chat_template(messages, add_generation_prompt, tools)

    def add_request(self, request_id: str | None, prompt: str | Sequence[int],
                    params: SamplingParams | None = None, *, cache_salt: str | None = None,
                    use_prefix_cache: bool = True, detokenize: bool = True, deadline: float | None = None,
                    compiled_grammar: Any = None, lora_name: str | None = None) -> str:
        """Queue a request (n samples when params.n > 1); returns its request_id.

        cache_salt: a tenant's salt; only requests with the same salt share cached prompt blocks
        (None, or a non-empty string: check_cache_salt).
        deadline: time.monotonic() after which the request ends with finish_reason "timeout";
        None: arrival + request_timeout when that is configured, else never.
        compiled_grammar: params.structured_output compiled ahead (AsyncLLMEngine awaits
        `structured_output.compiler.submit` off this thread); None compiles it here, blocking.
        lora_name: a loaded LoRA adapter to run with (None: the base model).
        Raises InvalidRequest / RequestTooLong / DuplicateRequest / EngineOverloaded (and for
        lora_name LoRANotEnabled / UnknownLoRAAdapter); nothing is queued then.
        """
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequest(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._requests:
            raise DuplicateRequest(f"request_id={request_id!r} is already running; use a unique id")
        cache_salt = check_cache_salt(cache_salt)
        if lora_name is not None and self.lora is None:
            raise LoRANotEnabled(f"lora_name={lora_name!r} but this engine serves no LoRA adapters; start it with "
                                 "--enable-lora (enable_lora: true)", param="lora_name")
        params = self.inputs.prepare_params(params)
        token_ids = self.inputs.tokenize(prompt)
        if not token_ids:
            raise InvalidRequest("prompt is empty; send at least one token")
        max_tokens = self.inputs.check_lengths(len(token_ids), params, self.scheduler.max_fitting_tokens)
        backlog = self.scheduler.backlog_beyond_free_slots(params.n)  # samples that will have to wait
        if backlog is not None:
            self.queue_guard.check(*backlog, len(token_ids) * params.n)
        if deadline is None and self.config.limits.request_timeout is not None:
            deadline = time.monotonic() + self.config.limits.request_timeout
        if params.prompt_logprobs is not None:
            use_prefix_cache = False  # every prompt position must run to be scored
        rope_key = self.runner.model.prefix_cache_key(len(token_ids))
        if rope_key is not None:
            # A length-dependent rope (longrope past its original length, dynamic NTK) rotates this
            # prompt's keys by its length: they may only be shared with prompts rotated alike.
            cache_salt = f"{cache_salt or ''}\x00{rope_key}"
        if params.structured_output is not None and compiled_grammar is None:
            compiled_grammar = self.structured_output.compiler.compile(params.structured_output)
        lora_id = 0
        if lora_name is not None:  # last of the checks: counted on the adapter from here until dropped
            lora_id = self.lora.acquire(lora_name)
            # K/V computed under one adapter is never reused under another or the base model.
            cache_salt = f"{cache_salt or ''}\x00lora:{lora_id}"
        leader = None
        samples = []
        for index in range(params.n):
            sample_params = params
            if index > 0:  # each sample draws its own tokens; only the first scores the prompt
                seed = None if params.seed is None else (params.seed + index) & 0xFFFF_FFFF_FFFF_FFFF
                sample_params = dataclasses.replace(params, seed=seed, prompt_logprobs=None)
            sample = Sample(
                request_id=request_id, prompt_token_ids=token_ids, sampling_params=sample_params,
                eos_token_id=self.eos_token_id, max_tokens=max_tokens, index=index, cache_salt=cache_salt,
                use_prefix_cache=use_prefix_cache, prompt_leader=leader, deadline=deadline, lora_id=lora_id,
            )
            leader = leader or sample
            if compiled_grammar is not None:  # each sample walks the grammar on its own
                self.structured_output.add(sample.seq_id, compiled_grammar)
            self.output_processor.add(sample, detokenize)
            self.scheduler.add_sample(sample)  # with its deadline, if any
            samples.append(sample)
        self._requests[request_id] = EngineRequest(request_id, tuple(samples), lora_id)
        return request_id

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        """Finish every live sample of the request now (finish_reason "abort") and free its blocks.
        Returns their final outputs (empty if the request is unknown or already finished)."""
        entry = self._requests.pop(request_id, None)
        if entry is not None and self.lora is not None:
            self.lora.release(entry.lora_id)
        outputs = []
        for sample in entry.samples if entry is not None else ():
            if self.scheduler.finish_sample(sample, SampleStatus.FINISHED_ABORTED):
                outputs.append(self.output_processor.final_output(sample))
        self._publish_metrics()
        return outputs

    @property
    def kv_cache_manager(self) -> KVCacheManager:
        """The scheduler's KV cache manager, to inspect (tests, benchmarks); the engine itself asks
        the scheduler."""
        return self.scheduler.kv

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def is_live(self, request_id: str) -> bool:
        """Whether any sample of the request is still queued or running."""
        return request_id in self._requests

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule (expired deadlines end first), run the batch and sample (under
        the constrained samples' grammar masks), let the scheduler decide every finish, and turn
        the result into outputs (docs/engine.md has the diagram)."""
        self.threads.poll()
        sched_out = self.scheduler.schedule()
        runner_out = self.runner.execute(sched_out, self.scheduler.grammar_bitmask(sched_out))
        result = self.scheduler.update_from_output(sched_out, runner_out.sampled)
        return self._outputs(result, runner_out)

    def _outputs(self, result: StepResult, runner_out: RunnerOutput) -> list[RequestOutput]:
        """Detokenize the step's tokens into deltas; a stop string the text completed goes back to
        the scheduler to finish (the output already says "stop"); samples that ended without a
        token get their final output."""
        processed = self.output_processor.process(result.updates, runner_out)
        for request, stop in processed.stopped:
            self.scheduler.finish_sample(request, SampleStatus.FINISHED_STOPPED, stop)
        outputs = processed.outputs + [self.output_processor.final_output(r) for r in result.ended]
        self._forget_finished(outputs)
        self._publish_metrics()
        return outputs

    def _forget_finished(self, outputs: list[RequestOutput]) -> None:
        """Drop a request once every sample has had its final output (all of them are in `outputs`
        or earlier steps' outputs)."""
        for out in outputs:
            if not out.finished:
                continue
            if self.workload_recorder is not None and out.timing is not None:
                self.workload_recorder.record(out.timing.arrival, out.num_prompt_tokens, out.num_output_tokens)
            entry = self._requests.get(out.request_id)
            if entry is not None and entry.finished:
                del self._requests[out.request_id]
                if self.lora is not None:
                    self.lora.release(entry.lora_id)

    def abort_all_after_failure(self) -> list[str]:
        """After a step raised: finish every live request without an output (the caller reports
        the error to each), free their blocks, and forget every prefix-cache entry (blocks
        registered in the failed step may hold K/V that was never written). Raises if the block
        pool is not whole again, i.e. the engine cannot be trusted to go on. Returns the request ids."""
        request_ids = list(self._requests)
        for entry in self._requests.values():
            for sample in entry.samples:
                self.scheduler.finish_sample(sample, SampleStatus.FINISHED_ABORTED)
            self.structured_output.forget([sample.seq_id for sample in entry.samples])
            if self.lora is not None:
                self.lora.release(entry.lora_id)
        self._requests.clear()
        self.scheduler.reset_after_abort_all()
        self.runner.forget_all()  # it may have missed the failed step's delta
        self.metrics.observe_step_failure()
        self._publish_metrics()
        return request_ids

    def _publish_metrics(self) -> None:
        self.metrics.update_from_scheduler(self.scheduler.stats)
        self.latest_metrics = self.metrics.snapshot()
        if self.lora is not None:
            self.latest_lora_stats = self.lora_stats()

    # -- LoRA adapters (docs/lora.md) --------------------------------------------------------------
    def add_lora(self, name: str, path: str) -> None:
        """Load the PEFT adapter at `path` as `name` (the same name and path again: a no-op).
        Raises LoRANotEnabled, or InvalidLoRAAdapter naming what is wrong and the fix."""
        self._lora_manager().add(name, path)

    def remove_lora(self, name: str) -> bool:
        """Stop taking requests for `name` (False if it was not loaded); its running and waiting
        requests run to their end first."""
        return self._lora_manager().remove(name)

    def list_loras(self) -> dict[str, str]:
        """name -> path of the loaded adapters ({} when LoRA is off)."""
        return {} if self.lora is None else self.lora.list()

    def lora_stats(self) -> LoRAStats:
        """The adapters of the running and waiting requests, and max_loras (0 when LoRA is off)."""
        sched = self.scheduler
        return lora_stats(self.lora, sched.running, sched.waiting, self.config.lora.max_loras)

    def _lora_manager(self) -> LoRAManager:
        if self.lora is None:
            raise LoRANotEnabled("this engine serves no LoRA adapters; start it with --enable-lora "
                                 "(enable_lora: true)", param="lora_name")
        return self.lora

    @property
    def stats(self) -> SchedulerStats:
        return self.scheduler.stats

    # -- offline ---------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False, **request_kwargs: Any) -> list[CompletionResult]:
        """Run prompts to completion with continuous batching.

        Returns one result per sample in prompt order (prompt i's n samples consecutively).
        """
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequest(f"got {len(prompts)} prompts but {len(params)} sampling params")
        ids = [self.add_request(None, p, sp, **request_kwargs) for p, sp in zip(prompts, params)]
        acc: dict[tuple[str, int], dict[str, Any]] = {
            (i, k): {"tokens": [], "text": [], "logprobs": []} for i, sp in zip(ids, params) for k in range(sp.n)
        }
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(acc), desc="generate", unit="seq")
        while self.has_unfinished_requests():
            for out in self.step():
                a = acc[(out.request_id, out.index)]
                a["tokens"].extend(out.new_token_ids)
                a["text"].append(out.text)
                a["logprobs"].extend(out.logprobs or ())
                if out.prompt_logprobs is not None:
                    a["prompt_logprobs"] = out.prompt_logprobs
                if out.finished:
                    a["final"] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        results = []
        for (rid, index), a in acc.items():
            final = a["final"]
            results.append(CompletionResult(
                request_id=rid, index=index, prompt_token_ids=final.prompt_token_ids,
                token_ids=tuple(a["tokens"]), text="".join(a["text"]), finish_reason=final.finish_reason,
                stop_reason=final.stop_reason,
                logprobs=tuple(a["logprobs"]) if final.logprobs is not None or a["logprobs"] else None,
                cumulative_logprob=final.cumulative_logprob, prompt_logprobs=a.get("prompt_logprobs"),
            ))
        return results
