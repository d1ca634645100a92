"""OpenAI-compatible routes (/openai/v1/...) served on kserve's FastAPI app, at the paths KServe's
huggingfaceserver uses, so existing OpenAI clients only change the base URL.

kserve's own OpenAI layer needs vLLM's request types (docs/contracts.md), so we serve these ourselves.
This module imports no kserve: it only needs a FastAPI app and an AsyncLLMEngine. It translates
and nothing more: every request goes straight to AsyncLLMEngine.generate, which batches.

Disconnects: a streaming response's generator is cancelled by Starlette when the client goes away,
which closes the engine iterator and aborts the request. A non-streaming handler is never told, so
it polls request.is_disconnected() while it waits and cancels the generation itself.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from pagedserve.adapters.kserve.errors import (OpenAIError, error_body, model_not_found, not_ready,
                                               to_openai_error)
from pagedserve.adapters.kserve.guards import request_timeout
from pagedserve.adapters.kserve.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from pagedserve.adapters.kserve.responses import CompletionRenderer, StreamUsage, ResponseRenderer
from pagedserve.adapters.kserve.served_models import ServedModels, error_response
from pagedserve.adapters.kserve.tool_responses import chat_renderer
from pagedserve.core.async_engine import AsyncLLMEngine
from pagedserve.core.errors import PagedServeError
from pagedserve.core.outputs import RequestOutput
from pagedserve.core.sampling_params import SamplingParams

DISCONNECT_POLL_S = 0.2
"""How often a waiting non-streaming request checks its client is still there."""

T = TypeVar("T")
R = TypeVar("R", CompletionRequest, ChatCompletionRequest)
Output = tuple[int, RequestOutput]  # (prompt index, delta)


class ClientDisconnected(Exception):
    pass


LINE_BREAKS_JSON_KEEPS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})
"""Characters JSON leaves unescaped in a string that str.splitlines (and so httpx's aiter_lines and
other line readers) takes for line ends: raw in an event, they cut it in two for such a client."""


def _event(data: dict[str, Any]) -> str:
    text = json.dumps(data, ensure_ascii=False, separators=(',', ':')).translate(LINE_BREAKS_JSON_KEEPS)
    return f"data: {text}\n\n"


async def generate_all(engine: AsyncLLMEngine, request_id: str, prompts: Sequence[str | list[int]],
                       params: SamplingParams, timeout: float | None = None,
                       engine_kwargs: dict[str, Any] | None = None) -> AsyncIterator[Output]:
    """Deltas of every prompt of one HTTP request, as they come. Closing this iterator (or an
    error in one prompt) closes every engine stream, which aborts their requests.
    engine_kwargs: AsyncLLMEngine.generate's keyword arguments for every prompt (cache_salt)."""
    kwargs = engine_kwargs or {}
    if len(prompts) == 1:  # the common case, without the extra tasks
        async for out in engine.generate(request_id, prompts[0], params, timeout=timeout, **kwargs):
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, prompt: str | list[int]) -> None:
        try:
            async for out in engine.generate(f"{request_id}-{i}", prompt, params, timeout=timeout, **kwargs):
                queue.put_nowait((i, out))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, never lost in a task
            queue.put_nowait((i, exc))
        queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, p)) for i, p in enumerate(prompts)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnected(request: Request, aw: Awaitable[T]) -> T:
    """Await `aw`, cancelling it (and raising ClientDisconnected) if the client goes away first."""
    task = asyncio.ensure_future(aw)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientDisconnected()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def _collect(outputs: AsyncIterator[Output], renderer: ResponseRenderer) -> None:
    async for i, out in outputs:
        renderer.add(i, out)


