"""The models a request may name: the base model and its LoRA adapters, as vLLM's OpenAI server
serves them (its OpenAIServingModels), on kserve's FastAPI app.

* A request's `model` picks what runs: the base model's name runs the base, an adapter's name runs
  that adapter (AsyncLLMEngine.generate's `lora_name`), anything else is a 404 in OpenAI's error
  shape naming the models there are.
* `GET /v1/models` lists the base, then every adapter with vLLM's card fields: `root` (the adapter's
  directory) and `parent` (the base model's id). `GET /v1/models/{id}` answers for either.
* `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter` (`{"lora_name", "lora_path"}`) add and
  remove adapters while serving, with vLLM's answers: 200 and a text body on success; 400 for a
  missing field, a name already loaded (unless `load_inplace`) or an adapter the engine cannot
  serve; 404 for a directory that does not exist or an unload of a name not loaded. vLLM registers
  these routes only when VLLM_ALLOW_RUNTIME_LORA_UPDATING is true (anything else answers 404);
  here they always exist and answer that 404 with a message saying how to turn them on
  (`--allow-runtime-lora-updating`, or the same variable). They are behind the API key (guards.py).

The adapters themselves live in the engine (`list_loras()` is the one registry), so a name loaded or
unloaded here is what the next request sees; a lock orders loads and unloads with each other.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from pagedserve.adapters.kserve.errors import (OpenAIError, error_body, error_headers, model_not_found, not_ready,
                                               to_openai_error)
from pagedserve.core.errors import InvalidRequest, PagedServeError
from pagedserve.core.validation import parse_json_object

if TYPE_CHECKING:
    from pagedserve.core.async_engine import AsyncLLMEngine

RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
"""vLLM's switch for the load/unload routes; read as vLLM reads it ("1" or "true", any case)."""
LOAD_ROUTE, UNLOAD_ROUTE = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
LOAD_FIELDS, UNLOAD_FIELDS = ("lora_name", "lora_path", "load_inplace"), ("lora_name", "lora_path", "lora_int_id")
"""vLLM's request fields (LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest); an unload's lora_path and
lora_int_id are accepted and not used: the name says which adapter goes."""


def runtime_updating_allowed(flag: bool, environ: Mapping[str, str] = os.environ) -> bool:
    """--allow-runtime-lora-updating, or vLLM's environment variable set as vLLM accepts it."""
    return flag or environ.get(RUNTIME_UPDATING_ENV, "0").strip().lower() in ("1", "true")


