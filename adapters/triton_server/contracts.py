"""One Triton model, two wire contracts; each request says which it speaks.

The shipped model (model_repository/pagedserve) declares the inputs and outputs of both, all
optional, so one engine serves every client:

* text (vllm_backend's): a request with `text_input` -> `text_output` (codec.py);
* tokens (TensorRT-LLM's `tensorrt_llm`): a request with `input_ids` -> `output_ids` (token_codec.py).

Names the two contracts share: `exclude_input_in_output` means the same in both; `temperature`
(FP32, a token-contract input) is also a sampling key of the text contract, so on a text request
the tensor is that key. That keeps `/generate` bodies written for vllm_backend working: Triton turns
a top-level `"temperature": 0` into the tensor, since an input of that name exists. Any other
token-contract input on a text request (and the reverse) is an error naming the contract it belongs
to, never silently ignored.

The config parameter `contract` may restrict a model to one contract ("text" or "tokens"); the
default "auto" accepts both. Pure functions over numpy arrays: unit-tested without Triton.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from pagedserve.adapters.triton_server.codec import TEXT_INPUTS, TextRequest, parse_text_request, scalar
from pagedserve.adapters.triton_server.token_codec import TOKEN_INPUTS, TokenRequest, parse_token_request
from pagedserve.core.errors import ConfigError, InvalidRequest

CONTRACTS = ("auto", "text", "tokens")
ALL_INPUTS = tuple(dict.fromkeys((*TEXT_INPUTS, *TOKEN_INPUTS)))
SHARED_INPUTS = frozenset(TEXT_INPUTS) & frozenset(TOKEN_INPUTS)
TEXT_ONLY = tuple(n for n in TEXT_INPUTS if n not in SHARED_INPUTS)
TOKEN_ONLY = tuple(n for n in TOKEN_INPUTS if n not in SHARED_INPUTS)
TEXT_SAMPLING_INPUTS = ("temperature",)
"""Token-contract inputs that a text request may carry: they are text sampling keys of the same name."""


def contract_from_config(model_config: dict) -> str:
    value = model_config.get("parameters", {}).get("contract", {}).get("string_value", "auto")
    if value not in CONTRACTS:
        raise ConfigError(f"config.pbtxt parameter contract={value!r} is not supported; use one of {CONTRACTS} "
                          "(auto: the request's inputs say which)")
    return value


def _present(tensors: Mapping[str, np.ndarray | None], names) -> list[str]:
    return [n for n in names if tensors.get(n) is not None]


def parse_request(tensors: Mapping[str, np.ndarray | None], parameters_json: str | None,
                  contract: str = "auto") -> TextRequest | TokenRequest:
    """Validate one request of either contract; raises InvalidRequest naming the problem."""
    has_text, has_ids = tensors.get("text_input") is not None, tensors.get("input_ids") is not None
    if has_text and has_ids:
        raise InvalidRequest("send either text_input (the text contract) or input_ids (the token contract), not both")
    which = "tokens" if has_ids else "text"
    if contract != "auto" and which != contract:
        label, wanted = ("text", "text_input (BYTES)") if contract == "text" else ("token", "input_ids (INT32)")
        raise InvalidRequest(f"this model serves the {label} contract only (config.pbtxt parameter "
                             f"contract={contract!r}): send the prompt as {wanted}")
    if not has_text and not has_ids and contract == "auto":
        raise InvalidRequest("no prompt: send text_input (BYTES, the text contract, as vllm_backend) or input_ids "
                             '(INT32, the token contract, as TensorRT-LLM); in a /generate body: {"text_input": "..."}')
    if which == "tokens":
        stray = _present(tensors, TEXT_ONLY)
        if stray:
            raise InvalidRequest(f"{', '.join(stray)}: text-contract input(s) on a request with input_ids; the token "
                                 "contract takes request_output_len, streaming, temperature, runtime_top_k, ...")
        return parse_token_request(tensors)
    stray = [n for n in _present(tensors, TOKEN_ONLY) if n not in TEXT_SAMPLING_INPUTS]
    if stray:
        raise InvalidRequest(f"{', '.join(stray)}: token-contract input(s) (used with input_ids) on a text request; "
                             "for text_input put sampling keys such as max_tokens, seed or stop in "
                             "sampling_parameters or the request parameters")
    from_inputs = {}
    for name in _present(tensors, TEXT_SAMPLING_INPUTS):
        value = scalar(tensors[name], name)
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float)):
            raise InvalidRequest(f"{name}: expected a number, got {value!r}")
        from_inputs[name] = float(value)
    return parse_text_request(tensors, parameters_json, from_inputs)
