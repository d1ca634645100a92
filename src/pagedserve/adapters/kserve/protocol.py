"""OpenAI request bodies (completions, chat) as strict pydantic models, and their SamplingParams.

Strict: a field of the wrong JSON type is an error (no "10" -> 10), and unknown fields are errors
naming the field, so a client learns at once that we ignored nothing it asked for. Ranges are not
checked here: SamplingParams.from_dict checks them, with the same messages every adapter gives.
Fields the OpenAI spec marks nullable take an explicit null as "the default".

Structured output: OpenAI's `response_format` (json_object, json_schema) and vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` and `structured_outputs` become one
StructuredOutputParams (core/structured_output); at most one of them per request.

`cache_salt` (vLLM's extra, also a v2 parameter) isolates a tenant's prefix cache: only requests
with the same salt share cached prompt blocks. It is no sampling parameter: the routes hand it to
AsyncLLMEngine.generate beside the SamplingParams (`engine_kwargs`).

`logit_bias` (OpenAI's), `bad_words` and `prompt_logprobs` (vLLM's) go to SamplingParams; the
renderers (responses.py) put prompt logprobs beside the choices in vLLM's shape.

Tools (`tools`, `tool_choice`, `parallel_tool_calls`, tool messages) are tool_calls.py's to check
and plan: `ChatCompletionRequest.tool_plan` and `template_messages`.

Some OpenAI fields ask for behaviour pagedserve does not have (stored completions). Clients often
send them at their default or no-op value (`store: false`): those are accepted and change
nothing; any other value is a 400 naming the field (`_refuse`), never silently ignored.
vllm-router (and sglang-router, its origin) parse every request into their own typed model and send
it on with SGLang's fields filled in at their defaults, whatever the client sent: `no_stop_trim`,
`return_hidden_states`, and on chat `continue_final_message`, `include_reasoning`,
`separate_reasoning`, `stream_reasoning`. Those defaults are accepted the same way (docs/replicas.md).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pagedserve.adapters.kserve.errors import OpenAIError
from pagedserve.adapters.kserve.responses import StreamUsage
from pagedserve.adapters.kserve.tool_calls import NO_TOOLS, ToolPlan, plan_tools, template_message
from pagedserve.core.errors import InvalidRequest
from pagedserve.core.kv_cache.prefix_hash import check_cache_salt
from pagedserve.core.sampling_params import MAX_LOGPROBS, SamplingParams
from pagedserve.core.structured_output.params import (StructuredOutputParams, json_object_constraint,
                                                      json_schema_constraint, one_constraint)
from pagedserve.core.validation import check_range, parse_json

# Request fields that go to SamplingParams under the same name (OpenAI's and vLLM's extras).
_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                    "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "min_tokens",
                    "include_stop_str_in_output", "skip_special_tokens", "logit_bias", "bad_words",
                    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


def _refuse(field: str, message: str) -> OpenAIError:
    return OpenAIError(400, message, param=field, code="unsupported_value")


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None
    """vLLM's extra: with include_usage, every chunk also carries the usage so far."""


class JsonSchemaFormat(_Strict):
    """OpenAI's response_format.json_schema. `schema` is a pydantic attribute name, hence the alias."""

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    """Accepted either way: the output always follows the schema (constrained decoding)."""


class ResponseFormat(_Strict):
    type: str
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> StructuredOutputParams | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return json_object_constraint("response_format")
        if self.type == "json_schema":
            if self.json_schema is None:
                raise OpenAIError(400, 'response_format type "json_schema" needs "json_schema": {"name": ..., '
                                       '"schema": {...}}', param="response_format.json_schema")
            if self.json_schema.schema_ is None:  # OpenAI: schema is optional; then any JSON object
                return json_object_constraint("response_format.json_schema")
            return json_schema_constraint(self.json_schema.schema_, "response_format.json_schema.schema")
        raise _refuse("response_format", f"response_format type {self.type!r} is not supported; send "
                                         '"text", "json_object" or "json_schema", or omit response_format')


