"""Checks in front of every route of the kserve app, before any handler reads or parses a body.

* Request body size (LimitsConfig.max_request_bytes): larger bodies get 413 at once. A body with
  a Content-Length over the limit is never read into memory; a chunked one is counted as it
  arrives. Clients that send `Expect: 100-continue` (curl does, for large bodies) get the 413
  before sending the body; other clients are sending it already, so it is read and discarded (up
  to DISCARD_LIMIT_BYTES) before answering: closing the socket under a client that is still
  writing makes most clients report a connection reset instead of the 413.
* The optional API key of the OpenAI routes (vLLM's convention: `--api-key` or an environment
  variable, checked against `Authorization: Bearer <key>`): 401 without it, on /openai/v1/... and
  on the same routes under /v1 (completions, chat/completions, models; that last one is also
  KServe's v1 model list, which then needs the key too), and on vLLM's /tokenize and /detokenize
  (vllm-router forwards the client's Authorization header there), and on vLLM's
  /v1/load_lora_adapter and /v1/unload_lora_adapter. Health, metrics and the v1/v2 inference
  routes stay open, as in vLLM, where only the OpenAI routes are guarded.
* `X-Request-Timeout: <seconds>`: a request's own deadline (OpenAI's bodies have no field for
  one); past it the request ends with finish_reason "timeout".
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from pagedserve.adapters.kserve.errors import OpenAIError, error_body

OPENAI_PREFIX = "/openai/"
OPENAI_V1_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/models"})
"""The OpenAI routes also served under /v1 (vLLM's paths): guarded and answered like /openai/v1."""
KEYED_PATHS = OPENAI_V1_PATHS | {"/tokenize", "/detokenize", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
"""Every path outside /openai/ the API key guards: the /v1 OpenAI routes, vLLM's tokenizer routes and
its LoRA adapter routes (served_models.py)."""
API_KEY_ENV = "PAGEDSERVE_API_KEY"
TIMEOUT_HEADER = "x-request-timeout"
DISCARD_LIMIT_BYTES = 256 * 1024**2

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def request_timeout(headers: Mapping[str, str] | None) -> float | None:
    """Seconds from the X-Request-Timeout header (None when absent); 400 names a bad value."""
    raw = None
    for key, value in (headers or {}).items():
        if key.lower() == TIMEOUT_HEADER:
            raw = value
    if raw is None:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise OpenAIError(400, f"header X-Request-Timeout={raw!r} is not a positive number of seconds; "
                               "send e.g. X-Request-Timeout: 30")
    return seconds


class RequestGuard:
    """Pure ASGI middleware (it must see the body before Starlette buffers it)."""

    def __init__(self, app: Callable, max_request_bytes: int, api_key: str | None = None) -> None:
        self.app = app
        self.max_request_bytes = max_request_bytes
        self.api_key = api_key or None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        openai = scope["path"].startswith(OPENAI_PREFIX) or scope["path"].rstrip("/") in KEYED_PATHS
        if openai and self.api_key and not self._authorized(headers):
            err = OpenAIError(401, "invalid or missing API key: send the header Authorization: Bearer <key>",
                              code="invalid_api_key")
            return await _respond(send, err, openai, {"WWW-Authenticate": "Bearer"})
        length = headers.get("content-length")
        if length is not None and length.isdigit():
            if int(length) > self.max_request_bytes:
                if headers.get("expect", "").lower() != "100-continue":
                    await _discard(receive, int(length))
                return await _respond(send, self._too_large(int(length)), openai)
            return await self.app(scope, receive, send)
        return await self._counted(scope, receive, send, openai)

    def _authorized(self, headers: dict[str, str]) -> bool:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    def _too_large(self, size: int, at_least: bool = False) -> OpenAIError:
        return OpenAIError(413, f"the request body is {'more than ' if at_least else ''}{size} bytes, over "
                                f"max_request_bytes={self.max_request_bytes}; send a smaller request (the server's "
                                "limit is the engine setting max_request_bytes, flag --max-request-bytes)",
                           code="request_too_large")

    async def _counted(self, scope: Scope, receive: Receive, send: Send, openai: bool) -> None:
        """A body without Content-Length (chunked): read it up to the limit, then replay it."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            size += len(message.get("body", b""))
            if size > self.max_request_bytes:
                if message.get("more_body", False):
                    await _discard(receive, DISCARD_LIMIT_BYTES)
                return await _respond(send, self._too_large(self.max_request_bytes, at_least=True), openai)
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def _discard(receive: Receive, expected: int) -> None:
    """Read and drop the body (at most DISCARD_LIMIT_BYTES of it)."""
    seen = 0
    while seen < min(expected, DISCARD_LIMIT_BYTES):
        message = await receive()
        if message["type"] != "http.request":
            return
        seen += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


async def _respond(send: Send, err: OpenAIError, openai: bool, headers: dict[str, str] | None = None) -> None:
    """OpenAI's error shape on the OpenAI routes, kserve's ({"error": message}) elsewhere."""
    body = json.dumps(error_body(err) if openai else {"error": err.message}).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
    raw_headers += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": err.status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": body})
