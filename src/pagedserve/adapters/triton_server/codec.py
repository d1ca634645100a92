"""Triton tensors <-> engine, for the vllm_backend text contract (model_repository/pagedserve).

Pure functions over numpy arrays and dicts: the model (model.py) reads the request's tensors into
a dict and wraps what `TextResponseBuilder` returns in pb_utils tensors, so this module never
imports a Triton package and is unit-tested directly.

The contract and its quirks are vllm_backend's (docs/contracts.md, Triton):
- `sampling_parameters` is a JSON object; when the tensor is absent the request's `parameters`
  are used instead (that is how the keys of a `/generate` body that name no input arrive).
- Clients written for vllm_backend send numbers as strings (`{"temperature": "0.1"}`); those are
  converted for the numeric/boolean keys, as vllm_backend does, before the strict parser runs.
- Non-streaming `text_output` is prompt + completion unless `exclude_input_in_output`; streaming
  responses carry only the new text. With n > 1 every output has one element per sequence.

`prompt_logprobs` (a sampling key, as vLLM's) adds the output `prompt_logprobs`: one JSON list, one
entry per prompt token (null for the first: nothing precedes it), each vLLM's {token_id: {logprob,
rank, decoded_token}} with the prompt token first, then its top-N. A stream sends it once, in the
response of the first token; a non-streaming request in its one response.

`cache_salt` (prefix-cache isolation per tenant, as vLLM's OpenAI server takes it) is a sampling key
here, since that is where vllm_backend clients put request options; it is also an input of its own
(shared with the token contract), so Triton's `/generate` turns a body's "cache_salt" into that
tensor. It goes to the engine beside the SamplingParams, never into them.

`lora_name` (the LoRA adapter to run, vllm_backend's sampling key) is read the same way: a sampling
key, a request parameter, or the input of that name (shared with the token contract); beside the
SamplingParams too. vllm_backend checks it against its multi_lora.json; here the engine knows
the adapters (engine.json's lora settings and multi_lora.json, engine_config.py) and an unknown
name ends that request alone with an error naming the adapters there are.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedserve.adapters import vllm_logprobs
from pagedserve.core.errors import InvalidRequest
from pagedserve.core.kv_cache.prefix_hash import check_cache_salt
from pagedserve.core.outputs import RequestOutput, TokenLogprobs
from pagedserve.core.sampling_params import SamplingParams
from pagedserve.core.validation import parse_json_object

RETURN_FLAGS = ("return_finish_reason", "return_cumulative_logprob", "return_logprobs",
                "return_num_input_tokens", "return_num_output_tokens")
BOOL_INPUTS = ("stream", "exclude_input_in_output", *RETURN_FLAGS)
CACHE_SALT = "cache_salt"
"""An input of both contracts (STRING [1]); on a text request also a sampling key."""
LORA_NAME = "lora_name"
"""The LoRA adapter a request runs (vllm_backend's sampling key, read from sampling_parameters or
the request parameters); also an input of both contracts (STRING [1]), the token contract's way to
name one. Absent: the base model."""
TEXT_INPUTS = ("text_input", "sampling_parameters", CACHE_SALT, LORA_NAME, *BOOL_INPUTS)

# vllm_backend's string-to-number conversions (its _get_sampling_params_dict), so its clients work.
_INT_KEYS = ("n", "max_tokens", "min_tokens", "top_k", "seed", "logprobs", "prompt_logprobs", "best_of")
_FLOAT_KEYS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_BOOL_KEYS = ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output")
MIN_LOGPROB = vllm_logprobs.MIN_LOGPROB
"""What a -inf logprob (a token structured output forbids) is reported as, as vLLM does."""
RESERVED_PARAMETER_PREFIX = "triton_"
"""Request parameters Triton's own frontends set (e.g. triton_enable_empty_final_response)."""
TIMEOUT_PARAMETER = "timeout"
"""Triton's request-timeout parameter (microseconds). gRPC clients' `timeout=` reaches the model as
the request's timeout; a `/generate` body's "timeout" key arrives as this request parameter."""


