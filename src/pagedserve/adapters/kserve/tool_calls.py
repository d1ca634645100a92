"""OpenAI function calling on the chat route, as vLLM's OpenAI server does it: a request's `tools`,
`tool_choice` and `parallel_tool_calls` -> a ToolPlan, and the conversation's tool messages -> the
chat template's input.

    tool_choice         output                                               how
    "none"              text (the template still sees the tools)             -
    "auto"  (default    text and/or calls, found by --tool-call-parser       tool_parsers.AUTO_PARSERS
             with tools and a parser; without a parser the default is "none", as in vLLM)
    "required"          a JSON array of {"name", "parameters"}, one tool each  constrained decoding:
    {"type": "function", "function": {"name": N}}   N's arguments object        the grammar makes the
                                                                                 arguments valid
"required" and a named function reuse structured output (core/structured_output, xgrammar): the
grammar is a JSON schema built from the tools' parameter schemas, so arguments always parse and
validate against their function's schema. parallel_tool_calls=false: at most one call.

Every error is a 400 naming the field as the client sent it (`tools[1].function.parameters`,
`tool_choice.function.name`, `messages[2].tool_calls[0].function.arguments`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedserve.adapters.kserve.errors import OpenAIError
from pagedserve.adapters.kserve.tool_parsers import AUTO_PARSERS, NamedParser, RequiredParser, ToolParser
from pagedserve.core.sampling_params import SamplingParams
from pagedserve.core.structured_output.params import StructuredOutputParams, json_schema_constraint, one_constraint

TOOL_CHOICES = ("none", "auto", "required")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
"""The arguments of a function declared without `parameters` (vLLM's choice)."""


def add_tool_call_parser_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tool-call-parser", choices=tuple(AUTO_PARSERS), default=None,
                   help='how tool_choice "auto" finds tool calls in the output, by the model\'s format (vLLM\'s '
                        "names): hermes (Qwen2.5, Qwen3, Hermes), llama3_json (Llama 3.x), mistral; default: none "
                        '("auto" is refused; "required" and a named function work without one)')


def _bad(param: str, message: str) -> OpenAIError:
    return OpenAIError(400, f"{param}: {message}", param=param)


