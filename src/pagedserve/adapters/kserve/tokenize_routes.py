"""vLLM's `POST /tokenize` and `POST /detokenize` on the kserve app.

Why they are here: vllm-router's cache-aware policy routes on token prefixes. For every request it
asks the workers for the prompt's token ids (vLLM's newer `/v1/completions/render` first, then
`/tokenize`) and, without them, has no prefix to match: it then routes by load alone, so requests
sharing a prefix scatter over the replicas (docs/replicas.md). The ids returned are exactly those
`generate` runs (the chat template applied as on the chat route, text encoded as the engine
encodes it), so the router's prefix tree and the replica's prefix cache see the same tokens.

Bodies and answers are vLLM's: `{"model"?, "prompt"}` or `{"model"?, "messages", "add_generation_prompt"?}`
-> `{"count", "max_model_len", "tokens", "token_strs": null}`; `{"model"?, "tokens"}` -> `{"prompt"}`.
`model` may name the base model or one of its LoRA adapters (they share the tokenizer).
Both need the API key when one is set, like the OpenAI routes (guards.py). This module imports no
kserve, like openai_routes.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedserve.adapters.kserve.errors import OpenAIError, not_ready
from pagedserve.adapters.kserve.openai_routes import error_response
from pagedserve.adapters.kserve.served_models import ServedModels
from pagedserve.adapters.kserve.protocol import ChatMessage, _Strict, parse_request, template_messages
from pagedserve.core.async_engine import AsyncLLMEngine
from pagedserve.core.errors import PagedServeError


class _Tokenize(_Strict):
    model: str | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = None

    def check_supported(self) -> None:
        if self.add_special_tokens is not None:
            raise OpenAIError(400, "add_special_tokens is not supported: the ids are always those generate runs "
                                   "(the model's own special tokens); omit it", param="add_special_tokens",
                              code="unsupported_value")
        if self.return_token_strs:
            raise OpenAIError(400, "return_token_strs=true is not supported; omit it and decode the ids with "
                                   "POST /detokenize", param="return_token_strs", code="unsupported_value")


class TokenizeCompletionRequest(_Tokenize):
    prompt: str


class TokenizeChatRequest(_Tokenize):
    messages: list[ChatMessage]
    add_generation_prompt: bool | None = None  # None: true, as on the chat route
    continue_final_message: bool | None = None  # vllm-router sends false

    def check_supported(self) -> None:
        super().check_supported()
        if self.continue_final_message:
            raise OpenAIError(400, "continue_final_message=true is not supported; omit it or send false",
                              param="continue_final_message", code="unsupported_value")


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class TokenizeServing:
    def __init__(self, model_name: str, get_engine: Callable[[], AsyncLLMEngine | None],
                 models: ServedModels | None = None) -> None:
        self.model_name = model_name
        self._get_engine = get_engine
        """Returns the engine once it has warmed up, None while it loads."""
        self.models = models or ServedModels(model_name, get_engine)
        """Which names a request may give: the base model's or a LoRA adapter's (one tokenizer for all)."""

    def register(self, app: FastAPI) -> None:
        app.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        app.add_api_route("/detokenize", self.detokenize, methods=["POST"])

    def _engine(self, model: str | None) -> AsyncLLMEngine:
        self.models.lora_name(model)  # 404 for a name not served; an adapter tokenizes as its base model
        engine = self._get_engine()
        if engine is None:
            raise not_ready()
        return engine

    async def tokenize(self, request: Request) -> Response:
        try:
            body = await request.body()
            req = _parse_tokenize(body)
            req.check_supported()
            engine = self._engine(req.model)
            if isinstance(req, TokenizeChatRequest):
                prompt = await engine.apply_chat_template(template_messages(req.messages),
                                                          add_generation_prompt=req.add_generation_prompt is not False)
            else:
                prompt = req.prompt
            ids = await engine.tokenize(prompt)
        except (OpenAIError, PagedServeError) as exc:
            return error_response(exc)
        return JSONResponse({"count": len(ids), "max_model_len": engine.model_info.max_model_len, "tokens": ids,
                             "token_strs": None})

    async def detokenize(self, request: Request) -> Response:
        try:
            req = parse_request(DetokenizeRequest, await request.body())
            engine = self._engine(req.model)
            vocab = engine.model_info.vocab_size
            bad = [t for t in req.tokens if not 0 <= t < vocab]
            if bad:
                raise OpenAIError(400, f"tokens: {bad[:5]} are not token ids of this model (0 <= id < {vocab})",
                                  param="tokens")
            text = engine.decode(req.tokens)
        except (OpenAIError, PagedServeError) as exc:
            return error_response(exc)
        return JSONResponse({"prompt": text})


def _parse_tokenize(body: bytes) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """vLLM tells its two bodies apart by `messages`; so do we, then validate strictly (parse_request
    answers malformed JSON with its own 400)."""
    try:
        raw: Any = json.loads(body)
    except ValueError:
        raw = None
    cls = TokenizeChatRequest if isinstance(raw, dict) and "messages" in raw else TokenizeCompletionRequest
    return parse_request(cls, body)
