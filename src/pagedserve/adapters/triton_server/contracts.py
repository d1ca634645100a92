"""One Triton model, two wire contracts; each request says which it speaks.

A contract object owns its side of the wire, as vllm_backend's request classes do: the input
tensors it reads, the parser that turns them into an engine request, and the response builder that
turns the engine's deltas into its output tensors. The model (model.py) asks `select_contract` which
contract a request speaks and then only talks to that object; it never branches on the contract.

* text (vllm_backend's): a request with `text_input` -> `text_output` (codec.py);
* tokens (TensorRT-LLM's `tensorrt_llm`): a request with `input_ids` -> `output_ids` (token_codec.py).

The shipped model (model_repository/pagedserve) declares the inputs and outputs of both, all
optional, so one engine serves every client. Names the two contracts share:
`exclude_input_in_output`, `cache_salt` and `lora_name` mean the same in both (a text request may
also send the salt or the adapter as a sampling key, where vllm_backend takes lora_name);
`temperature` (FP32, a token-contract input) is also a sampling key of the text contract, so on a
text request the tensor is that key. That keeps
`/generate` bodies written for vllm_backend working: Triton turns a top-level `"temperature": 0`
into the tensor, since an input of that name exists. Any other token-contract input on a text
request (and the reverse) is an error naming the contract it belongs to, never silently ignored.

The config parameter `contract` may restrict a model to one contract ("text" or "tokens"); the
default "auto" accepts both. Pure functions over numpy arrays: unit-tested without Triton.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Protocol

import numpy as np

from pagedserve.adapters.triton_server.codec import (TEXT_INPUTS, TextRequest, TextResponseBuilder,
                                                     parse_text_request, scalar)
from pagedserve.adapters.triton_server.token_codec import (TOKEN_INPUTS, TokenRequest, TokenResponseBuilder,
                                                           parse_token_request)
from pagedserve.core.errors import ConfigError, InvalidRequest
from pagedserve.core.outputs import RequestOutput
from pagedserve.core.sampling_params import SamplingParams

Tensors = Mapping[str, np.ndarray | None]
Outputs = dict[str, np.ndarray]
DecodeToken = Callable[[int], str]

AUTO = "auto"
SHARED_INPUTS = frozenset(TEXT_INPUTS) & frozenset(TOKEN_INPUTS)
TEXT_ONLY = tuple(n for n in TEXT_INPUTS if n not in SHARED_INPUTS)
TOKEN_ONLY = tuple(n for n in TOKEN_INPUTS if n not in SHARED_INPUTS)
TEXT_SAMPLING_INPUTS = ("temperature",)
"""Token-contract inputs that a text request may carry: they are text sampling keys of the same name."""


class ContractRequest(Protocol):
    """What the model needs from a parsed request of any contract (TextRequest, TokenRequest)."""

    @property
    def prompt(self) -> str | list[int]: ...

    @property
    def params(self) -> SamplingParams: ...

    @property
    def cache_salt(self) -> str | None:
        """Only requests with the same salt share cached prompt blocks (AsyncLLMEngine.generate's kwarg)."""

    @property
    def lora_name(self) -> str | None:
        """The LoRA adapter to run (AsyncLLMEngine.generate's kwarg); None: the base model."""

    @property
    def generates(self) -> bool:
        """False when the request is answered without running the engine (TensorRT-LLM's `stop`)."""


class ResponseBuilder(Protocol):
    """One request's RequestOutput deltas -> output tensors (name -> numpy array). Streaming:
    `add()` returns one response's outputs per delta; otherwise it accumulates and `final()`
    returns the one response."""

    def add(self, out: RequestOutput) -> Outputs | None: ...

    def final(self) -> Outputs: ...


def _present(tensors: Tensors, names) -> list[str]:
    return [n for n in names if tensors.get(n) is not None]


class Contract(ABC):
    name: str
    label: str
    """How messages name it ("the text contract")."""
    prompt_input: str
    """The input that carries the prompt: its presence says a request speaks this contract."""
    prompt_hint: str
    inputs: tuple[str, ...]

    def speaks(self, tensors: Tensors) -> bool:
        return tensors.get(self.prompt_input) is not None

    @abstractmethod
    def parse(self, tensors: Tensors, parameters_json: str | None) -> ContractRequest:
        """Validate one request; raises InvalidRequest naming the input and the fix."""

    @abstractmethod
    def response_builder(self, request: ContractRequest, decode_token: DecodeToken) -> ResponseBuilder:
        """The builder of the request's responses (decode_token: a token id's text, for logprobs)."""


class TextContract(Contract):
    """vllm_backend's: text_input (+ sampling_parameters, stream, return_* flags) -> text_output."""

    name, label = "text", "text"
    prompt_input, prompt_hint = "text_input", "text_input (BYTES)"
    inputs = TEXT_INPUTS

    def parse(self, tensors: Tensors, parameters_json: str | None) -> TextRequest:
        stray = [n for n in _present(tensors, TOKEN_ONLY) if n not in TEXT_SAMPLING_INPUTS]
        if stray:
            raise InvalidRequest(f"{', '.join(stray)}: token-contract input(s) (used with input_ids) on a text "
                                 "request; for text_input put sampling keys such as max_tokens, seed or stop in "
                                 "sampling_parameters or the request parameters")
        from_inputs = {}
        for name in _present(tensors, TEXT_SAMPLING_INPUTS):
            value = scalar(tensors[name], name)
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float)):
                raise InvalidRequest(f"{name}: expected a number, got {value!r}")
            from_inputs[name] = float(value)
        return parse_text_request(tensors, parameters_json, from_inputs)

    def response_builder(self, request: TextRequest, decode_token: DecodeToken) -> TextResponseBuilder:
        return TextResponseBuilder(request, decode_token)


