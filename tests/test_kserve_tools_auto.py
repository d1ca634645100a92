"""tool_choice "auto" end to end: a real kserve ModelServer started with `--tool-call-parser hermes`
serving a tiny random Qwen3-shaped model whose chat template is hermes-style (tools in the system
block, calls in <tool_call> tags, tool results in <tool_response>), queried with the openai SDK.

A random model never writes a tool call by itself, so the tests force its output with a
structured-output choice (`guided_choice` of one string): the text is then known, and what the
server makes of it (message.tool_calls, content, finish_reason, the streamed deltas) is judged
against that text. Unforced, its random text must come back as content, unchanged."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from pagedserve.core.config import EngineConfig
from pagedserve.core.engine import LLMEngine

from tests.harness.kserve_launch import start_kserve
from tests.harness import ONE_THREAD

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-qwen3"
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n\nFor each function "
    "call, return a json object with function name and arguments within <tool_call></tool_call> XML tags."
    "<|im_end|>\n{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{% for tc in m.tool_calls or [] %}\n<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
    "{{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% elif m.role != 'system' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
HISTORY = [*USER,
           {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
               "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "21 C and sunny"}]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    import shutil

    from transformers import AutoTokenizer

    dst = tmp_path_factory.mktemp("tools-auto") / "tiny-qwen3"
    shutil.copytree(tiny_model_dir("qwen3"), dst)
    tok = AutoTokenizer.from_pretrained(dst)
    tok.chat_template = HERMES_TEMPLATE
    tok.save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    srv = start_kserve(model_dir, tmp_path_factory.mktemp("tools-auto-log") / "server.log", MODEL,
                       args=("--dtype", "float32", "--tool-call-parser", "hermes"), env=ONE_THREAD, timeout=300)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.openai_url, api_key="unused", max_retries=0, timeout=120)


def forced(client, text, stream=False, **kw):
    """A chat with tools whose output is forced to `text`."""
    args = dict(model=MODEL, messages=USER, tools=TOOLS, temperature=0, max_tokens=200,
                extra_body={"guided_choice": [text]}, **kw)
    if not stream:
        return client.chat.completions.create(**args)
    with client.chat.completions.stream(**args) as s:
        events = list(s)
        return s.get_final_completion(), events


def calls_of(message):
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def test_a_forced_call_becomes_message_tool_calls(client):
    r = forced(client, CALL)
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and choice.message.role == "assistant"
    assert calls_of(choice.message) == [("get_weather", {"city": "Paris", "unit": "c"})]
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")


@pytest.mark.parametrize("text, content, calls", [
    (f"Let me look.\n{CALL}", "Let me look.", [("get_weather", {"city": "Paris", "unit": "c"})]),
    (f'{CALL}\n<tool_call>\n{{"name": "get_time", "arguments": {{}}}}\n</tool_call>', None,
     [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {})]),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',  # malformed: content
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>', []),
])
def test_streamed_message_assembles_to_the_non_streamed_one(client, text, content, calls):
    full = forced(client, text)
    message = full.choices[0].message
    assert message.content == content and calls_of(message) == calls
    assert full.choices[0].finish_reason == ("tool_calls" if calls else "stop")
    final, events = forced(client, text, stream=True)
    streamed = final.choices[0]
    assert streamed.message.content == message.content and calls_of(streamed.message) == calls
    assert streamed.finish_reason == full.choices[0].finish_reason
    assert [c.id for c in streamed.message.tool_calls or []] != [] or not calls  # ids were streamed
    # deltas as OpenAI sends them: each call's id and name in its first fragment, arguments after
    seen: set[int] = set()
    for event in events:
        if event.type != "chunk":
            continue
        for tc in event.chunk.choices[0].delta.tool_calls or []:
            assert (tc.id is not None and tc.function.name is not None) == (tc.index not in seen)
            seen.add(tc.index)
    assert len(seen) == len(calls)


def test_parallel_tool_calls_false_keeps_the_first_call(client):
    two = f'{CALL}\n<tool_call>\n{{"name": "get_time", "arguments": {{}}}}\n</tool_call>'
    r = forced(client, two, parallel_tool_calls=False)
    assert calls_of(r.choices[0].message) == [("get_weather", {"city": "Paris", "unit": "c"})]


def test_text_that_is_no_call_comes_back_unchanged(client):
    base = dict(model=MODEL, messages=USER, tools=TOOLS, temperature=0, max_tokens=24, extra_body={"ignore_eos": True})
    auto = client.chat.completions.create(**base)  # tool_choice defaults to "auto" with a parser
    none = client.chat.completions.create(**base, tool_choice="none")
    assert auto.choices[0].message.tool_calls is None and auto.choices[0].finish_reason == "length"
    assert auto.choices[0].message.content == none.choices[0].message.content and none.choices[0].message.content
    streamed = client.chat.completions.create(**base, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == auto.choices[0].message.content
    # the template got the tools: the same chat without them is a shorter prompt
    plain = client.chat.completions.create(**{**base, "tools": None})
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 20


def test_tool_messages_and_earlier_calls_reach_the_template(client, model_dir):
    r = client.chat.completions.create(model=MODEL, messages=HISTORY, tools=TOOLS, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # the prompt the server built: the same render in-process (engine.apply_chat_template)
    engine = LLMEngine(EngineConfig.from_dict({"model": str(model_dir), "dtype": "float32", "max_model_len": 256}))
    from pagedserve.adapters.kserve.protocol import ChatCompletionRequest, parse_request

    req = parse_request(ChatCompletionRequest, json.dumps({"model": MODEL, "messages": HISTORY, "tools": TOOLS}).encode())
    prompt = engine.apply_chat_template(req.template_messages(), tools=req.tool_plan("hermes").template_tools)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\n21 C and sunny\n</tool_response>" in prompt and '"name": "get_time"' in prompt
    assert r.usage.prompt_tokens == len(engine.tokenize(prompt))


@pytest.mark.parametrize("messages, param", [
    ([*USER, {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                   "function": {"name": "f", "arguments": "{oops"}}]}],
     "messages[1].tool_calls[0].function.arguments"),
    ([*USER, {"role": "tool", "content": "21 C"}], "messages[1].tool_call_id"),
    ([*USER, {"role": "user", "content": None}], "messages[1].content"),
])
def test_malformed_tool_messages_are_400_naming_the_field(server, messages, param):
    r = httpx.post(f"{server.openai_url}/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": messages, "tools": TOOLS, "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"]