class _GenerateRequest(_Strict):
    model: str
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None  # accepted for compatibility; pagedserve does not use it
    response_format: ResponseFormat | None = None  # structured output (see the module docstring)
    logit_bias: dict[str, float] | None = None
    """OpenAI's: token id (as a string) -> bias in [-100, 100], added to the logits before sampling."""
    # accepted only at a value that changes nothing (see the module docstring)
    store: bool | None = None
    metadata: dict[str, str] | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    bad_words: list[str] | None = None
    """Words never generated (SamplingParams explains how they are banned)."""
    prompt_logprobs: int | None = None
    """Logprob of every prompt token and its top-N (vLLM's shape: `prompt_logprobs` beside the choices)."""
    cache_salt: str | None = None
    """Prefix-cache isolation: only requests with the same salt share cached blocks (non-empty)."""
    # vLLM's structured output extras (shapes checked by SamplingParams.from_dict)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    # SGLang's, sent by vllm-router at their defaults: accepted only at a value that changes nothing
    no_stop_trim: bool | None = None
    return_hidden_states: bool | None = None

    @property
    def stream_usage(self) -> StreamUsage:
        """What usage a stream carries (OpenAI's include_usage, vLLM's continuous_usage_stats)."""
        opts = self.stream_options
        if opts is None or not opts.include_usage:
            return StreamUsage.OFF
        return StreamUsage.EVERY_CHUNK if opts.continuous_usage_stats else StreamUsage.FINAL

    def check_supported(self) -> None:
        """Raise a 400 naming the first field whose value asks for behaviour pagedserve lacks."""
        if self.store:
            raise _refuse("store", "store=true is not supported: pagedserve stores no completions; omit it or "
                                   "send false")
        if self.metadata:
            raise _refuse("metadata", "metadata tags stored completions, and pagedserve stores none; omit it "
                                      "or send null")
        if self.no_stop_trim:
            raise _refuse("no_stop_trim", "no_stop_trim=true is not supported; to keep the stop string in the "
                                          "output send include_stop_str_in_output=true")
        if self.return_hidden_states:
            raise _refuse("return_hidden_states", "return_hidden_states=true is not supported: pagedserve returns "
                                                  "no hidden states; omit it or send false")

    def engine_kwargs(self) -> dict[str, Any]:
        """What the request asks of the engine besides its SamplingParams (AsyncLLMEngine.generate's
        keyword arguments); raises a 400 naming a bad field."""
        return {"cache_salt": check_cache_salt(self.cache_salt)}

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None = None, **extra: Any) -> SamplingParams:
        data: dict[str, Any] = {k: v for k in _SAMPLING_FIELDS if (v := getattr(self, k)) is not None}
        data.update(max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs, **extra)
        params = SamplingParams.from_dict(data)
        if self.response_format is not None:
            constraint = one_constraint(self.response_format.constraint(), params.structured_output)
            params = dataclasses.replace(params, structured_output=constraint)
        return params


