"""AsyncLLMEngine: the engine steps on its own thread; callers get async iterators of deltas.

The engine thread is the only one that touches engine state (docs/design.md); callers talk to it
through one command queue (add, abort) and get results through per-request asyncio queues fed
with loop.call_soon_threadsafe. Closing or cancelling an iterator aborts its request, which the
engine thread applies before its next step, so the request's blocks are freed within one step.

The LLMEngine inside is private. What adapters need besides generate/abort (tokenize, decode, the
chat template, the model's facts, metrics, health, drain) is offered here, safe to call from any
thread: none of it touches the state the engine thread owns (the tokenizer and the model's facts
are read-only once loaded; metrics are a published snapshot).

Nothing a single request sends may hold up the steps of the others: text prompts are tokenized
on a small pool of worker threads (the tokenizer releases the GIL), after a character bound that
refuses, without tokenizing, a prompt that cannot fit max_model_len; only token ids reach the
engine thread.

The engine thread also builds the LLMEngine. torch's CPU ops run on an OpenMP team owned by the
thread that starts them; loading the model on one thread and stepping it on another leaves two
teams in the process, and once libgomp manages more threads than there are CPUs it stops
spinning between parallel regions and sleeps/wakes its workers hundreds of times per step
(measured on 2 cores: the same workload 35% slower, 71.3 s against 52.7 s). So keep every torch
op of a process on this one thread: adapters never touch torch themselves.

Lifecycle: open -> draining (begin_drain: new requests are refused with EngineShuttingDown,
requests in flight go on) -> closed (shutdown: the rest end with EngineShuttingDown; or a fatal
failure: they end with EngineDead). Every call after that fails at once. A step that raises ends
the requests in flight with EngineStepFailed and the engine goes on (see _recover); after
MAX_CONSECUTIVE_STEP_FAILURES failed steps in a row it gives up and is dead.
"""

from __future__ import annotations

import asyncio
import json
import logging
import queue
import threading
import time
import traceback
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pagedserve.core.config import EngineConfig
from pagedserve.core.engine import LLMEngine
from pagedserve.core.errors import EngineDead, EngineShuttingDown, EngineStepFailed, PagedServeError
from pagedserve.core.heap import limit_malloc_arenas, release_free_heap
from pagedserve.core.lora.manager import LoRAStats
from pagedserve.core.metrics import MetricsSnapshot
from pagedserve.core.outputs import RequestOutput
from pagedserve.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

MAX_CONSECUTIVE_STEP_FAILURES = 3
"""Failed steps in a row (no good step between) after which the engine stops recovering: a fault
that repeats is not one bad batch but a broken engine, and a restart is the cure."""
TOKENIZER_THREADS = 2


@dataclass(eq=False)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    samples_left: int = 1

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            pass