def scalar(array: np.ndarray | None, name: str) -> Any:
    """The single element of a [1]-shaped input (None when the input is absent)."""
    if array is None:
        return None
    flat = np.asarray(array).reshape(-1)
    if flat.size != 1:
        raise InvalidRequest(f"{name}: expected one element, got shape {list(np.shape(array))}")
    return flat[0].item() if isinstance(flat[0], np.generic) else flat[0]


def decode_utf8(value: Any, name: str) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, (bytes, bytearray)):
        raise InvalidRequest(f"{name}: expected a string, got {type(value).__name__}")
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"{name} is not valid UTF-8 (byte 0x{value[exc.start]:02x} at position {exc.start}); "
                             "send the text encoded as UTF-8") from None


def parse_bool(value: Any, name: str) -> bool:
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise InvalidRequest(f"{name}: expected true or false, got {value!r}")


def _coerce_strings(params: dict[str, Any]) -> dict[str, Any]:
    """vllm_backend clients send `{"max_tokens": "100"}`; convert such strings, name the key on failure."""
    out = dict(params)
    for key, value in params.items():
        if not isinstance(value, str):
            continue
        try:
            if key in _INT_KEYS:
                out[key] = int(value)
            elif key in _FLOAT_KEYS:
                out[key] = float(value)
            elif key in _BOOL_KEYS:
                out[key] = parse_bool(value, key)
        except ValueError:
            raise InvalidRequest(f"sampling parameter {key}={value!r} is not a number", param=key) from None
    return out  # best_of goes on to SamplingParams.from_dict: one rule for every adapter


def sampling_params_from(raw: Mapping[str, Any], extra: Mapping[str, Any] | None = None) -> SamplingParams:
    """Strict SamplingParams from the client's dict; `extra` adds keys the adapter needs."""
    return SamplingParams.from_dict({**_coerce_strings(dict(raw)), **(extra or {})})


def parse_parameters(text: str, name: str) -> dict[str, Any]:
    """A JSON object of sampling (or request) parameters, as the client sent it."""
    return parse_json_object(text, InvalidRequest, name, 'send a JSON object such as {"max_tokens": 32, "temperature": 0}')


def split_request_parameters(parameters_json: str | None, inputs: Sequence[str]) -> tuple[dict, dict]:
    """Request `parameters` -> (values for named inputs, sampling keys); Triton's own keys dropped."""
    params = parse_parameters(parameters_json, "request parameters") if parameters_json else {}
    as_inputs = {k: v for k, v in params.items() if k in inputs}
    sampling = {k: v for k, v in params.items()
                if k not in inputs and k != TIMEOUT_PARAMETER and not k.startswith(RESERVED_PARAMETER_PREFIX)}
    return as_inputs, sampling


def timeout_seconds(request_timeout_us: int, parameters_json: str | None) -> float | None:
    """A request's own deadline in seconds: Triton's request timeout, else the request parameter
    "timeout" (both in microseconds, Triton's unit); None when neither is set."""
    micros: object = request_timeout_us
    if not micros and parameters_json:
        micros = parse_parameters(parameters_json, "request parameters").get(TIMEOUT_PARAMETER)
    if micros is None or micros == 0:
        return None
    if isinstance(micros, bool) or not isinstance(micros, int) or micros < 0:
        raise InvalidRequest(f"timeout={micros!r}: expected a positive integer number of microseconds "
                             "(Triton's request timeout), e.g. 30000000 for 30 s")
    return micros / 1e6


def cache_salt_input(tensors: Mapping[str, np.ndarray | None], fallback: Any = None) -> str | None:
    """The `cache_salt` input (else `fallback`, a request parameter's value), checked: None or a
    non-empty string."""
    value = scalar(tensors.get(CACHE_SALT), CACHE_SALT)
    if value is None:
        value = fallback
    if isinstance(value, (bytes, bytearray)):
        value = decode_utf8(value, CACHE_SALT)
    return check_cache_salt(value)


