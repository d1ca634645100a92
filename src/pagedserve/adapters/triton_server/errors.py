"""Core errors -> TritonError codes, in one place (docs/design.md, rule 5).

Triton turns the code into the gRPC status (INVALID_ARG -> INVALID_ARGUMENT, ...) and the HTTP
status (INVALID_ARG -> 400, UNAVAILABLE -> 503, ...), so the mapping here decides what clients see.
"""

from __future__ import annotations

from pagedserve.core.errors import DuplicateRequest, EngineDead, EngineOverloaded, EngineStepFailed, InvalidRequest

CANCELLED_MESSAGE = "request cancelled by the client; its engine request was aborted and its KV blocks freed"


def error_code_name(exc: BaseException) -> str:
    """The TritonError code name (an attribute of pb_utils.TritonError) for an exception."""
    if isinstance(exc, DuplicateRequest):
        return "ALREADY_EXISTS"
    if isinstance(exc, InvalidRequest):  # RequestTooLong included
        return "INVALID_ARG"
    if isinstance(exc, (EngineDead, EngineOverloaded)):  # dead, draining, or a full queue: try elsewhere/later
        return "UNAVAILABLE"
    return "INTERNAL"  # EngineStepFailed included: the engine recovered, this request was lost


def error_message(exc: BaseException) -> str:
    if isinstance(exc, (InvalidRequest, EngineDead, EngineOverloaded, EngineStepFailed)):
        return str(exc)
    # Not a caller's fault: say what broke, the server log has the traceback.
    return f"internal error in pagedserve: {type(exc).__name__}: {exc}"


def to_triton_error(pb_utils, exc: BaseException):
    code = getattr(pb_utils.TritonError, error_code_name(exc))
    return pb_utils.TritonError(error_message(exc), code)


def cancelled_error(pb_utils):
    return pb_utils.TritonError(CANCELLED_MESSAGE, pb_utils.TritonError.CANCELLED)