def _keys(obj: Any, param: str, required: Sequence[str], optional: Sequence[str] = ()) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise _bad(param, f"expected an object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - {*required, *optional})
    if unknown:
        raise _bad(f"{param}.{unknown[0]}", "unknown or unsupported field (remove it)")
    for key in required:
        if obj.get(key) is None:
            raise _bad(f"{param}.{key}", "required field is missing")
    return obj


def _string(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise _bad(param, f"expected a non-empty string, got {value!r}")
    return value


@dataclass(frozen=True)
class FunctionTool:
    name: str
    parameters: dict[str, Any]
    index: int
    """Its place in `tools`, for error messages."""


def check_schema(schema: Any, param: str) -> dict[str, Any]:
    """A function's `parameters`: a JSON schema object that is itself valid (its $schema's draft,
    2020-12 by default); a 400 naming the field otherwise."""
    import jsonschema

    if not isinstance(schema, dict):
        raise _bad(param, f"expected a JSON schema object, got {type(schema).__name__}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "".join(f"[{p!r}]" for p in exc.path)
        raise _bad(param, f"invalid JSON schema{' at ' + where if where else ''}: {exc.message}") from None
    return schema


def parse_tools(tools: list[Any]) -> list[FunctionTool]:
    out: dict[str, FunctionTool] = {}
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        tool = _keys(tool, param, ("type",), ("function",))
        if tool["type"] != "function":
            raise _bad(f"{param}.type", f'{tool["type"]!r} is not supported; send "function"')
        _keys(tool, param, ("type", "function"))
        fn = _keys(tool["function"], f"{param}.function", ("name",), ("description", "parameters", "strict"))
        name = _string(fn["name"], f"{param}.function.name")
        if name in out:
            raise _bad(f"{param}.function.name", f"{name!r} is declared twice; give each tool its own name")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise _bad(f"{param}.function.description", "expected a string")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise _bad(f"{param}.function.strict", "expected true or false")
        parameters = fn.get("parameters")
        schema = EMPTY_PARAMETERS if parameters is None else check_schema(parameters, f"{param}.function.parameters")
        out[name] = FunctionTool(name, schema, i)
    return list(out.values())


def required_schema(tools: list[FunctionTool], parallel: bool) -> dict[str, Any]:
    """vLLM's "required" format: an array of {"name": one tool's name, "parameters": its arguments}.
    Each tool's $defs move to the top, where its "#/$defs/..." references then point."""
    defs: dict[str, Any] = {}
    options = []
    for tool in tools:
        schema = dict(tool.parameters)
        for key, value in schema.pop("$defs", {}).items():
            if key in defs and defs[key] != value:
                raise _bad(f"tools[{tool.index}].function.parameters.$defs.{key}",
                           "another tool defines the same $defs name differently; rename one")
            defs[key] = value
        options.append({"type": "object", "properties": {"name": {"type": "string", "enum": [tool.name]},
                                                         "parameters": schema},
                        "required": ["name", "parameters"], "additionalProperties": False})
    array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
    if not parallel:
        array["maxItems"] = 1
    if defs:
        array["$defs"] = defs
    return array


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools ask of the engine and of the response."""

    mode: str
    """"none", "auto", "required" or "named"."""
    template_tools: list[dict[str, Any]] | None
    """The tools as the chat template gets them (None: the request has none)."""
    constraint: StructuredOutputParams | None = None
    new_parser: Callable[[], ToolParser] | None = None
    """One parser per choice; None: the output is plain content."""
    keep_special_tokens: bool = False

    @property
    def finish_as_tool_calls(self) -> bool:
        """finish_reason "tool_calls" when calls came (vLLM: auto and required; a named function,
        which OpenAI forces, keeps "stop")."""
        return self.mode in ("auto", "required")

    def apply(self, params: SamplingParams) -> SamplingParams:
        constraint = one_constraint(params.structured_output, self.constraint)
        skip = params.skip_special_tokens and not self.keep_special_tokens
        return dataclasses.replace(params, structured_output=constraint, skip_special_tokens=skip)


NO_TOOLS = ToolPlan("none", None)


def plan_tools(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None,
               parser_name: str | None) -> ToolPlan:
    """parser_name: the server's --tool-call-parser (None: "auto" is not available)."""
    declared = parse_tools(tools) if tools else []
    template_tools = list(tools) if declared else None
    parallel = parallel_tool_calls is not False
    if tool_choice is None:
        tool_choice = "auto" if declared and parser_name else "none"
    if isinstance(tool_choice, str):
        if tool_choice not in TOOL_CHOICES:
            raise _bad("tool_choice", f"{tool_choice!r} is not a tool choice; send one of {TOOL_CHOICES} or "
                                      '{"type": "function", "function": {"name": ...}}')
        if tool_choice == "none":
            return ToolPlan("none", template_tools)
    if not declared:
        raise _bad("tool_choice", f"tool_choice={tool_choice!r} needs tools; send `tools` or omit tool_choice")
    if tool_choice == "auto":
        if parser_name is None:
            raise _bad("tool_choice", 'tool_choice "auto" needs a tool-call parser: start the server with '
                                      f"--tool-call-parser ({', '.join(AUTO_PARSERS)}), or send tool_choice "
                                      '"required" or a named function')
        parser_cls = AUTO_PARSERS[parser_name]
        return ToolPlan("auto", template_tools, None, lambda: parser_cls(parallel),
                        keep_special_tokens=parser_cls.needs_special_tokens)
    if tool_choice == "required":
        constraint = json_schema_constraint(required_schema(declared, parallel), "tools")
        return ToolPlan("required", template_tools, constraint, lambda: RequiredParser(parallel))
    choice = _keys(tool_choice, "tool_choice", ("type", "function"))
    if choice["type"] != "function":
        raise _bad("tool_choice.type", f'{choice["type"]!r} is not supported; send "function"')
    name = _string(_keys(choice["function"], "tool_choice.function", ("name",))["name"], "tool_choice.function.name")
    tool = next((t for t in declared if t.name == name), None)
    if tool is None:
        raise _bad("tool_choice.function.name", f"{name!r} is none of the tools ({', '.join(t.name for t in declared)})")
    constraint = json_schema_constraint(tool.parameters, f"tools[{tool.index}].function.parameters")
    return ToolPlan("named", template_tools, constraint, lambda: NamedParser(name))


# -- the conversation ------------------------------------------------------------------------------
def template_tool_calls(tool_calls: list[Any], param: str) -> list[dict[str, Any]]:
    """An assistant message's tool_calls as chat templates read them: arguments as an object (as
    vLLM hands them; templates write `tool_call.arguments | tojson`)."""
    out = []
    for j, call in enumerate(tool_calls):
        p = f"{param}[{j}]"
        call = _keys(call, p, ("id", "function"), ("type",))
        if call.get("type", "function") != "function":
            raise _bad(f"{p}.type", f'{call["type"]!r} is not supported; send "function"')
        fn = _keys(call["function"], f"{p}.function", ("name", "arguments"))
        if not isinstance(fn["arguments"], str):
            raise _bad(f"{p}.function.arguments", "expected the arguments as a JSON string")
        try:
            arguments = json.loads(fn["arguments"])
        except ValueError as exc:
            raise _bad(f"{p}.function.arguments", f"not valid JSON ({exc})") from None
        if not isinstance(arguments, dict):
            raise _bad(f"{p}.function.arguments", "expected a JSON object")
        out.append({"id": _string(call["id"], f"{p}.id"), "type": "function",
                    "function": {"name": _string(fn["name"], f"{p}.function.name"), "arguments": arguments}})
    return out


def template_message(i: int, role: str, content: str | None, tool_calls: list[Any] | None,
                     tool_call_id: str | None) -> dict[str, Any]:
    """One message of the chat template's input; tool calls only on assistant messages, a
    tool_call_id only (and always) on tool messages."""
    param = f"messages[{i}]"
    # An assistant's calls without text: "" as vLLM renders it (templates concatenate content).
    message: dict[str, Any] = {"role": role, "content": "" if content is None else content}
    if tool_calls is not None:
        if role != "assistant":
            raise _bad(f"{param}.tool_calls", f"only assistant messages carry tool_calls (this one is {role!r})")
        message["tool_calls"] = template_tool_calls(tool_calls, f"{param}.tool_calls")
    if content is None and not tool_calls:
        raise _bad(f"{param}.content", "required field is missing (only an assistant message with tool_calls "
                                       "may omit it)")
    if role == "tool":
        message["tool_call_id"] = _string(tool_call_id, f"{param}.tool_call_id")
    elif tool_call_id is not None:
        raise _bad(f"{param}.tool_call_id", f"only tool messages carry tool_call_id (this one is {role!r})")
    return message
