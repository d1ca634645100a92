"""Typed errors a caller can cause or observe.

Adapters map each class once (HTTP status, TritonError code); see docs/design.md, rule 5.
Every message names the field, the value and how to fix it.
"""


class PagedServeError(Exception):
    """Base class for every error pagedserve raises on purpose.

    `param` names the request field or setting at fault when there is one, so an adapter can
    report it in its own shape (OpenAI's `error.param`) without parsing the message.
    """

    def __init__(self, message: str = "", *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ConfigError(PagedServeError, ValueError):
    """An engine setting is unknown, of the wrong type or out of range."""


class ModelNotFound(PagedServeError, FileNotFoundError):
    """The model path or the package carrying the default model is missing."""


class UnsupportedModel(PagedServeError, ValueError):
    """The checkpoint's architecture or a config option is not supported."""


class InvalidRequest(PagedServeError, ValueError):
    """A request parameter is unknown, of the wrong type or out of range."""


class RequestTooLong(InvalidRequest):
    """The prompt (plus max_tokens) does not fit in max_model_len or in the KV cache."""


class DuplicateRequest(InvalidRequest):
    """A request with the same request_id is still running."""


class UnknownLoRAAdapter(InvalidRequest):
    """A request named a LoRA adapter that is not loaded (the message lists the loaded ones)."""


class LoRANotEnabled(InvalidRequest):
    """A request named a LoRA adapter, or one was loaded, on an engine started without enable_lora."""


class InvalidLoRAAdapter(InvalidRequest):
    """A LoRA adapter cannot be served: its PEFT directory is missing or corrupt, its rank exceeds
    max_lora_rank, it targets a module the engine cannot serve, or its shapes are another model's."""


class EngineOverloaded(PagedServeError):
    """The waiting queue is full (max_waiting_requests or max_waiting_prompt_tokens): the request
    was refused at once; retry later or on another replica."""


class EngineStepFailed(PagedServeError, RuntimeError):
    """An internal error in an engine step ended this request; the engine recovered and serves new
    requests (see AsyncLLMEngine for when it gives up instead)."""


class EngineDead(PagedServeError, RuntimeError):
    """The engine hit an internal error or was shut down; it serves nothing more until restarted."""


class EngineShuttingDown(EngineDead):
    """The engine is draining (SIGTERM, unload) or was shut down: it accepts no new requests."""