class OpenAIServing:
    def __init__(self, model_name: str, get_engine: Callable[[], AsyncLLMEngine | None],
                 tool_call_parser: str | None = None, models: ServedModels | None = None) -> None:
        self.model_name = model_name
        self._get_engine = get_engine
        """Returns the engine once it has warmed up, None while it loads."""
        self.tool_call_parser = tool_call_parser
        """--tool-call-parser: how tool_choice "auto" finds calls in the text (None: "auto" is refused)."""
        self.models_served = models or ServedModels(model_name, get_engine)
        """The base model and its LoRA adapters: which one a request's `model` runs (served_models.py)."""

    def register(self, app: FastAPI) -> None:
        """The routes under /openai/v1 (KServe's huggingfaceserver paths), the same handlers under /v1
        (where vLLM clients and routers look), and /health. Registered before kserve adds its own
        routes, so `GET /v1/models` is ours: it answers KServe's v1 model list and OpenAI's at once."""
        for prefix in ("/openai/v1", "/v1"):
            app.add_api_route(f"{prefix}/completions", self.completions, methods=["POST"])
            app.add_api_route(f"{prefix}/chat/completions", self.chat_completions, methods=["POST"])
            app.add_api_route(f"{prefix}/models", self.models, methods=["GET"])
        # :path, as model ids may hold slashes ("org/name"): the SDK puts them in the URL as they are.
        app.add_api_route("/openai/v1/models/{model_id:path}", self.model, methods=["GET"])
        # KServe's v1 readiness route, answered for both protocols (GET only: POST /v1/models/<m>:predict
        # still reaches kserve's handler, Starlette prefers a route whose method matches too).
        app.add_api_route("/v1/models/{model_id:path}", self.model_readiness, methods=["GET"])
        app.add_api_route("/health", self.health, methods=["GET"])
        self.models_served.register(app)  # vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter

    async def models(self, request: Request) -> Response:
        """OpenAI's model list (`object`, `data`: the base model, then its LoRA adapters with vLLM's
        `root` and `parent`) and, beside it, KServe's v1 one (`models`: the kserve model's name): one
        body both kinds of client read, since `GET /v1/models` is each protocol's list."""
        return JSONResponse({"object": "list", "data": self.models_served.cards(), "models": [self.model_name]})

    def _serving(self) -> bool:
        """Ready for requests: loaded and warmed up, not draining, the engine alive."""
        engine = self._get_engine()
        return engine is not None and engine.is_healthy() and not engine.draining

    async def health(self, request: Request) -> Response:
        """vLLM's /health, which routers (vllm-router) poll before they route to a worker: 200 once
        the model has loaded and warmed up, 503 while it loads, drains or after the engine died."""
        return Response(status_code=200 if self._serving() else 503)

    async def model_readiness(self, model_id: str) -> Response:
        """`GET /v1/models/{id}`: KServe's v1 readiness check and OpenAI's models.retrieve at vLLM's base
        URL, one path for both. The body carries both forms (KServe's `name`/`ready` beside OpenAI's
        model card); statuses are KServe's: 503 while not ready (its client reads that as "not
        ready", the openai SDK raises), 404 for another model. No API key, as for every probe.
        A LoRA adapter's id answers too (OpenAI's models.retrieve), with its card."""
        card = self.models_served.card(model_id)
        if card is None:
            return error_response(model_not_found(model_id, self.models_served.known()))
        if not self._serving():
            return error_response(OpenAIError(
                503, f"model `{model_id}` is not ready: it is loading, draining or its engine stopped; "
                     "retry when this route answers 200", type="service_unavailable_error", code="model_not_ready"))
        return JSONResponse({**card, "name": model_id, "ready": True})

    async def model(self, model_id: str) -> Response:
        """OpenAI's models.retrieve: the base model's or an adapter's card, or a 404 in OpenAI's error shape."""
        card = self.models_served.card(model_id)
        if card is None:
            return error_response(model_not_found(model_id, self.models_served.known()))
        return JSONResponse(card)

    def _engine(self) -> AsyncLLMEngine:
        engine = self._get_engine()
        if engine is None:
            raise not_ready()
        return engine

    async def _accept(self, cls: type[R], request: Request) -> tuple[R, AsyncLLMEngine, dict[str, Any]]:
        """The validated body of a request for a served model, the engine to run it on, and the
        engine's keyword arguments: the request's own (cache_salt) and the LoRA adapter its `model` names."""
        req = parse_request(cls, await request.body())
        lora_name = self.models_served.lora_name(req.model)
        engine = self._engine()
        kwargs = req.engine_kwargs()
        if lora_name is not None:
            kwargs["lora_name"] = lora_name
        return req, engine, kwargs

    async def completions(self, request: Request) -> Response:
        try:
            req, engine, kwargs = await self._accept(CompletionRequest, request)
            prompts, params = req.prompts(), req.sampling_params()
        except (OpenAIError, PagedServeError) as exc:
            return error_response(exc)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        renderer = CompletionRenderer(request_id, req.model, engine.decode, params.n,
                                      params.logprobs is not None, bool(req.echo), prompts, req.echo_only,
                                      want_prompt_logprobs=req.prompt_logprobs is not None)
        return await self._respond(request, engine, prompts, params, kwargs, renderer, bool(req.stream),
                                   req.stream_usage)

    async def chat_completions(self, request: Request) -> Response:
        try:
            req, engine, kwargs = await self._accept(ChatCompletionRequest, request)
            tools = req.tool_plan(self.tool_call_parser)
            params = req.sampling_params(tools)
            # Refused unrendered if the contents alone cannot fit; rendered off the event loop.
            prompt = await engine.apply_chat_template(req.template_messages(), tools=tools.template_tools,
                                                      add_generation_prompt=req.add_generation_prompt is not False)
        except (OpenAIError, PagedServeError) as exc:
            return error_response(exc)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        renderer = chat_renderer(request_id, req.model, engine.decode, params.n, params.logprobs is not None,
                                 tools, want_prompt_logprobs=req.prompt_logprobs is not None)
        return await self._respond(request, engine, [prompt], params, kwargs, renderer, bool(req.stream),
                                   req.stream_usage)

    async def _respond(self, request: Request, engine: AsyncLLMEngine, prompts: Sequence[str | list[int]],
                       params: SamplingParams, engine_kwargs: dict[str, Any], renderer: ResponseRenderer, stream: bool,
                       usage: StreamUsage) -> Response:
        try:
            timeout = request_timeout(request.headers)
        except OpenAIError as exc:
            return error_response(exc)
        outputs = generate_all(engine, renderer.request_id, prompts, params, timeout, engine_kwargs)
        try:
            if not stream:
                await until_disconnected(request, _collect(outputs, renderer))
                return JSONResponse(renderer.body())
            # Wait for the first delta before answering 200: a request the engine rejects
            # (too long, bad token ids) then gets a proper error status instead of a broken stream.
            first = await until_disconnected(request, anext(outputs))
        except ClientDisconnected:
            return Response(status_code=499)  # nobody reads it; the engine request is already aborted
        except Exception as exc:  # noqa: BLE001 - every request ends with one answer
            await outputs.aclose()
            return error_response(exc)
        return StreamingResponse(self._sse(first, outputs, renderer, usage),
                                 media_type="text/event-stream")

    @staticmethod
    async def _sse(first: Output, outputs: AsyncIterator[Output], renderer: ResponseRenderer,
                   usage: StreamUsage) -> AsyncIterator[str]:
        try:
            if (chunk := renderer.stream_chunk(*first, usage)) is not None:
                yield _event(chunk)
            async for i, out in outputs:
                if (chunk := renderer.stream_chunk(i, out, usage)) is not None:
                    yield _event(chunk)
            if usage is not StreamUsage.OFF:
                yield _event(renderer.usage_chunk())
        except Exception as exc:  # noqa: BLE001 - the status is already sent: report it in the stream
            yield _event(error_body(to_openai_error(exc)))
        finally:  # also on cancellation (client gone): closing the engine streams aborts them
            await outputs.aclose()
        yield "data: [DONE]\n\n"
