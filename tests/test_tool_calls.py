"""The tool plan (adapters/kserve/tool_calls.py) without a server: the grammar's JSON schema for
"required" judged by jsonschema on outputs it must accept and refuse, and the 400s for bad tools."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pagedserve.adapters.kserve.errors import OpenAIError
from pagedserve.adapters.kserve.tool_calls import plan_tools

ADDRESS = {"type": "object", "properties": {"street": {"type": "string"}}, "required": ["street"]}
SHIP = {"type": "function", "function": {"name": "ship", "parameters": {
    "type": "object", "properties": {"to": {"$ref": "#/$defs/address"}}, "required": ["to"],
    "$defs": {"address": ADDRESS}}}}
PING = {"type": "function", "function": {"name": "ping"}}


def schema_of(plan):
    return json.loads(plan.constraint.value)


def test_required_schema_chooses_among_the_tools_with_their_arguments():
    plan = plan_tools([SHIP, PING], "required", None, None)
    assert plan.mode == "required" and plan.constraint.param == "tools" and plan.finish_as_tool_calls
    schema = schema_of(plan)
    good = [{"name": "ship", "parameters": {"to": {"street": "Main St"}}}, {"name": "ping", "parameters": {}}]
    jsonschema.validate(good, schema)  # the $defs moved to the top still resolve
    for bad in ([], [{"name": "pong", "parameters": {}}], [{"name": "ship", "parameters": {"to": {}}}],
                [{"name": "ping", "parameters": {}, "extra": 1}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = schema_of(plan_tools([SHIP, PING], "required", False, None))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, one)  # parallel_tool_calls=false: exactly one call


def test_named_schema_is_the_functions_parameters():
    plan = plan_tools([SHIP, PING], {"type": "function", "function": {"name": "ship"}}, None, None)
    assert plan.mode == "named" and not plan.finish_as_tool_calls
    assert schema_of(plan) == SHIP["function"]["parameters"] and plan.constraint.param == "tools[0].function.parameters"
    assert schema_of(plan_tools([PING], {"type": "function", "function": {"name": "ping"}}, None, None)) == {
        "type": "object", "properties": {}}


def test_default_choice_follows_the_parser():
    assert plan_tools([PING], None, None, "hermes").mode == "auto"
    assert plan_tools([PING], None, None, None).mode == "none"  # as vLLM without auto tool choice
    assert plan_tools(None, None, None, "hermes").template_tools is None
    assert plan_tools([PING], "none", None, "hermes").template_tools == [PING]  # the template still sees them
    assert plan_tools([PING], "auto", None, "mistral").keep_special_tokens  # [TOOL_CALLS] is a special token


@pytest.mark.parametrize("tools, choice, param", [
    ([{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"type": 3}}}}}], None,
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": ""}}], None, "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "f", "params": {}}}], None, "tools[0].function.params"),
    ([{"function": {"name": "f"}}], None, "tools[0].type"),
    ([SHIP, {"type": "function", "function": {"name": "other", "parameters": {
        "$defs": {"address": {"type": "string"}}}}}], "required", "tools[1].function.parameters.$defs.address"),
    ([PING], {"type": "function"}, "tool_choice.function"),
    ([PING], {"type": "tool", "function": {"name": "ping"}}, "tool_choice.type"),
    (None, "required", "tool_choice"),
])
def test_bad_tools_name_the_field(tools, choice, param):
    with pytest.raises(OpenAIError) as err:
        plan_tools(tools, choice, None, None)
    assert err.value.status == 400 and err.value.param == param and param in err.value.message