def lora_name_input(tensors: Mapping[str, np.ndarray | None], fallback: Any = None) -> str | None:
    """The `lora_name` input (else `fallback`, a sampling key's or request parameter's value),
    checked: None or a non-empty string. Whether the engine has that adapter is the engine's to say."""
    value = scalar(tensors.get(LORA_NAME), LORA_NAME)
    if value is None:
        value = fallback
    if isinstance(value, (bytes, bytearray)):
        value = decode_utf8(value, LORA_NAME)
    if value is not None and (not isinstance(value, str) or not value):
        raise InvalidRequest(f"{LORA_NAME}={value!r}: expected the name of a LoRA adapter (a key of the model's "
                             "multi_lora.json), or leave it out for the base model", param=LORA_NAME)
    return value


def _shared_key(name: str, tensors: Mapping[str, np.ndarray | None], from_params: Mapping[str, Any],
                sampling: dict[str, Any]) -> Any:
    """A key the engine takes beside SamplingParams (cache_salt, lora_name), popped from `sampling`:
    its value as a sampling key, or None when it came as the input of that name (or a request
    parameter naming it), which the caller then reads. Both at once is an error."""
    key = sampling.pop(name, None)
    as_input = tensors.get(name) is not None or from_params.get(name) is not None
    if as_input and key is not None:
        raise InvalidRequest(f"{name} is given twice, as the input {name!r} and as a sampling parameter; "
                             "send it once", param=name)
    return from_params.get(name) if as_input else key


@dataclass(frozen=True)
class TextRequest:
    prompt: str
    params: SamplingParams
    stream: bool = False
    exclude_input_in_output: bool = False
    returns: frozenset[str] = frozenset()
    """The return_* flags set to true."""
    client_logprobs: bool = False
    """Whether the client asked for logprobs (the adapter may ask the engine for them anyway, to
    report cumulative_logprob)."""
    cache_salt: str | None = None
    lora_name: str | None = None
    """The LoRA adapter to run (None: the base model)."""

    @property
    def generates(self) -> bool:
        """Every text request runs on the engine (see TokenRequest.generates for one that does not)."""
        return True


def parse_text_request(tensors: Mapping[str, np.ndarray | None], parameters_json: str | None,
                       from_inputs: Mapping[str, Any] | None = None) -> TextRequest:
    """Validate one request of the text contract; raises InvalidRequest naming the problem.
    `from_inputs`: sampling keys that arrived as input tensors of their own (contracts.py)."""
    raw_prompt = scalar(tensors.get("text_input"), "text_input")
    if raw_prompt is None:
        raise InvalidRequest("text_input is missing: send the prompt as the BYTES input 'text_input' "
                             '(in a /generate body: {"text_input": "..."})')
    prompt = decode_utf8(raw_prompt, "text_input")
    from_params, sampling = split_request_parameters(parameters_json, TEXT_INPUTS)
    flags = {}
    for name in BOOL_INPUTS:
        value = scalar(tensors.get(name), name)
        if value is None:
            value = from_params.get(name)
        flags[name] = False if value is None else parse_bool(value, name)
    sp_tensor = scalar(tensors.get("sampling_parameters"), "sampling_parameters")
    if sp_tensor is not None:
        sampling = parse_parameters(decode_utf8(sp_tensor, "sampling_parameters"), "sampling_parameters")
    for key, value in (from_inputs or {}).items():
        if key in sampling:
            raise InvalidRequest(f"{key} is given twice, as the input {key!r} and as a sampling parameter; send it once")
        sampling = {**sampling, key: value}
    sampling = dict(sampling)  # the engine takes these two beside SamplingParams
    cache_salt = cache_salt_input(tensors, _shared_key(CACHE_SALT, tensors, from_params, sampling))
    lora_name = lora_name_input(tensors, _shared_key(LORA_NAME, tensors, from_params, sampling))
    returns = frozenset(f for f in RETURN_FLAGS if flags[f])
    params = sampling_params_from(sampling)
    client_logprobs = params.logprobs is not None
    if "return_cumulative_logprob" in returns and not client_logprobs:
        # The engine scores tokens only when asked; 0 adds just the sampled token's logprob.
        params = dataclasses.replace(params, logprobs=0)
    return TextRequest(prompt, params, flags["stream"], flags["exclude_input_in_output"], returns, client_logprobs,
                       cache_salt, lora_name)


