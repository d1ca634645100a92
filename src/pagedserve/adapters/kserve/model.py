"""The kserve predictor: owns the AsyncLLMEngine and answers v1 :predict and v2 infer (REST, gRPC).

Readiness (docs/contracts.md, KServe): kserve registers a model only if `ready` is true when the
server starts, so `ready` is set at once and the real readiness is `healthy()`, true only after
start_engine() has loaded the engine and run one tiny generate. /v2/models/<m>/ready reports
healthy(), and kserve refuses infer with 503 until then. Imported only by the server process (kserve inside).

Drain: on SIGTERM the server calls begin_drain(): healthy() turns false at once, new requests get
503, requests in flight may finish within drain_timeout, the rest then end with an error.
A dead engine (repeated step failures) turns healthy() false and calls `on_engine_dead`, which
stops the server, so the platform restarts it (the way vLLM's server exits on a dead engine).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from typing import Any

import numpy as np
from kserve import InferOutput, InferRequest, InferResponse, Model
from grpc_interceptor.exceptions import Internal, NotFound, ResourceExhausted, Unavailable
from kserve.errors import InvalidInput

from pagedserve.adapters.kserve.errors import OpenAIError, error_headers, not_ready, to_openai_error
from pagedserve.adapters.kserve.guards import request_timeout
from pagedserve.adapters.kserve.openai_routes import generate_all
from pagedserve.adapters.kserve.protocol import infer_params, text_inputs
from pagedserve.core.async_engine import AsyncLLMEngine
from pagedserve.core.config import EngineConfig
from pagedserve.core.errors import PagedServeError
from pagedserve.core.lora import LoRAStats
from pagedserve.core.metrics import MetricsSnapshot
from pagedserve.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

INPUT_NAME = "text_input"
OUTPUT_NAME = "text_output"
HEALTH_POLL_S = 0.5


class HTTPStatusError(Exception):
    """An error with its HTTP status and headers for the v1/v2 REST routes (kserve's own
    InferenceError always answers 500); server.py registers its handler on the app."""

    def __init__(self, err: OpenAIError) -> None:
        super().__init__(err.message)
        self.status, self.message, self.headers = err.status, err.message, error_headers(err)


class PagedServeModel(Model):
    def __init__(self, name: str, config: EngineConfig, version: str = "1",
                 on_engine_dead: Callable[[], None] | None = None) -> None:
        super().__init__(name)
        self.config = config
        self.version = version
        self.on_engine_dead = on_engine_dead
        self.engine_failed = False
        self.llm: AsyncLLMEngine | None = None
        self._warm = False
        self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()
        self.ready = True  # see the module docstring: healthy() is what probes see
        self.engine = True  # kserve's flag: ModelServer then runs start_engine() beside its servers

    async def start_engine(self) -> None:
        logger.info("pagedserve: loading %s", self.config.model.model)
        self._loop = asyncio.get_running_loop()
        self.llm = await asyncio.to_thread(AsyncLLMEngine, self.config)
        # One tiny greedy request: the first step pays one-off costs (allocations, lazy imports).
        async for _ in self.llm.generate(f"warmup-{uuid.uuid4().hex}", "Hello",
                                         SamplingParams(max_tokens=1, temperature=0.0)):
            pass
        self._warm = True
        self._spawn(self._watch_engine())
        logger.info("pagedserve: model %s is ready", self.name)

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)  # keep a reference: the loop holds only a weak one
        task.add_done_callback(self._tasks.discard)

    async def _watch_engine(self) -> None:
        """Stop the server when the engine dies, so the platform restarts it."""
        while not self._draining:
            if not self.llm.is_healthy():
                logger.error("pagedserve: the engine failed and cannot serve; stopping the server so that "
                             "the platform restarts it")
                self.engine_failed = True
                if self.on_engine_dead is not None:
                    self.on_engine_dead()
                return
            await asyncio.sleep(HEALTH_POLL_S)

    def begin_drain(self) -> None:
        """SIGTERM: not ready at once, refuse new requests, end the stragglers after drain_timeout.
        Called from the signal handler, so the waiting runs as a task on the server's loop."""
        if self._draining or self._loop is None:
            return
        self._draining = True
        if self.llm is None:
            return
        self.llm.begin_drain()
        timeout = self.config.limits.drain_timeout
        logger.info("pagedserve: draining: %d request(s) in flight get up to %g s to finish",
                    self.llm.num_unfinished_requests, timeout)
        self._loop.call_soon_threadsafe(self._spawn, self._drain(timeout))

    async def _drain(self, timeout: float) -> None:
        cut_off = await self.llm.drain(timeout)
        if cut_off:
            logger.warning("pagedserve: drain period over: %d request(s) ended with an error", cut_off)
        else:
            logger.info("pagedserve: drained: every request in flight finished")

    def warm_engine(self) -> AsyncLLMEngine | None:
        """The engine once it can serve, else None (the OpenAI routes answer 503 then)."""
        return self.llm if self._warm else None

    def metrics_snapshot(self) -> MetricsSnapshot | None:
        return self.llm.metrics if self.llm is not None else None

    def lora_stats(self) -> LoRAStats | None:
        """vllm:lora_requests_info's source: None until the engine exists or when LoRA is off."""
        return self.llm.lora_stats() if self.llm is not None and self.config.lora.enable_lora else None

    async def healthy(self) -> bool:
        return self._warm and not self._draining and self.llm is not None and self.llm.is_healthy()

    def stop(self) -> None:
        self._warm = False
        self.ready = False
        if self.llm is not None:
            self.llm.shutdown()

    def get_input_types(self) -> list[dict]:
        return [{"name": INPUT_NAME, "datatype": "BYTES", "shape": [-1]}]

    def get_output_types(self) -> list[dict]:
        return [{"name": OUTPUT_NAME, "datatype": "BYTES", "shape": [-1]}]

    async def _complete(self, prompts: list[str], parameters: Any, timeout: float | None) -> list[str]:
        """One text per prompt and sample (prompt-major), generated concurrently."""
        params, engine_kwargs = infer_params(parameters)
        engine = self.warm_engine()
        if engine is None:
            raise not_ready()
        texts: list[list[str]] = [[] for _ in range(len(prompts) * params.n)]
        async for i, out in generate_all(engine, f"infer-{uuid.uuid4().hex}", prompts, params, timeout,
                                         engine_kwargs):
            texts[i * params.n + out.index].append(out.text)
        return ["".join(parts) for parts in texts]

    async def predict(self, payload: dict | InferRequest, headers: dict[str, str] | None = None,
                      ) -> dict | InferResponse:
        try:
            timeout = request_timeout(headers)
            if isinstance(payload, InferRequest):
                return await self._predict_v2(payload, timeout)
            return await self._predict_v1(payload, timeout)
        except (OpenAIError, PagedServeError) as exc:
            err = to_openai_error(exc)
            if err.status == 400:
                raise InvalidInput(err.message) from None
            if isinstance(payload, InferRequest) and payload.from_grpc:  # kserve maps these to gRPC codes
                raise {404: NotFound, 429: ResourceExhausted, 503: Unavailable}.get(err.status, Internal)(
                    err.message) from None
            raise HTTPStatusError(err) from None

    async def _predict_v2(self, request: InferRequest, timeout: float | None) -> InferResponse:
        inp = request.get_input_by_name(INPUT_NAME)
        if inp is None:
            names = [i.name for i in request.inputs]
            raise OpenAIError(400, f"input {INPUT_NAME!r} (BYTES) is required; got inputs {names}")
        if inp.datatype != "BYTES":
            raise OpenAIError(400, f"input {INPUT_NAME!r} must be BYTES, got {inp.datatype}")
        prompts = text_inputs(np.asarray(inp.as_numpy(), dtype=object).ravel().tolist(), INPUT_NAME)
        texts = await self._complete(prompts, request.parameters, timeout)
        output = InferOutput(OUTPUT_NAME, shape=[len(texts)], datatype="BYTES", data=texts)
        return InferResponse(response_id=request.id or uuid.uuid4().hex, model_name=self.name,
                             model_version=self.version, infer_outputs=[output], from_grpc=request.from_grpc,
                             use_binary_outputs=request.use_binary_outputs)

    async def _predict_v1(self, body: Any, timeout: float | None) -> dict:
        if not isinstance(body, dict) or not isinstance(body.get("instances"), list):
            raise OpenAIError(400, 'v1 predict expects {"instances": ["prompt", ...], "parameters": {...}}')
        prompts = text_inputs(body["instances"], "instances")
        texts = await self._complete(prompts, body.get("parameters"), timeout)
        return {"predictions": texts}
