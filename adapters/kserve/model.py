"""The kserve predictor: owns the AsyncLLMEngine and answers v1 :predict and v2 infer (REST, gRPC).

Readiness (CONTRACTS.md): kserve registers a model only if `ready` is true when the server starts,
so `ready` is set at once and the real readiness is `healthy()`, true only after start_engine()
has loaded the engine and run one tiny generate. /v2/models/<m>/ready reports healthy(), and
kserve refuses infer with 503 until then. Imported only by the server process (kserve inside).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import numpy as np
from kserve import InferOutput, InferRequest, InferResponse, Model
from kserve.errors import InferenceError, InvalidInput

from pagedserve.adapters.kserve.errors import OpenAIError, to_openai_error
from pagedserve.adapters.kserve.openai_routes import generate_all
from pagedserve.adapters.kserve.protocol import infer_sampling_params, text_inputs
from pagedserve.core.async_engine import AsyncLLMEngine
from pagedserve.core.config import EngineConfig
from pagedserve.core.errors import PagedServeError
from pagedserve.core.metrics import MetricsSnapshot
from pagedserve.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

INPUT_NAME = "text_input"
OUTPUT_NAME = "text_output"


class PagedServeModel(Model):
    def __init__(self, name: str, config: EngineConfig, version: str = "1") -> None:
        super().__init__(name)
        self.config = config
        self.version = version
        self.llm: AsyncLLMEngine | None = None
        self._warm = False
        self.ready = True  # see the module docstring: healthy() is what probes see
        self.engine = True  # kserve's flag: ModelServer then runs start_engine() beside its servers

    async def start_engine(self) -> None:
        logger.info("pagedserve: loading %s", self.config.model.model)
        self.llm = await asyncio.to_thread(AsyncLLMEngine, self.config)
        # One tiny greedy request: the first step pays one-off costs (allocations, lazy imports).
        async for _ in self.llm.generate(f"warmup-{uuid.uuid4().hex}", "Hello",
                                         SamplingParams(max_tokens=1, temperature=0.0)):
            pass
        self._warm = True
        logger.info("pagedserve: model %s is ready", self.name)

    def warm_engine(self) -> AsyncLLMEngine | None:
        """The engine once it can serve, else None (the OpenAI routes answer 503 then)."""
        return self.llm if self._warm else None

    def metrics_snapshot(self) -> MetricsSnapshot | None:
        return self.llm.metrics if self.llm is not None else None

    async def healthy(self) -> bool:
        return self._warm and self.llm is not None and self.llm.is_healthy()

    def stop(self) -> None:
        self._warm = False
        self.ready = False
        if self.llm is not None:
            self.llm.shutdown()

    def get_input_types(self) -> list[dict]:
        return [{"name": INPUT_NAME, "datatype": "BYTES", "shape": [-1]}]

    def get_output_types(self) -> list[dict]:
        return [{"name": OUTPUT_NAME, "datatype": "BYTES", "shape": [-1]}]

    async def _complete(self, prompts: list[str], params: SamplingParams) -> list[str]:
        """One text per prompt and sample (prompt-major), generated concurrently."""
        engine = self.warm_engine()
        if engine is None:
            raise InferenceError("the model is still loading", status=503)
        texts: list[list[str]] = [[] for _ in range(len(prompts) * params.n)]
        async for i, out in generate_all(engine, f"infer-{uuid.uuid4().hex}", prompts, params):
            texts[i * params.n + out.index].append(out.text)
        return ["".join(parts) for parts in texts]

    async def predict(self, payload: dict | InferRequest, headers: dict[str, str] | None = None,
                      ) -> dict | InferResponse:
        try:
            if isinstance(payload, InferRequest):
                return await self._predict_v2(payload)
            return await self._predict_v1(payload)
        except (OpenAIError, PagedServeError) as exc:
            err = to_openai_error(exc)
            if err.status == 400:
                raise InvalidInput(err.message) from None
            raise InferenceError(err.message, status=err.status) from None

    async def _predict_v2(self, request: InferRequest) -> InferResponse:
        inp = request.get_input_by_name(INPUT_NAME)
        if inp is None:
            names = [i.name for i in request.inputs]
            raise OpenAIError(400, f"input {INPUT_NAME!r} (BYTES) is required; got inputs {names}")
        if inp.datatype != "BYTES":
            raise OpenAIError(400, f"input {INPUT_NAME!r} must be BYTES, got {inp.datatype}")
        prompts = text_inputs(np.asarray(inp.as_numpy(), dtype=object).ravel().tolist(), INPUT_NAME)
        texts = await self._complete(prompts, infer_sampling_params(request.parameters))
        output = InferOutput(OUTPUT_NAME, shape=[len(texts)], datatype="BYTES", data=texts)
        return InferResponse(response_id=request.id or uuid.uuid4().hex, model_name=self.name,
                             model_version=self.version, infer_outputs=[output], from_grpc=request.from_grpc,
                             use_binary_outputs=request.use_binary_outputs)

    async def _predict_v1(self, body: Any) -> dict:
        if not isinstance(body, dict) or not isinstance(body.get("instances"), list):
            raise OpenAIError(400, 'v1 predict expects {"instances": ["prompt", ...], "parameters": {...}}')
        prompts = text_inputs(body["instances"], "instances")
        texts = await self._complete(prompts, infer_sampling_params(body.get("parameters")))
        return {"predictions": texts}
