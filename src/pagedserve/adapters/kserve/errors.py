"""core's typed errors -> HTTP status and OpenAI's error JSON, mapped once for the whole adapter.

OpenAI clients parse `{"error": {"message", "type", "param", "code"}}` and raise by status
(openai.BadRequestError for 400, NotFoundError for 404, ...), so every error path goes through here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedserve.core.errors import (EngineDead, EngineOverloaded, EngineShuttingDown, EngineStepFailed,
                                    InvalidRequest, PagedServeError, RequestTooLong, UnknownLoRAAdapter)

RETRY_AFTER_S = 1
"""Retry-After (seconds) on 429/503 answers a client may retry: a full queue, a draining server."""


@dataclass
class OpenAIError(Exception):
    """An error the adapter itself raises (bad JSON, unknown model) with its HTTP status."""

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after: int | None = None
    """Seconds for the Retry-After header, when retrying can help."""

    def __str__(self) -> str:
        return self.message


def to_openai_error(exc: BaseException) -> OpenAIError:
    """The one mapping from an exception to what the client sees."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, RequestTooLong):
        return OpenAIError(400, str(exc), param=exc.param, code="context_length_exceeded")
    if isinstance(exc, UnknownLoRAAdapter):  # the adapter went between the route's check and the engine's
        return OpenAIError(404, str(exc), type="NotFoundError", param=exc.param or "model", code="model_not_found")
    if isinstance(exc, InvalidRequest):  # also DuplicateRequest
        return OpenAIError(400, str(exc), param=exc.param)
    if isinstance(exc, EngineOverloaded):  # the waiting queue is full: back off and retry
        return OpenAIError(429, str(exc), type="server_overloaded_error", code="queue_full",
                           retry_after=RETRY_AFTER_S)
    if isinstance(exc, EngineShuttingDown):  # draining: retry, the load balancer routes elsewhere
        return OpenAIError(503, str(exc), type="service_unavailable_error", code="shutting_down",
                           retry_after=RETRY_AFTER_S)
    if isinstance(exc, EngineDead):  # the engine serves nothing more: tell load balancers to go elsewhere
        return OpenAIError(503, str(exc), type="service_unavailable_error", code="engine_dead")
    if isinstance(exc, EngineStepFailed):  # the engine recovered; this request was lost
        return OpenAIError(500, str(exc), type="server_error", code="engine_step_failed")
    if isinstance(exc, PagedServeError):
        return OpenAIError(500, str(exc), type="server_error")
    return OpenAIError(500, f"internal error: {exc!r}", type="server_error")


def error_body(err: OpenAIError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


def error_headers(err: OpenAIError) -> dict[str, str] | None:
    return {"Retry-After": str(err.retry_after)} if err.retry_after is not None else None


def model_not_found(requested: str, served: str | Sequence[str]) -> OpenAIError:
    """vLLM's 404 for a `model` the server does not serve, naming those it does (the base model and
    any LoRA adapters)."""
    names = [served] if isinstance(served, str) else list(served)
    listed = ", ".join(f"`{n}`" for n in names)
    return OpenAIError(404, f"The model `{requested}` does not exist; this server serves {listed}",
                       param="model", code="model_not_found")


def not_ready() -> OpenAIError:
    return OpenAIError(503, "the model is still loading; retry when /v2/models/<name>/ready answers 200",
                       type="service_unavailable_error", code="model_not_ready")
