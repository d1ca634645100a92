"""tool_choice "required" and a named function end to end: a real kserve ModelServer serving the
embedded SmolLM2 (started without --tool-call-parser: forced calls need none), queried with the
openai SDK. Judges: jsonschema (every call's arguments against its function's schema), the SDK's
own stream helper (the streamed message it assembles must equal the non-streamed one), and 400s
that name the field for bad tools, tool_choice and messages."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "smollm2"
WEATHER_ARGS = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
STOCK_ARGS = {"type": "object", "required": ["ticker", "days"], "additionalProperties": False,
              "properties": {"ticker": {"type": "string", "pattern": "^[A-Z]{1,5}$"},
                             "days": {"type": "integer", "minimum": 1, "maximum": 30}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER_ARGS}},
         {"type": "function", "function": {"name": "get_stock_price", "description": "Price history of a stock",
                                           "parameters": STOCK_ARGS}}]
SCHEMAS = {"get_weather": WEATHER_ARGS, "get_stock_price": STOCK_ARGS}
USER = [{"role": "user", "content": "What is the weather like in Paris, and how did Apple's stock do this week?"}]


@pytest.fixture(scope="module")
def client(smollm2_kserve):
    return openai.OpenAI(base_url=smollm2_kserve.openai_url, api_key="unused", max_retries=0, timeout=300)


def both(client, **kw):
    """The non-streamed completion, and the one the SDK's stream helper assembles from the deltas."""
    args = dict(model=MODEL, messages=USER, tools=TOOLS, temperature=0, max_tokens=150, **kw)
    full = client.chat.completions.create(**args)
    with client.chat.completions.stream(**args) as stream:
        streamed = stream.get_final_completion()
    return full.choices[0], streamed.choices[0]


def check_calls(message) -> list[str]:
    """Every call is well formed and its arguments validate against its function's schema."""
    names = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        names.append(call.function.name)
    return names


def same_message(full, streamed) -> None:
    assert streamed.finish_reason == full.finish_reason
    assert streamed.message.content == full.message.content
    assert ([(c.function.name, c.function.arguments) for c in streamed.message.tool_calls]
            == [(c.function.name, c.function.arguments) for c in full.message.tool_calls])


@pytest.mark.parametrize("name", ["get_weather", "get_stock_price"])
def test_named_function(client, name):
    full, streamed = both(client, tool_choice={"type": "function", "function": {"name": name}})
    assert check_calls(full.message) == [name]
    assert full.message.content is None
    assert full.finish_reason == "stop"  # a forced function keeps "stop", as in OpenAI's API and vLLM
    same_message(full, streamed)


def test_named_function_streams_id_and_name_first_then_argument_fragments(client):
    stream = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, temperature=0, max_tokens=150,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                            stream=True)
    fragments = [tc for chunk in stream for tc in (chunk.choices[0].delta.tool_calls or [])]
    first, rest = fragments[0], fragments[1:]
    assert first.index == 0 and first.id and first.type == "function" and first.function.name == "get_weather"
    assert len(rest) > 3 and all(tc.id is None and tc.function.name is None and tc.index == 0 for tc in rest)
    arguments = "".join(tc.function.arguments or "" for tc in fragments)
    jsonschema.validate(json.loads(arguments), WEATHER_ARGS)


def test_required_with_two_tools(client):
    full, streamed = both(client, tool_choice="required")
    names = check_calls(full.message)
    assert names and set(names) <= set(SCHEMAS)
    assert full.finish_reason == "tool_calls"
    same_message(full, streamed)


def test_required_sampled_calls_still_validate(client):
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required",
                                       temperature=1.0, seed=11, n=3, max_tokens=200)
    for choice in r.choices:
        if choice.finish_reason == "tool_calls":  # not cut off by max_tokens
            assert check_calls(choice.message)


def test_required_without_parallel_calls_makes_exactly_one(client):
    full, streamed = both(client, tool_choice="required", parallel_tool_calls=False)
    assert len(check_calls(full.message)) == 1
    same_message(full, streamed)


def test_history_with_calls_and_tool_results_is_accepted(client):
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, max_tokens=20, temperature=0)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "send_email"}}},
     "tool_choice.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                             "required": "city"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),  # this server has no --tool-call-parser
    ({"tools": TOOLS, "tool_choice": "any"}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tools"),
])
def test_bad_tool_requests_are_400_naming_the_field(smollm2_kserve, body, param):
    r = httpx.post(f"{smollm2_kserve.openai_url}/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": USER, "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and err["type"] == "invalid_request_error", err


def test_bad_tool_request_leaves_the_server_serving(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required",
                                       extra_body={"guided_regex": "[0-9]+"})
    assert err.value.param == "tools"
    ok = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=3)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_tools_without_a_parser_default_to_none(client):
    """As vLLM without --enable-auto-tool-choice: tools reach the template, the output is text."""
    r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, max_tokens=12, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