def logprobs_json(entries: Sequence[TokenLogprobs], decode) -> list[dict[str, dict[str, Any]]]:
    """vllm_backend's shape: per position {token_id: {logprob, rank, decoded_token}}, sampled first
    (adapters/vllm_logprobs.py)."""
    return vllm_logprobs.logprobs_json(entries, decode)


@dataclass
class _Sequence:
    text: list[str] = dataclasses.field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[TokenLogprobs] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    cumulative_logprob: float | None = None


class TextResponseBuilder:
    """Turns one request's RequestOutput deltas into output dicts (name -> numpy array).

    Streaming: `add()` returns the outputs of one response per delta. Non-streaming: `add()` only
    accumulates and `final()` returns the one response.
    """

    def __init__(self, request: TextRequest, decode_token) -> None:
        self.request = request
        self.decode_token = decode_token
        self.seqs = [_Sequence() for _ in range(request.params.n)]
        self.num_input_tokens = 0
        self.prompt_logprobs: bytes | None = None
        """The request's prompt logprobs as JSON (they come with sample 0's first delta)."""

    def add(self, out: RequestOutput) -> dict[str, np.ndarray] | None:
        seq = self.seqs[out.index]
        self.num_input_tokens = out.num_prompt_tokens
        new_prompt_logprobs = out.prompt_logprobs is not None and self.request.params.prompt_logprobs is not None
        if new_prompt_logprobs:
            self.prompt_logprobs = json.dumps(logprobs_json(out.prompt_logprobs, self.decode_token)).encode()
        seq.text.append(out.text)
        seq.num_tokens += len(out.new_token_ids)
        seq.logprobs.extend(out.logprobs or ())
        seq.cumulative_logprob = out.cumulative_logprob
        seq.finish_reason = out.finish_reason
        if not self.request.stream:
            return None
        n = len(self.seqs)
        delta = _Sequence([out.text], len(out.new_token_ids), list(out.logprobs or ()), out.finish_reason,
                          out.cumulative_logprob)
        # With n > 1 a delta belongs to one sequence; the others get empty entries in this response.
        views = [delta if i == out.index else _Sequence(finish_reason=self.seqs[i].finish_reason,
                                                        cumulative_logprob=self.seqs[i].cumulative_logprob)
                 for i in range(n)]
        return self._outputs(views, prefix="", prompt_logprobs=new_prompt_logprobs)

    def final(self) -> dict[str, np.ndarray]:
        prefix = "" if self.request.exclude_input_in_output else self.request.prompt
        return self._outputs(self.seqs, prefix, prompt_logprobs=True)

    def _outputs(self, seqs: Sequence[_Sequence], prefix: str, prompt_logprobs: bool = False) -> dict[str, np.ndarray]:
        """prompt_logprobs: include them (a stream sends them once, in the response they arrive with)."""
        returns = self.request.returns
        outputs = {"text_output": np.array([(prefix + "".join(s.text)).encode("utf-8") for s in seqs],
                                           dtype=np.object_)}
        if prompt_logprobs and self.prompt_logprobs is not None:
            outputs["prompt_logprobs"] = np.array([self.prompt_logprobs], dtype=np.object_)
        if "return_finish_reason" in returns:
            outputs["finish_reason"] = np.array([(s.finish_reason or "").encode() for s in seqs], dtype=np.object_)
        if "return_cumulative_logprob" in returns:
            outputs["cumulative_logprob"] = np.array(
                [s.cumulative_logprob if s.cumulative_logprob is not None else 0.0 for s in seqs], dtype=np.float32)
        if "return_logprobs" in returns:
            outputs["logprobs"] = np.array(
                [json.dumps(logprobs_json(s.logprobs, self.decode_token) if self.request.client_logprobs
                            else None).encode() for s in seqs], dtype=np.object_)
        if "return_num_input_tokens" in returns:
            outputs["num_input_tokens"] = np.array([self.num_input_tokens], dtype=np.uint32)
        if "return_num_output_tokens" in returns:
            outputs["num_output_tokens"] = np.array([s.num_tokens for s in seqs], dtype=np.uint32)
        return outputs
