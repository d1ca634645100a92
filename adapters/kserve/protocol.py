"""OpenAI request bodies (completions, chat) as strict pydantic models, and their SamplingParams.

Strict: a field of the wrong JSON type is an error (no "10" -> 10), and unknown fields are errors
naming the field, so a client learns at once that we ignored nothing it asked for. Ranges are not
checked here: SamplingParams.from_dict checks them, with the same messages every adapter gives.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from pagedserve.adapters.kserve.errors import OpenAIError
from pagedserve.core.sampling_params import SamplingParams

# Request fields that go to SamplingParams under the same name (OpenAI's and vLLM's extras).
_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                    "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
                    "include_stop_str_in_output", "skip_special_tokens")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _GenerateRequest(_Strict):
    model: str
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None  # accepted for compatibility; pagedserve does not use it
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        data: dict[str, Any] = {k: v for k in _SAMPLING_FIELDS if (v := getattr(self, k)) is not None}
        data["max_tokens"] = max_tokens
        data["logprobs"] = logprobs
        data["prompt_logprobs"] = prompt_logprobs
        return SamplingParams.from_dict(data)


class CompletionRequest(_GenerateRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    """Top-N logprobs per token (OpenAI: an integer, 0 = only the sampled token)."""
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a batch is a list of strings or a list of token-id lists."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise OpenAIError(400, "prompt is empty; send a string, token ids or a list of them", param="prompt")
        return list(p)

    def sampling_params(self) -> SamplingParams:
        # OpenAI's default for completions is 16 tokens; echo with logprobs also scores the prompt.
        max_tokens = 16 if self.max_tokens is None else self.max_tokens
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        return self._sampling_params(max_tokens, self.logprobs, prompt_logprobs)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: str
    content: str | list[TextPart]
    name: str | None = None

    def as_template_input(self) -> dict[str, str]:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": content}


class ChatCompletionRequest(_GenerateRequest):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True  # vLLM extra

    def sampling_params(self) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise OpenAIError(400, "send max_completion_tokens or max_tokens (deprecated), not both",
                              param="max_completion_tokens")
        # No default cap for chat (as OpenAI): generate up to the end of the context or a stop.
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)


def parse_request(cls: type[_GenerateRequest], body: bytes) -> _GenerateRequest:
    """Validate a raw JSON body, turning pydantic's errors into one 400 naming the field."""
    try:
        return cls.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        if any(e["type"] == "json_invalid" for e in errors):
            raise OpenAIError(400, f"the request body is not valid JSON: {errors[0]['msg']}") from None
        wrong = "; ".join(_describe(e) for e in errors[:3])
        raise OpenAIError(400, f"invalid request: {wrong}", param=_field(errors[0]) or None) from None


_UNION_BRANCHES = {"str", "int", "float", "bool", "TextPart", "ChatMessage"}


def _field(error: dict[str, Any]) -> str:
    """The field's path as the client wrote it, without pydantic's union-branch names (str, list[int])."""
    return ".".join(str(p) for p in error["loc"] if not (isinstance(p, str) and ("[" in p or p in _UNION_BRANCHES)))


def _describe(e: dict[str, Any]) -> str:
    loc = _field(e)
    if e["type"] == "extra_forbidden":
        return f"{loc}: unknown or unsupported field (remove it)"
    if e["type"] == "missing":
        return f"{loc}: required field is missing"
    return f"{loc}: {e['msg']} (got {e.get('input')!r})"


# -- Open Inference Protocol v2 / v1 ---------------------------------------------------------------
_KSERVE_PARAMETERS = {"binary_data_output"}
"""Request parameters kserve itself interprets: not sampling parameters."""


def infer_sampling_params(parameters: Any) -> SamplingParams:
    """v2 infer request parameters (a REST dict, or gRPC's map of InferParameter) -> SamplingParams.

    Each parameter is a sampling parameter, or `sampling_parameters`: a JSON object in a string
    (the Triton LLM convention), which also carries what scalar parameters cannot: lists (stop)
    and, over gRPC, floats: kserve's gRPC InferParameter has no double field, so a client's
    double (tritonclient's temperature=0.0) arrives with no value.
    """
    data: dict[str, Any] = {}
    for key, value in (parameters or {}).items():
        if key in _KSERVE_PARAMETERS:
            continue
        if hasattr(value, "WhichOneof"):  # gRPC InferParameter: unwrap the oneof
            which = value.WhichOneof("parameter_choice")
            if which is None:
                raise OpenAIError(400, f"parameter {key!r} arrived without a value (kserve's gRPC parameters "
                                       "hold only bool, int64 and string); send floats and lists inside the "
                                       "JSON string parameter 'sampling_parameters'", param=key)
            value = getattr(value, which)
        if key == "sampling_parameters":
            data.update(_json_object(value, key))
        else:
            data[key] = value
    return SamplingParams.from_dict(data)


def _json_object(value: Any, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError as exc:
        raise OpenAIError(400, f"{what} is not valid JSON: {exc}", param=what) from None
    if not isinstance(obj, dict):
        raise OpenAIError(400, f"{what} must be a JSON object of sampling parameters", param=what)
    return obj


def text_inputs(values: Any, what: str) -> list[str]:
    """BYTES elements (str over REST, bytes over gRPC) -> prompts; anything else is an error."""
    prompts = []
    for i, v in enumerate(values):
        if isinstance(v, bytes):
            try:
                v = v.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise OpenAIError(400, f"{what}[{i}] is not valid UTF-8 ({exc.reason})") from None
        if not isinstance(v, str) or not v:
            raise OpenAIError(400, f"{what}[{i}] = {v!r}: expected a non-empty string (a prompt)")
        prompts.append(v)
    if not prompts:
        raise OpenAIError(400, f"{what} is empty: send at least one prompt")
    return prompts
