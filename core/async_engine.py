"""AsyncLLMEngine: the engine steps on its own thread; callers get async iterators of deltas.

The engine thread is the only one that touches engine state (DESIGN.md); callers talk to it
through one command queue (add, abort) and get results through per-request asyncio queues fed
with loop.call_soon_threadsafe. Closing or cancelling an iterator aborts its request, which the
engine thread applies before its next step, so the request's blocks are freed within one step.

The engine thread also builds the LLMEngine. torch's CPU ops run on an OpenMP team owned by the
thread that starts them; loading the model on one thread and stepping it on another leaves two
teams in the process, and once libgomp manages more threads than there are CPUs it stops
spinning between parallel regions and sleeps/wakes its workers hundreds of times per step
(measured on 2 cores: the same workload 35% slower, 71.3 s against 52.7 s). So keep every torch
op of a process on this one thread: adapters never touch torch themselves.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import traceback
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedserve.core.config import EngineConfig
from pagedserve.core.engine import LLMEngine
from pagedserve.core.errors import EngineDead, PagedServeError
from pagedserve.core.metrics import MetricsSnapshot
from pagedserve.core.outputs import RequestOutput
from pagedserve.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


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
class _Add:
    request_id: str
    prompt: str | Sequence[int]
    params: SamplingParams
    kwargs: dict[str, Any]
    stream: _Stream


@dataclass(frozen=True)
class _Abort:
    request_id: str


_STOP = object()


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None) -> None:
        """Build the LLMEngine from ``config`` on the engine thread and return once it is loaded
        (a failed load raises here). ``engine``: an already built one (tests); built on another
        thread it steps with the slower two-team OpenMP setup described in the module docstring."""
        self.engine: LLMEngine | None = engine
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._error: BaseException | None = None
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(config,), name="pagedserve-engine", daemon=True)
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            self._thread.join()
            raise self._build_error

    # -- caller side -----------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt: str | Sequence[int],
                       params: SamplingParams | None = None, **kwargs: Any) -> AsyncIterator[RequestOutput]:
        """Stream RequestOutput deltas until every sample of the request has finished.

        kwargs: cache_salt, use_prefix_cache (compiled_grammar is filled in here). Invalid requests
        raise InvalidRequest (or a subclass) from the first iteration; an engine failure raises
        EngineDead.
        """
        if self._error is not None:
            raise EngineDead(f"the engine is dead and serves no more requests: {self._error}")
        params = params or SamplingParams()
        if params.structured_output is not None and "compiled_grammar" not in kwargs:
            # Compiled on a worker thread (cached per constraint) and awaited here, before the engine
            # thread sees the request: a slow schema holds back only its own request, and one that
            # does not compile fails here with InvalidRequest.
            kwargs["compiled_grammar"] = await asyncio.wrap_future(
                self.engine.structured_output.compiler.submit(params.structured_output))
        stream = _Stream(asyncio.get_running_loop(), samples_left=params.n)
        self._commands.put(_Add(request_id, prompt, params, kwargs, stream))
        finished = False
        try:
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
            if not finished:  # closed or cancelled midway: free the request's blocks
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request from outside; its stream ends with finish_reason "abort"."""
        self._commands.put(_Abort(request_id))

    def is_healthy(self) -> bool:
        return self._error is None and self._thread.is_alive()

    @property
    def metrics(self) -> MetricsSnapshot:
        return self.engine.latest_metrics

    def shutdown(self, timeout: float = 10.0) -> None:
        self._commands.put(_STOP)
        self._thread.join(timeout)

    # -- engine thread ---------------------------------------------------------------------------
    def _run(self, config: EngineConfig | None) -> None:
        try:
            if self.engine is None:
                self.engine = LLMEngine(config)
        except BaseException as exc:  # noqa: BLE001 - re-raised by __init__ on the caller's thread
            self._build_error = exc
            return
        finally:
            self._built.set()
        try:
            while True:
                block = not self.engine.has_unfinished_requests()
                if not self._drain_commands(block):
                    return
                if self.engine.has_unfinished_requests():
                    self._deliver(self.engine.step())
        except BaseException as exc:  # noqa: BLE001 - anything here must reach every caller
            logger.error("engine step failed; failing all open requests:\n%s", traceback.format_exc())
            self._fail_all(exc)

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one if the engine is idle). False means stop."""
        while True:
            try:
                cmd = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if cmd is _STOP:
                self._fail_all(EngineDead("the engine was shut down"), record=False)
                return False
            if isinstance(cmd, _Add):
                self._add(cmd)
            elif isinstance(cmd, _Abort):
                stream = self._streams.pop(cmd.request_id, None)
                outputs = self.engine.abort_request(cmd.request_id)
                if stream is not None:
                    for out in outputs:
                        stream.put(out)

    def _add(self, cmd: _Add) -> None:
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, **cmd.kwargs)
        except PagedServeError as exc:  # a bad request is rejected on its own
            cmd.stream.put(exc)
            return
        self._streams[cmd.request_id] = cmd.stream

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put(out)
        # Forget a stream only after the whole step is delivered: several samples of one request
        # (n > 1) can finish in the same step, and the request is no longer live after the first.
        for out in outputs:
            if out.finished and not self.engine.is_live(out.request_id):
                self._streams.pop(out.request_id, None)

    def _fail_all(self, exc: BaseException, record: bool = True) -> None:
        if record:
            self._error = exc
        error = exc if isinstance(exc, EngineDead) else EngineDead(f"engine step failed: {exc!r}")
        for stream in self._streams.values():
            stream.put(error)
        self._streams.clear()
        # Fail requests still queued, and any that arrive later, instead of leaving them waiting.
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                cmd.stream.put(error)
        if record:
            threading.Thread(target=self._reject_forever, args=(error,), daemon=True).start()

    def _reject_forever(self, error: EngineDead) -> None:
        while True:
            cmd = self._commands.get()
            if cmd is _STOP:
                return
            if isinstance(cmd, _Add):
                cmd.stream.put(error)
