"""TritonPythonModel: a decoupled Triton Python-backend model in front of AsyncLLMEngine.

model_repository/<name>/1/model.py imports this class. Per model instance (one stub process):

* initialize() loads the engine from `engine.json` beside model.py (strict EngineConfig: a bad
  file fails the load naming the key), starts an asyncio loop on a background thread, and starts
  the metrics refresher. Each request speaks the text contract (vllm_backend's: text_input,
  codec.py) or the token contract (TensorRT-LLM's: input_ids, token_codec.py); contracts.py tells
  which, and that contract's object parses the request and builds its responses. The config
  parameter `contract` may restrict the model to one of them.
* execute() validates each request, hands it to the loop and returns None at once. Responses go
  out from the loop thread through the request's response sender.
* Every request ends with exactly one response flagged FINAL: the last data response on success,
  else a TritonError (the caller's mistake, an engine failure, or CANCELLED).
* Drain: Triton calls finalize() only once the streams in flight have ended, so the watcher
  notices a server shutdown (SIGTERM, SIGINT) itself: within 0.1 s of `pagedserve triton`'s
  shutdown notice, or once tritonserver closes its HTTP port (server_watch.py: read from /proc,
  Triton is not asked), it refuses new requests, lets those in flight run for drain_timeout and
  then ends the rest with UNAVAILABLE. finalize() drains the same way (an unload through Triton's API: it comes once
  the streams have ended). Once a drain the notice began is complete (engine shut down, every
  request answered), the model tells the launcher (drain_report.py), which then ends tritonserver
  at once rather than wait out Triton's own 2-3 s of shutdown steps.
* A dead engine (repeated step failures) unloads the model (pb_utils.unload_model, as
  vllm_backend does), so readiness reports it: only in explicit model-control mode, read from
  tritonserver's command line (elsewhere the call fails, and a failing call can crash the stub;
  the model then answers UNAVAILABLE and says why in the log).
* Unload: finalize() drains, releases the metric families while the stub can still tell Triton,
  and lets the stub skip the interpreter's own teardown (see _exit_without_teardown).

The model translates only: the engine batches and schedules.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils

from pagedserve.adapters.process_exit import exit_without_teardown
from pagedserve.adapters.engine_metrics import cache_config_labels
from pagedserve.adapters.triton_server.codec import timeout_seconds
from pagedserve.adapters.triton_server.contracts import (ALL_INPUTS, Contract, ContractRequest, contract_from_config,
                                                         select_contract)
from pagedserve.adapters.triton_server.drain_report import STUB_EXECUTABLE, report_drained
from pagedserve.adapters.triton_server.errors import cancelled_error, to_triton_error
from pagedserve.adapters.triton_server.engine_config import (ENGINE_JSON, MODEL_OVERRIDE_ENV, SHUTDOWN_NOTICE_ENV,
                                                             load_engine_config)
from pagedserve.adapters.triton_server.metrics import TritonEngineMetrics
from pagedserve.adapters.triton_server.server_watch import ServerShutdownWatch, explicit_model_control
from pagedserve.core.async_engine import AsyncLLMEngine
from pagedserve.core.errors import ConfigError, InvalidRequest, PagedServeError

logger = logging.getLogger(__name__)

CANCEL_POLL_S = 0.1
"""Each request's is_cancelled() is polled at most this often: on a delta once it is due, and by a
watcher for requests that get no delta (queued, long prefill). A poll is a round trip to the Triton
process; polling on every delta took about 0.8 s of a 4 s run of bench/triton_stream.py on the tiny
test model (one poll per token), while 0.1 s is far below what a client notices."""
FINAL = 1  # pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL (the stub defines it as 1)
SHUTDOWN_POLL_S = 0.5
"""How often the model checks whether tritonserver has closed a port (server_watch.py: tens of µs
once its ports are known, a few ms per look before)."""


def input_bytes(tensors: dict[str, np.ndarray | None]) -> int:
    """Bytes a request's inputs carry (BYTES elements by their length)."""
    total = 0
    for array in tensors.values():
        if array is None:
            continue
        if array.dtype == object:
            total += sum(len(x) for x in array.reshape(-1) if isinstance(x, (bytes, str)))
        else:
            total += array.nbytes
    return total


def _in_triton_stub() -> bool:
    try:
        return os.path.basename(os.readlink("/proc/self/exe")) == STUB_EXECUTABLE
    except OSError:
        return False