class CompletionRequest(_GenerateRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    """Top-N logprobs per token (OpenAI: an integer, 0 = only the sampled token)."""
    echo: bool | None = None
    best_of: int | None = None
    """Only equal to n (SamplingParams.from_dict holds the rule every adapter shares)."""
    suffix: str | None = None

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens=0: return the prompt (and its logprobs) and generate nothing."""
        return bool(self.echo) and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a batch is a list of strings or a list of token-id lists."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise OpenAIError(400, "prompt is empty; send a string, token ids or a list of them", param="prompt")
        return list(p)

    def sampling_params(self) -> SamplingParams:
        self.check_supported()
        if self.suffix:
            raise _refuse("suffix", "suffix (insertion) is not supported; omit it or send null")
        # OpenAI's default for completions is 16 tokens; echo with logprobs also scores the prompt.
        max_tokens = 16 if self.max_tokens is None else self.max_tokens
        if self.echo_only:
            # Prompt scoring, as OpenAI's legacy completions and vLLM do it: the engine runs the
            # prompt and samples one token (free: it comes from the last prompt position's logits),
            # which CompletionRenderer drops.
            if self.min_tokens:
                raise InvalidRequest(f"min_tokens={self.min_tokens} exceeds max_tokens=0; omit min_tokens",
                                     param="min_tokens")
            max_tokens = 1
        elif max_tokens == 0:
            raise InvalidRequest("max_tokens=0 generates nothing: it is allowed only with echo=true (which "
                                 "returns the prompt, and its logprobs to score it); ask for at least one token",
                                 param="max_tokens")
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:  # the echoed prompt's logprobs come from the same scoring
            if prompt_logprobs not in (None, self.logprobs):
                raise InvalidRequest(f"prompt_logprobs={prompt_logprobs} with echo and logprobs={self.logprobs}: "
                                     "the echoed prompt is scored once; send them equal or omit prompt_logprobs",
                                     param="prompt_logprobs")
            prompt_logprobs = self.logprobs
        return self._sampling_params(max_tokens, self.logprobs, prompt_logprobs, best_of=self.best_of)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class MediaPart(BaseModel):
    """An image, audio, video or file content part (OpenAI's and vLLM's spellings): parsed only to
    be refused by name, since pagedserve serves text decoders (a multimodal checkpoint such as
    Gemma3ForConditionalGeneration runs as its text decoder)."""
    model_config = ConfigDict(extra="allow")
    type: Literal["image_url", "input_image", "image", "input_audio", "audio_url", "video_url", "file"]


class ChatMessage(_Strict):
    role: str
    content: str | list[TextPart | MediaPart] | None = None
    """None (or absent) only on an assistant message with tool_calls."""
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    """An assistant's earlier calls: [{"id", "type": "function", "function": {"name", "arguments"}}]."""
    tool_call_id: str | None = None
    """A tool message's answer to that call."""

    def as_template_input(self, i: int = 0) -> dict[str, Any]:
        """The chat template's view of this message (messages[i]); 400 names a malformed field."""
        for j, part in enumerate(self.content if isinstance(self.content, list) else ()):
            if isinstance(part, MediaPart):
                raise _refuse(f"messages[{i}].content[{j}]",
                              f"messages[{i}].content[{j}] is a {part.type!r} part: pagedserve serves text models "
                              "only (a multimodal checkpoint runs as its text decoder) and takes no images, audio, "
                              "video or files; send text parts")
        content = self.content if isinstance(self.content, str) or self.content is None \
            else "".join(p.text for p in self.content)
        return template_message(i, self.role, content, self.tool_calls, self.tool_call_id)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The conversation as the chat template takes it (the chat route's and /tokenize's)."""
    return [m.as_template_input(i) for i, m in enumerate(messages)]


class ChatCompletionRequest(_GenerateRequest):
    messages: list[ChatMessage]
    logprobs: bool | None = None
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool | None = None  # vLLM extra; None means true
    # function calling (tool_calls.py)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # Reasoning-parser and prefill options of vLLM and SGLang that vllm-router sends at their defaults.
    # pagedserve has no reasoning parser: reasoning text stays in `content`, so separating or streaming
    # it apart changes nothing, and only dropping it (include_reasoning=false) would need one.
    continue_final_message: bool | None = None
    include_reasoning: bool | None = None
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.continue_final_message:
            raise _refuse("continue_final_message", "continue_final_message=true is not supported; omit it or "
                                                    "send false")
        if self.include_reasoning is False:
            raise _refuse("include_reasoning", "include_reasoning=false is not supported: pagedserve has no "
                                               "reasoning parser to tell reasoning apart; omit it or send true")

    def tool_plan(self, parser_name: str | None) -> ToolPlan:
        """What the tools ask for; parser_name: the server's --tool-call-parser, if any."""
        return plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls, parser_name)

    def template_messages(self) -> list[dict[str, Any]]:
        return template_messages(self.messages)

    def sampling_params(self, tools: ToolPlan = NO_TOOLS) -> SamplingParams:
        self.check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise OpenAIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise OpenAIError(400, "send max_completion_tokens or max_tokens (deprecated), not both",
                              param="max_completion_tokens")
        # Checked here under the client's names: SamplingParams calls them logprobs and max_tokens.
        check_range(InvalidRequest, "top_logprobs", self.top_logprobs, 0, MAX_LOGPROBS)
        check_range(InvalidRequest, "max_completion_tokens", self.max_completion_tokens, 1,
                    hint="ask for at least one token")
        # No default cap for chat (as OpenAI): generate up to the end of the context or a stop.
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return tools.apply(self._sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None,
                                                 self.prompt_logprobs))


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


def infer_params(parameters: Any) -> tuple[SamplingParams, dict[str, Any]]:
    """v2 infer request parameters (a REST dict, or gRPC's map of InferParameter) -> SamplingParams
    and the engine's keyword arguments (cache_salt, lora_name).

    Each parameter is a sampling parameter, `cache_salt`, `lora_name` (the LoRA adapter to run, as
    Triton's vllm_backend takes it), or `sampling_parameters`: a JSON object in
    a string (the Triton LLM convention), which also carries what scalar parameters cannot: lists
    (stop) and, over gRPC, floats: kserve's gRPC InferParameter has no double field, so a client's
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
    kwargs: dict[str, Any] = {"cache_salt": check_cache_salt(data.pop("cache_salt", None))}
    lora_name = data.pop("lora_name", None)
    if lora_name is not None:
        if not isinstance(lora_name, str) or not lora_name:
            raise OpenAIError(400, f"lora_name={lora_name!r}: expected the name of a loaded LoRA adapter "
                                   "(GET /v1/models lists them)", param="lora_name")
        kwargs["lora_name"] = lora_name
    return SamplingParams.from_dict(data), kwargs


def _json_object(value: Any, what: str) -> dict[str, Any]:
    """An object of sampling parameters, sent as one or as its JSON text."""
    error, fix = functools.partial(OpenAIError, 400, param=what), 'send a JSON object such as {"max_tokens": 32}'
    obj = parse_json(value, error, what, fix) if isinstance(value, str) else value
    if not isinstance(obj, dict):
        raise error(f"{what} must be a JSON object of sampling parameters, got {type(obj).__name__}; {fix}")
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