@dataclass(frozen=True)
class ModelInfo:
    """Facts about the served model that adapters may read (fixed once the engine is loaded)."""

    model_path: str
    max_model_len: int
    """Longest prompt + output, in tokens."""
    vocab_size: int
    max_prompt_chars: int
    """Text prompts longer than this are refused before tokenizing (they cannot fit max_model_len)."""
    has_chat_template: bool
    block_size: int = 0
    """Tokens per KV block."""
    num_kv_blocks: int = 0
    """Blocks in the KV pool (vLLM's num_gpu_blocks, whatever the device)."""
    kv_cache_dtype: str = "auto"
    """The KV cache's dtype setting (auto: the model's)."""
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class _Add:
    """A request for the engine thread: LLMEngine.add_request's arguments and the stream to answer."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: _Stream
    cache_salt: str | None = None
    use_prefix_cache: bool = True
    deadline: float | None = None
    compiled_grammar: Any = None
    lora_name: str | None = None


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _AddLoRA:
    """Load a LoRA adapter on the engine thread (its torch ops belong there); answered through `done`."""
    name: str
    path: str
    done: Future


_STOP = object()


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None) -> None:
        """Build the LLMEngine from ``config`` on the engine thread and return once it is loaded
        (a failed load raises here). ``engine``: an already built one (tests); built on another
        thread it steps with the slower two-team OpenMP setup described in the module docstring."""
        self._engine: LLMEngine | None = engine
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._lock = threading.Lock()
        """Guards _closed and the submission of commands, so nothing is queued after the engine
        thread stopped reading (it would wait forever)."""
        self._closed: EngineDead | None = None
        self._draining = False
        self._num_active = 0
        """generate() calls in progress (tokenizing, queued or streaming); under _lock."""
        self._consecutive_failures = 0  # engine thread only
        limit_malloc_arenas()  # before this engine's threads start (core/heap.py)
        self._tokenizer_pool = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="pagedserve-tokenize")
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(config,), name="pagedserve-engine", daemon=True)
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            self._thread.join()
            self._tokenizer_pool.shutdown(wait=False)
            raise self._build_error
        inner = self._engine
        self._tokenizer = inner.tokenizer
        cache = inner.config.cache
        self.model_info = ModelInfo(str(inner.model_path), inner.max_model_len, inner.arch.vocab_size,
                                    inner.inputs.max_prompt_chars, bool(inner.tokenizer.chat_template),
                                    cache.block_size, inner.num_kv_blocks, cache.kv_cache_dtype,
                                    cache.enable_prefix_caching)

    # -- caller side -----------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None,
                       *, timeout: float | None = None, cache_salt: str | None = None,
                       use_prefix_cache: bool = True, lora_name: str | None = None) -> AsyncIterator[RequestOutput]:
        """Stream RequestOutput deltas until every sample of the request has finished.

        timeout: seconds from now after which the request ends with finish_reason "timeout"
        (None: the engine's request_timeout, if any). cache_salt: a tenant's salt; only requests
        with the same salt share cached prompt blocks. use_prefix_cache: False computes every
        prompt position. lora_name: a loaded LoRA adapter to run with (None: the base model; an
        unknown one raises UnknownLoRAAdapter, LoRA off LoRANotEnabled, from the first iteration).
        Sampling and structured output travel in `params`.
        Invalid requests raise InvalidRequest (or a subclass) from the first iteration, a full
        waiting queue EngineOverloaded, a closed or draining engine EngineDead /
        EngineShuttingDown (at once), a failed step EngineStepFailed.
        """
        self._check_accepting()
        deadline = None if timeout is None else time.monotonic() + timeout
        params = params or SamplingParams()
        with self._lock:
            self._num_active += 1
        submitted = finished = False
        try:
            token_ids = await self.tokenize(prompt)
            if params.bad_words or params.logit_bias:  # bad_words are tokenized: off the engine thread
                params = await self._on_tokenizer_pool(self._engine.inputs.prepare_params, params)
            compiled_grammar = None
            if params.structured_output is not None:
                # Compiled on a worker thread (cached per constraint) and awaited here, before the
                # engine thread sees the request: a slow schema holds back only its own request, and
                # one that does not compile fails here with InvalidRequest.
                compiled_grammar = await asyncio.wrap_future(
                    self._engine.structured_output.compiler.submit(params.structured_output))
            stream = _Stream(asyncio.get_running_loop(), samples_left=params.n)
            self._submit(_Add(request_id, token_ids, params, stream, cache_salt=cache_salt,
                              use_prefix_cache=use_prefix_cache, deadline=deadline, compiled_grammar=compiled_grammar,
                              lora_name=lora_name))
            submitted = True
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.finished:
                    stream.samples_left -= 1
                    finished = stream.samples_left == 0
                yield item
                if finished:
                    return
        finally:
            with self._lock:
                self._num_active -= 1
            if submitted and not finished:  # closed or cancelled midway: free the request's blocks
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request from outside; its stream ends with finish_reason "abort"."""
        with self._lock:
            if self._closed is None:  # once closed, every stream has ended already
                self._commands.put(_Abort(request_id))

    # -- LoRA adapters (docs/lora.md): any thread, errors raised here -----------------------------
    def add_lora(self, name: str, path: str, timeout: float | None = 300.0) -> None:
        """Load the PEFT adapter at `path` as `name` (the same name and path again: a no-op). The
        loading runs on the engine thread, between two steps; this call waits for it. Raises
        LoRANotEnabled, InvalidLoRAAdapter, or EngineDead / EngineShuttingDown."""
        if self._engine.lora is None:
            self._engine.add_lora(name, path)  # raises LoRANotEnabled
        self._check_accepting()
        done: Future = Future()
        self._submit(_AddLoRA(name, path, done))
        done.result(timeout)

    def remove_lora(self, name: str) -> bool:
        """Stop taking requests for `name` (False if it was not loaded); requests already on it
        run to their end."""
        return self._engine.remove_lora(name)

    def list_loras(self) -> dict[str, str]:
        """name -> path of the loaded adapters ({} when LoRA is off)."""
        return self._engine.list_loras()

    def lora_stats(self) -> LoRAStats:
        """The adapters of the running and waiting requests and max_loras, as of the latest step."""
        return getattr(self._engine, "latest_lora_stats", None) or LoRAStats((), (), 0)

    def is_healthy(self) -> bool:
        """False once the engine is dead or shut down (draining engines are still healthy)."""
        return self._closed is None and self._thread.is_alive()

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def num_unfinished_requests(self) -> int:
        """Requests accepted and not yet ended (tokenizing, waiting or running)."""
        return self._num_active

    @property
    def metrics(self) -> MetricsSnapshot:
        return self._engine.latest_metrics

    def begin_drain(self) -> None:
        """Refuse new requests (EngineShuttingDown) and let the ones in flight finish."""
        self._draining = True

    async def drain(self, timeout: float) -> int:
        """begin_drain(), wait up to `timeout` seconds for the requests in flight, then shut down:
        whatever is still running ends with EngineShuttingDown. Returns how many were cut off."""
        self.begin_drain()
        deadline = time.monotonic() + timeout
        while self._num_active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = self._num_active
        reason = (f"the server is shutting down and {left} request(s) did not finish within the "
                  f"drain period ({timeout:g} s); retry on another replica") if left else None
        await asyncio.to_thread(self.shutdown, reason=reason)
        return left

    def shutdown(self, timeout: float = 10.0, reason: str | None = None) -> None:
        """Stop the engine: open requests and every later call fail with EngineShuttingDown."""
        with self._lock:
            if self._closed is None:
                self._closed = EngineShuttingDown(reason or "the engine was shut down; it serves no more requests")
            self._commands.put(_STOP)
        self._thread.join(timeout)
        self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)

    # -- tokenizer and model facts (any thread; never the engine thread's state) -------------------
    async def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt as generate() would run it: text is encoded (with the model's
        special tokens) on the tokenizer pool, ids are range-checked. Raises RequestTooLong for a
        prompt that cannot fit max_model_len (a text one before tokenizing), InvalidRequest for
        bad ids."""
        self._engine.inputs.check_prompt_size(prompt)  # a length: a huge prompt is refused before tokenizing
        return await self._on_tokenizer_pool(self._engine.inputs.tokenize, prompt)

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of token ids (special tokens included), e.g. one logprob entry's token."""
        return self._tokenizer.decode(list(token_ids))

    async def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                                  tools: Sequence[dict[str, Any]] | None = None) -> str:
        """Chat messages ([{"role", "content"}, ...], tool calls and tool messages included) and the
        function definitions (`tools`) rendered with the model's template, on the tokenizer pool.
        Refuses, before rendering, contents longer than any prompt can be (RequestTooLong);
        InvalidRequest for malformed messages or a model without a template."""
        self._engine.inputs.check_prompt_chars(_chat_chars(messages, tools))
        return await self._on_tokenizer_pool(self._engine.inputs.apply_chat_template, messages,
                                             add_generation_prompt, tools)

    async def _on_tokenizer_pool(self, fn, *args):
        try:
            return await asyncio.get_running_loop().run_in_executor(self._tokenizer_pool, fn, *args)
        except RuntimeError:
            if self._closed is not None:  # the pool was shut down with the engine meanwhile
                raise self._closed_error() from None
            raise

    def _closed_error(self) -> EngineDead:
        """A fresh copy of the closing error: one instance raised in many tasks would collect
        every task's traceback."""
        return type(self._closed)(str(self._closed))

    def _check_accepting(self) -> None:
        if self._closed is not None:
            raise self._closed_error()
        if self._draining:
            raise EngineShuttingDown("the server is shutting down and accepts no new requests; "
                                     "retry on another replica")

    def _submit(self, cmd: _Add | _AddLoRA) -> None:
        with self._lock:
            if self._closed is not None:
                raise self._closed_error()
            self._commands.put(cmd)

    # -- engine thread ---------------------------------------------------------------------------
    def _run(self, config: EngineConfig | None) -> None:
        try:
            if self._engine is None:
                self._engine = LLMEngine(config)
        except BaseException as exc:  # noqa: BLE001 - re-raised by __init__ on the caller's thread
            self._build_error = exc
            return
        finally:
            self._built.set()
        try:
            busy = True  # loading freed its full-precision copies of the weights
            while True:
                block = not self._engine.has_unfinished_requests()
                if block and busy:
                    release_free_heap()  # going idle: resident memory falls back to what is in use
                    busy = False
                if not self._drain_commands(block):
                    return
                if self._engine.has_unfinished_requests():
                    busy = True
                    self._step()
        except BaseException as exc:  # noqa: BLE001 - anything here must reach every caller
            logger.error("the engine failed and serves no more requests:\n%s", traceback.format_exc())
            self._die(EngineDead(f"the engine failed and serves no more requests ({exc!r}); restart the server"))

    def _step(self) -> None:
        try:
            outputs = self._engine.step()
        except Exception as exc:  # noqa: BLE001 - a failed step ends its requests, not the engine
            self._recover(exc)
            return
        self._consecutive_failures = 0
        self._deliver(outputs)

    def _recover(self, exc: Exception) -> None:
        """End every request in flight with EngineStepFailed, free all blocks and forget the prefix
        cache, and go on serving; give up (raise) after MAX_CONSECUTIVE_STEP_FAILURES in a row or
        when the engine's state does not check out after the clean-up."""
        self._consecutive_failures += 1
        logger.error("engine step failed (%d in a row); ending the %d request(s) in flight:\n%s",
                     self._consecutive_failures, len(self._streams), traceback.format_exc())
        message = (f"an internal error in the engine ended this request ({type(exc).__name__}: {exc}); "
                   "the server goes on serving, retry the request")
        for stream in self._streams.values():
            stream.put(EngineStepFailed(message))
        self._streams.clear()
        self._engine.abort_all_after_failure()
        if self._consecutive_failures >= MAX_CONSECUTIVE_STEP_FAILURES:
            raise RuntimeError(f"{self._consecutive_failures} engine steps in a row failed; last: {exc!r}") from exc

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one if the engine is idle). False means stop."""
        while True:
            try:
                cmd = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if cmd is _STOP:
                self._fail_all()
                return False
            if isinstance(cmd, _Add):
                self._add(cmd)
            elif isinstance(cmd, _AddLoRA):
                self._add_lora(cmd)
            elif isinstance(cmd, _Abort):
                stream = self._streams.pop(cmd.request_id, None)
                outputs = self._engine.abort_request(cmd.request_id)
                if stream is not None:
                    for out in outputs:
                        stream.put(out)

    def _add(self, cmd: _Add) -> None:
        try:
            self._engine.add_request(cmd.request_id, cmd.prompt_token_ids, cmd.params, cache_salt=cmd.cache_salt,
                                     use_prefix_cache=cmd.use_prefix_cache, deadline=cmd.deadline,
                                     compiled_grammar=cmd.compiled_grammar, lora_name=cmd.lora_name)
        except PagedServeError as exc:  # a bad or refused request ends on its own
            cmd.stream.put(exc)
            return
        self._streams[cmd.request_id] = cmd.stream

    def _add_lora(self, cmd: _AddLoRA) -> None:
        try:
            self._engine.add_lora(cmd.name, cmd.path)
        except Exception as exc:  # noqa: BLE001 - the caller gets it; the engine goes on
            cmd.done.set_exception(exc)
        else:
            cmd.done.set_result(None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)
        # Forget a stream only after the whole step is delivered: several samples of one request
        # (n > 1) can finish in the same step, and the request is no longer live after the first.
        for out in outputs:
            if out.finished and not self._engine.is_live(out.request_id):
                self._streams.pop(out.request_id, None)

    def _die(self, error: EngineDead) -> None:
        with self._lock:
            if self._closed is None:
                self._closed = error
        self._fail_all()

    def _fail_all(self) -> None:
        """End every open stream and every queued request with the closing error. Called once
        _closed is set, so nothing can be queued after this."""
        for stream in self._streams.values():
            stream.put(self._closed_error())
        self._streams.clear()
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                cmd.stream.put(self._closed_error())
            elif isinstance(cmd, _AddLoRA):
                cmd.done.set_exception(self._closed_error())


def _chat_chars(messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None) -> int:
    """Characters a chat brings into its prompt (contents, earlier calls, function definitions),
    counted without rendering: a bound for refusing one that cannot fit."""
    chars = len(json.dumps(list(tools), default=str)) if tools else 0
    for m in messages:
        if isinstance(m, dict):
            chars += len(m["content"]) if isinstance(m.get("content"), str) else 0
            chars += len(json.dumps(m["tool_calls"], default=str)) if m.get("tool_calls") else 0
    return chars