class TokenContract(Contract):
    """TensorRT-LLM's: input_ids + request_output_len (+ runtime_top_k, end_id, ...) -> output_ids."""

    name, label = "tokens", "token"
    prompt_input, prompt_hint = "input_ids", "input_ids (INT32)"
    inputs = TOKEN_INPUTS

    def parse(self, tensors: Tensors, parameters_json: str | None) -> TokenRequest:
        stray = _present(tensors, TEXT_ONLY)
        if stray:
            raise InvalidRequest(f"{', '.join(stray)}: text-contract input(s) on a request with input_ids; the token "
                                 "contract takes request_output_len, streaming, temperature, runtime_top_k, ...")
        return parse_token_request(tensors)

    def response_builder(self, request: TokenRequest, decode_token: DecodeToken) -> TokenResponseBuilder:
        return TokenResponseBuilder(request)  # token ids out: nothing to decode


TEXT, TOKENS = TextContract(), TokenContract()
CONTRACTS: dict[str, Contract] = {c.name: c for c in (TEXT, TOKENS)}
CONTRACT_CHOICES = (AUTO, *CONTRACTS)
ALL_INPUTS = tuple(dict.fromkeys(name for c in CONTRACTS.values() for name in c.inputs))


def contract_from_config(model_config: dict) -> str:
    """The config.pbtxt parameter `contract`: "auto" (default), "text" or "tokens"."""
    value = model_config.get("parameters", {}).get("contract", {}).get("string_value", AUTO)
    if value not in CONTRACT_CHOICES:
        raise ConfigError(f"config.pbtxt parameter contract={value!r} is not supported; use one of "
                          f"{CONTRACT_CHOICES} (auto: the request's inputs say which)")
    return value


def select_contract(tensors: Tensors, allowed: str = AUTO) -> Contract:
    """The contract a request speaks (its prompt input says which), within what the model allows."""
    speaking = [c for c in CONTRACTS.values() if c.speaks(tensors)]
    if len(speaking) > 1:
        raise InvalidRequest("send either text_input (the text contract) or input_ids (the token contract), not both")
    if allowed != AUTO:
        only = CONTRACTS[allowed]
        if speaking and speaking[0] is not only:
            raise InvalidRequest(f"this model serves the {only.label} contract only (config.pbtxt parameter "
                                 f"contract={allowed!r}): send the prompt as {only.prompt_hint}")
        return only  # no prompt at all: its parser names the missing input
    if not speaking:
        raise InvalidRequest("no prompt: send text_input (BYTES, the text contract, as vllm_backend) or input_ids "
                             '(INT32, the token contract, as TensorRT-LLM); in a /generate body: {"text_input": "..."}')
    return speaking[0]


def parse_request(tensors: Tensors, parameters_json: str | None, allowed: str = AUTO) -> ContractRequest:
    """Validate one request of whichever contract it speaks; raises InvalidRequest naming the problem."""
    return select_contract(tensors, allowed).parse(tensors, parameters_json)