def _exit_without_teardown() -> None:
    """Registered by finalize() in the stub, so it runs once the stub has answered Triton, closed
    its channel and joined its threads: what is left of the exit is the interpreter's own teardown
    (torch, transformers, the engine's objects), which returns nothing to the system that the exit
    does not, and costs 0.3-0.7 s here and 4 s under load, time Triton's unload and shutdown wait
    for. Exit handlers registered before this one are skipped; logging's is the one that matters."""
    exit_without_teardown(0)


@dataclass(eq=False)
class _Live:
    sender: object
    last_poll: float

    def cancelled(self) -> bool:
        """Poll the client's cancellation if it is due (at most every CANCEL_POLL_S)."""
        now = time.monotonic()
        if now - self.last_poll < CANCEL_POLL_S:
            return False
        self.last_poll = now
        return self.sender.is_cancelled()


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        model_config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(model_config):
            raise ConfigError("pagedserve streams responses: set model_transaction_policy { decoupled: true } "
                              "in config.pbtxt")
        self.allowed_contract = contract_from_config(model_config)
        path = Path(args["model_repository"]) / args["model_version"] / ENGINE_JSON
        config = load_engine_config(path, os.environ.get(MODEL_OVERRIDE_ENV))
        self.limits = config.limits
        self.model_name = args["model_name"]
        self.engine = AsyncLLMEngine(config)
        self._ids = itertools.count()
        self._received_request = False
        self._server = (ServerShutdownWatch(os.getppid(), os.environ.get(SHUTDOWN_NOTICE_ENV))
                        if _in_triton_stub() else None)
        """Whether tritonserver (the stub's parent) is shutting down; None outside a stub."""
        self._live: dict[str, _Live] = {}
        """request_id -> its response sender and last cancellation poll; loop thread only."""
        self._unanswered = 0
        """Requests execute() handed to the loop whose _serve has not ended yet; under _count_lock."""
        self._count_lock = threading.Lock()
        self._last_response_at = 0.0
        """time.monotonic() of the last response sent (any thread): the launcher's flush grace
        counts from it (drain_report.py)."""
        self._drain_reported = False
        self._drain_logged = False
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self.loop.run_forever, name="pagedserve-loop", daemon=True)
        self._loop_thread.start()
        self._closing = threading.Event()
        self._drain = None
        """The drain in progress (a concurrent Future), once Triton stopped routing to the model."""
        labels = {"model": args["model_name"], "version": args["model_version"]}
        engine = self.engine  # not `self`: a cycle would keep the model to the interpreter's teardown
        self.metrics = TritonEngineMetrics(pb_utils, lambda: engine.metrics, labels,
                                           cache_config=cache_config_labels(engine.model_info),
                                           read_lora_stats=engine.lora_stats if config.lora.enable_lora else None)
        # Last: its cancellation polls are calls to Triton too, and must not overlap creating the families.
        self._watcher = asyncio.run_coroutine_threadsafe(self._watch(), self.loop)
        logger.info("pagedserve: model %s (%s contract) ready", args["model_name"], self.allowed_contract)

    # -- request intake (Triton's thread) ---------------------------------------------------------
    def execute(self, requests: list) -> None:
        if not self._received_request and self._server is not None:
            # The server serves, so its ports are open: note them now, in case a SIGTERM closes the
            # HTTP port before the watcher's first look (within SHUTDOWN_POLL_S of their opening).
            self._server.shutting_down()
        self._received_request = True
        for request in requests:
            sender = request.get_response_sender()
            try:
                contract, parsed = self._parse(request)
                timeout = timeout_seconds(request.timeout() if hasattr(request, "timeout") else 0,
                                          request.parameters())
            except Exception as exc:  # noqa: BLE001 - every failure becomes the request's final error
                self._send_error(sender, exc)
                continue
            request_id = f"{request.request_id() or 'triton'}-{next(self._ids)}"
            with self._count_lock:
                self._unanswered += 1  # before the loop can see it: the drain report must count it
            asyncio.run_coroutine_threadsafe(self._serve(request_id, contract, parsed, sender, timeout), self.loop)
        return None

    def _parse(self, request) -> tuple[Contract, ContractRequest]:
        tensors = {}
        for name in ALL_INPUTS:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            tensors[name] = tensor.as_numpy() if tensor is not None else None
        size = input_bytes(tensors)
        if size > self.limits.max_request_bytes:  # checked before the prompt is even decoded
            raise InvalidRequest(f"the request's inputs are {size} bytes, over max_request_bytes="
                                 f"{self.limits.max_request_bytes} (engine.json); send a shorter prompt")
        contract = select_contract(tensors, self.allowed_contract)
        return contract, contract.parse(tensors, request.parameters())

    # -- serving (loop thread) ----------------------------------------------------------------------
    async def _serve(self, request_id: str, contract: Contract, parsed: ContractRequest, sender,
                     timeout: float | None) -> None:
        final_sent = False
        try:
            builder = contract.response_builder(parsed, self._decode_token)
            if not parsed.generates:
                final_sent = self._send(sender, builder.final(), FINAL)
                return
            live = self._live[request_id] = _Live(sender, time.monotonic())
            finished, n = 0, parsed.params.n
            stream = self.engine.generate(request_id, parsed.prompt, parsed.params, timeout=timeout,
                                          cache_salt=parsed.cache_salt, lora_name=parsed.lora_name)
            async with contextlib.aclosing(stream):
                async for out in stream:
                    if out.finish_reason == "abort" or live.cancelled():
                        break  # leaving the `async with` aborts the engine request if it still runs
                    finished += out.finished
                    outputs = builder.add(out)
                    if outputs is not None:
                        final_sent = self._send(sender, outputs, FINAL if finished == n else 0)
                    elif finished == n:
                        final_sent = self._send(sender, builder.final(), FINAL)
            if not final_sent:  # the loop ended early: the client cancelled
                final_sent = self._send_error(sender, None)
        except Exception as exc:  # noqa: BLE001 - an exception here would leave the client waiting
            if not isinstance(exc, PagedServeError):  # a caller's mistake needs no traceback in the log
                logger.exception("pagedserve: request %s failed", request_id)
            if not final_sent:
                self._send_error(sender, exc)
        finally:
            self._live.pop(request_id, None)
            with self._count_lock:
                self._unanswered -= 1
            self.metrics.poke()

    async def _watch(self) -> None:
        """Abort requests whose client went away while they produced no delta (queued,
        prefilling); start the drain once tritonserver begins to shut down; unload the model once
        the engine is dead."""
        last_shutdown_poll, dead_reported, blind_reported = 0.0, False, False
        while not self._closing.is_set():
            await asyncio.sleep(CANCEL_POLL_S)
            for request_id, live in list(self._live.items()):
                try:
                    if live.cancelled():
                        self.engine.abort(request_id)  # its stream ends with an "abort" output
                except Exception:  # noqa: BLE001 - keep watching the others
                    logger.exception("pagedserve: cancellation check of %s failed", request_id)
            if self._drain is None and self._server is not None and self._server.noticed():
                self._begin_drain("pagedserve triton passed on a signal to stop the server")
            if (self._drain is None and self._server is not None
                    and time.monotonic() - last_shutdown_poll >= SHUTDOWN_POLL_S):
                last_shutdown_poll = time.monotonic()
                shutting_down = self._server.shutting_down()
                if shutting_down:
                    self._begin_drain("tritonserver is shutting down (it closed its HTTP port)")
                elif shutting_down is None and not blind_reported:
                    blind_reported = True
                    logger.warning("pagedserve: cannot read tritonserver's ports from /proc/%d: a shutdown will "
                                   "not drain the requests in flight (they run until they end or Triton's exit "
                                   "timeout)", self._server.pid)
            if not dead_reported and self._drain is None and not self.engine.is_healthy():
                dead_reported = True
                await asyncio.to_thread(self._unload_dead_model)
            self._report_drain_if_complete()

    def _report_drain_if_complete(self) -> None:
        """Once a drain the launcher's notice began is over (the engine is shut down) and every
        request handed to the loop has had its final response, tell the launcher, once
        (drain_report.py). Loop thread: _serve's clean-up runs here too, so `_unanswered` falls to
        0 only after the last final response went out."""
        if (self._drain_reported or self._drain is None or not self._drain.done() or self._server is None
                or not self._server.noticed()):
            return
        with self._count_lock:
            if self._unanswered:
                return
            last = self._last_response_at
        self._drain_reported = True
        self._log_drain_outcome()  # the launcher may end the stub before finalize() could
        try:
            report_drained(self._server.notice, last)
        except OSError as exc:  # the launcher then waits for tritonserver's own exit, as without the report
            logger.warning("pagedserve: could not report the drain complete to pagedserve triton: %s", exc)

    def _unload_dead_model(self) -> None:
        if self._server is not None and not explicit_model_control(self._server.pid):
            # unload_model would fail outside explicit mode, and a failing call can crash the stub.
            logger.error("pagedserve: the engine failed and cannot serve; model %s answers UNAVAILABLE until the "
                         "server is restarted (tritonserver is not in explicit model-control mode, so the model "
                         "cannot unload itself to make its readiness report it)", self.model_name)
            return
        logger.error("pagedserve: the engine failed and cannot serve; unloading model %s so that its readiness "
                     "reports it", self.model_name)
        try:
            pb_utils.unload_model(self.model_name)  # returns at once; Triton unloads in the background
        except Exception as exc:  # noqa: BLE001 - only explicit model-control mode allows it
            logger.error("pagedserve: could not unload model %s (%s); it answers UNAVAILABLE until the server "
                         "is restarted or the model reloaded", self.model_name, exc)

    def _begin_drain(self, why: str) -> None:
        """Refuse new requests, give those in flight drain_timeout, then end the rest (UNAVAILABLE)."""
        if self._drain is not None:
            return
        logger.info("pagedserve: draining model %s: %s; %d request(s) in flight get up to %g s",
                    self.model_name, why, len(self._live), self.limits.drain_timeout)
        self._drain = asyncio.run_coroutine_threadsafe(self.engine.drain(self.limits.drain_timeout), self.loop)

    def _log_drain_outcome(self) -> None:
        """Say, once, how the drain ended (or that it has not)."""
        if self._drain_logged:
            return
        self._drain_logged = True
        error = self._drain.exception(timeout=0) if self._drain.done() else TimeoutError("the drain still runs")
        if error is not None:
            logger.warning("pagedserve: the drain did not finish cleanly", exc_info=error)
        elif self._drain.result():
            logger.warning("pagedserve: drain period over: %d request(s) ended with UNAVAILABLE", self._drain.result())

    def _decode_token(self, token_id: int) -> str:
        return self.engine.decode([token_id])

    def _send(self, sender, outputs: dict, flags: int) -> bool:
        tensors = [pb_utils.Tensor(name, array) for name, array in outputs.items()]
        try:
            sender.send(pb_utils.InferenceResponse(output_tensors=tensors), flags=flags)
        finally:
            self._last_response_at = time.monotonic()
        return flags == FINAL

    def _send_error(self, sender, exc: BaseException | None) -> bool:
        """The request's one FINAL response as an error (exc None: cancelled). True once sent."""
        error = cancelled_error(pb_utils) if exc is None else to_triton_error(pb_utils, exc)
        try:
            sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
        except Exception:  # noqa: BLE001 - the client is gone; nothing more can reach it
            logger.warning("pagedserve: could not deliver the final error response: %s", error.message())
        self._last_response_at = time.monotonic()
        return True

    def finalize(self) -> None:
        # Drain (if the watcher has not started it): the requests still open get drain_timeout,
        # then EngineShuttingDown -> an UNAVAILABLE final response each; then the loop stops.
        self._begin_drain("the model is being unloaded")
        try:
            self._drain.result(timeout=self.limits.drain_timeout + 15)
        except Exception:  # noqa: BLE001 - unloading either way
            self.engine.shutdown()
        self._log_drain_outcome()
        deadline = time.monotonic() + 5.0
        while self._live and time.monotonic() < deadline:
            time.sleep(0.05)
        # Let the watcher return before the loop stops (a task left pending is destroyed with the
        # loop, and asyncio logs "Task was destroyed but it is pending!"), and before the metrics
        # are released: its cancellation polls are calls to Triton too.
        self._closing.set()
        try:
            self._watcher.result(timeout=CANCEL_POLL_S + 5)
        except Exception:  # noqa: BLE001 - shutting down either way
            logger.warning("pagedserve: the cancellation watcher did not stop cleanly", exc_info=True)
        self.metrics.stop()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._loop_thread.join(timeout=5)
        if _in_triton_stub():
            atexit.register(_exit_without_teardown)