class ServedModels:
    def __init__(self, base_name: str, get_engine: Callable[[], AsyncLLMEngine | None], lora_enabled: bool = False,
                 allow_runtime_updating: bool = False) -> None:
        self.base_name = base_name
        self._get_engine = get_engine
        """Returns the engine once it has warmed up, None while it loads."""
        self.lora_enabled = lora_enabled
        """The engine serves adapters (--enable-lora): other names may be adapters."""
        self.allow_runtime_updating = allow_runtime_updating
        self.created = int(time.time())
        self._update_lock = asyncio.Lock()

    # -- which model a request names ---------------------------------------------------------------
    def adapters(self) -> dict[str, str]:
        """Adapter name -> its directory, as the engine has them (empty while the engine loads)."""
        engine = self._get_engine()
        if not self.lora_enabled or engine is None:
            return {}
        return engine.list_loras()

    def known(self) -> list[str]:
        return [self.base_name, *self.adapters()]

    def lora_name(self, model: str | None) -> str | None:
        """The adapter a request's `model` names (None: the base model; so is an absent model, on the
        routes where vLLM makes it optional). Raises 404 for a name that is neither, 503 while the
        engine loads and the name may still be an adapter."""
        if model is None or model == self.base_name:
            return None
        if self.lora_enabled and self._get_engine() is None:
            raise not_ready()
        if model in self.adapters():
            return model
        raise model_not_found(model, self.known())

    # -- model cards ----------------------------------------------------------------------------------
    def base_card(self) -> dict[str, Any]:
        return {"id": self.base_name, "object": "model", "created": self.created, "owned_by": "pagedserve"}

    def cards(self) -> list[dict[str, Any]]:
        """The base model's card, then one per adapter (vLLM's `root` and `parent`)."""
        base = self.base_card()
        engine = self._get_engine()
        if engine is not None:
            base.update(root=engine.model_info.model_path, parent=None,
                        max_model_len=engine.model_info.max_model_len)
        return [base, *({"id": name, "object": "model", "created": self.created, "owned_by": "pagedserve",
                         "root": path, "parent": self.base_name} for name, path in self.adapters().items())]

    def card(self, model_id: str) -> dict[str, Any] | None:
        return next((c for c in self.cards() if c["id"] == model_id), None)

    # -- runtime loading (vLLM's routes) --------------------------------------------------------------
    def register(self, app: FastAPI) -> None:
        app.add_api_route(LOAD_ROUTE, self.load_lora_adapter, methods=["POST"])
        app.add_api_route(UNLOAD_ROUTE, self.unload_lora_adapter, methods=["POST"])

    async def load_lora_adapter(self, request: Request) -> Response:
        try:
            engine = self._updatable_engine()
            body = _body(await request.body(), LOAD_FIELDS, LOAD_ROUTE)
            name, path = body.get("lora_name"), body.get("lora_path")
            if not name or not path or not isinstance(name, str) or not isinstance(path, str):
                raise OpenAIError(400, "Both 'lora_name' and 'lora_path' must be provided (non-empty strings), e.g. "
                                       '{"lora_name": "sql", "lora_path": "/adapters/sql"}', type="InvalidUserInput",
                                  param="lora_name" if not name else "lora_path", code="missing_field")
            inplace = body.get("load_inplace", False)
            if not isinstance(inplace, bool):
                raise OpenAIError(400, f"load_inplace must be true or false, got {inplace!r}", type="InvalidUserInput",
                                  param="load_inplace")
            if name == self.base_name:
                raise OpenAIError(400, f"'{name}' is the base model's name; give the adapter another name",
                                  type="InvalidUserInput", param="lora_name")
            if not os.path.isdir(path):  # vLLM's 404 ("No adapter found"): nothing at that path
                raise OpenAIError(404, f"No adapter found for '{name}' at {path}: the server sees no directory there; "
                                       "give the path of a PEFT adapter directory on the server "
                                       "(adapter_config.json + adapter_model.safetensors)",
                                  type="NotFoundError", param="lora_path", code="lora_path_not_found")
            async with self._update_lock:
                if name in engine.list_loras():
                    if not inplace:
                        raise OpenAIError(400, f"The lora adapter '{name}' has already been loaded. If you want to "
                                               "load the adapter in place, set 'load_inplace' to True.",
                                          type="InvalidUserInput", param="lora_name", code="lora_already_loaded")
                    engine.remove_lora(name)  # its running requests finish on the old weights
                await asyncio.to_thread(engine.add_lora, name, path)  # loads between two steps, and waits
        except InvalidRequest as exc:  # not enabled, or an adapter the engine cannot serve
            return error_response(OpenAIError(400, str(exc), type="BadRequestError", param=exc.param))
        except (OpenAIError, PagedServeError) as exc:
            return error_response(exc)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora_adapter(self, request: Request) -> Response:
        try:
            engine = self._updatable_engine()
            name = _body(await request.body(), UNLOAD_FIELDS, UNLOAD_ROUTE).get("lora_name")
            if not name or not isinstance(name, str):
                raise OpenAIError(400, "'lora_name' needs to be provided to unload a LoRA adapter.",
                                  type="InvalidUserInput", param="lora_name", code="missing_field")
            async with self._update_lock:
                if name not in engine.list_loras() or not engine.remove_lora(name):  # returns at once
                    raise OpenAIError(404, f"The lora adapter '{name}' cannot be found; loaded: "
                                           f"{sorted(engine.list_loras()) or 'none'}",
                                      type="NotFoundError", param="lora_name", code="lora_not_found")
        except (OpenAIError, PagedServeError) as exc:
            return error_response(exc)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    def _updatable_engine(self) -> AsyncLLMEngine:
        if not self.allow_runtime_updating:
            raise OpenAIError(404, "loading and unloading LoRA adapters at run time is off on this server; start it "
                                   f"with --allow-runtime-lora-updating or {RUNTIME_UPDATING_ENV}=True (as vLLM), "
                                   "or name the adapters at start with --lora-modules name=path",
                              type="NotFoundError", code="runtime_lora_updating_disabled")
        engine = self._get_engine()
        if engine is None:
            raise not_ready()
        return engine


def error_response(exc: BaseException) -> JSONResponse:
    err = to_openai_error(exc)
    return JSONResponse(error_body(err), status_code=err.status, headers=error_headers(err))


def _body(raw: bytes, fields: tuple[str, ...], route: str) -> dict[str, Any]:
    """The route's JSON object, with only the fields vLLM's request has (an unknown one is named)."""
    error = lambda message: OpenAIError(400, message, type="InvalidUserInput")  # noqa: E731
    body = parse_json_object(raw.decode("utf-8", "replace"), error, f"the body of {route}",
                             'send {"lora_name": "...", "lora_path": "..."}')
    unknown = sorted(set(body) - set(fields))
    if unknown:
        raise OpenAIError(400, f"unknown field(s) {unknown} in the body of {route}; it takes {list(fields)}",
                          type="InvalidUserInput", param=unknown[0])
    return body
