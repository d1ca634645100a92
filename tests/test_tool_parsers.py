"""The tool-call parsers (adapters/kserve/tool_parsers/) on crafted model output: what is a call,
what stays content, and that feeding the text in any pieces gives what feeding it whole gives (the
streamed message then assembles to the non-streamed one)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.adapters.kserve.tool_parsers import (AUTO_PARSERS, HermesToolParser, Llama3JsonToolParser,
                                                     MistralToolParser, NamedParser, RequiredParser, json_end)


def run(parser, pieces):
    """Feed pieces; return (content, [(name, arguments)], the raw deltas) as a client assembles them."""
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    content = "".join(d.content for d in deltas)
    calls: dict[int, list] = {}
    for d in deltas:
        for tc in d.tool_calls:
            if tc.id is not None:
                assert tc.index not in calls, "a call's id and name come once, first"
                assert tc.index == len(calls), "calls are numbered 0, 1, ... in order"
                calls[tc.index] = [tc.name, "", tc.id]
            calls[tc.index][1] += tc.arguments
    return content, [(n, a) for n, a, _ in calls.values()], deltas


def whole(parser_cls, text, **kw):
    content, calls, _ = run(parser_cls(**kw), [text])
    return content, calls


WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
ARGS = json.dumps({"city": "Paris", "unit": "c"})

HERMES_CASES = [
    # (text, content, calls)
    ("Just text, no call.", "Just text, no call.", []),
    ("  spaces kept exactly  \n", "  spaces kept exactly  \n", []),
    (f"<tool_call>\n{WEATHER}\n</tool_call>", "", [("get_weather", ARGS)]),
    (f"Let me check.\n<tool_call>\n{WEATHER}\n</tool_call>", "Let me check.", [("get_weather", ARGS)]),
    (f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n"
     '{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>\n',
     "", [("get_weather", ARGS), ("get_time", '{"tz": "CET"}')]),
    # malformed JSON stays content, a later good call is still a call
    ('<tool_call>\n{"name": "f", "arguments": {"a": }\n</tool_call>\nok <tool_call>{"name": "g", "arguments": {}}'
     "</tool_call>", '<tool_call>\n{"name": "f", "arguments": {"a": }\n</tool_call>\nok', [("g", "{}")]),
    # cut off inside a call (max_tokens): content
    ('<tool_call>\n{"name": "f", "argu', '<tool_call>\n{"name": "f", "argu', []),
    # unterminated but complete JSON: a call (the model stopped before the closing tag)
    ('<tool_call>\n{"name": "f", "arguments": {"x": [1, "}"]}}', "", [("f", '{"x": [1, "}"]}')]),
    ("a <tool_ca b", "a <tool_ca b", []),  # a partial tag that never completes is content
    ("<tool_call>[1, 2]</tool_call>", "<tool_call>[1, 2]</tool_call>", []),  # not a call object
    ('<tool_call>{"name": "f"}</tool_call>', "", [("f", "{}")]),  # no arguments: {}
    ('<tool_call>{"name": "f", "arguments": {"s": "caf\\u00e9 \\"q\\""}}</tool_call>', "",
     [("f", '{"s": "café \\"q\\""}')]),
]


@pytest.mark.parametrize("text, content, calls", HERMES_CASES)
def test_hermes(text, content, calls):
    assert whole(HermesToolParser, text) == (content, calls)


LLAMA_CASES = [
    ("The capital is Paris.", "The capital is Paris.", []),
    ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}', "", [("get_weather", ARGS)]),
    ('<|python_tag|>{"name": "f", "arguments": {"a": 1}}', "", [("f", '{"a": 1}')]),
    ('{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}', "", [("f", '{"a": 1}'), ("g", "{}")]),
    ('{"answer": 42}', '{"answer": 42}', []),  # JSON that is no call stays content, as it was
    ('{"name": "f", "parameters": {"a": ', '{"name": "f", "parameters": {"a": ', []),
    ('{"name": "f", "parameters": {"a": 1}} and then text', "and then text", [("f", '{"a": 1}')]),
    ('  {"name": "f", "parameters": {}}  ', "", [("f", "{}")]),
]


@pytest.mark.parametrize("text, content, calls", LLAMA_CASES)
def test_llama3_json(text, content, calls):
    assert whole(Llama3JsonToolParser, text) == (content, calls)


MISTRAL_CASES = [
    ("No tools needed.</s>", "No tools needed.", []),
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]</s>', "",
     [("get_weather", ARGS)]),
    ('Sure. [TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]', "Sure.",
     [("f", '{"a": 1}'), ("g", "{}")]),
    ('[TOOL_CALLS]f{"a": 1}[TOOL_CALLS]g[ARGS]{"b": [2]}</s>', "", [("f", '{"a": 1}'), ("g", '{"b": [2]}')]),
    ('[TOOL_CALLS][{"name": "f", "arguments": {"a": }]', '[TOOL_CALLS][{"name": "f", "arguments": {"a": }]', []),
]


@pytest.mark.parametrize("text, content, calls", MISTRAL_CASES)
def test_mistral(text, content, calls):
    assert whole(MistralToolParser, text) == (content, calls)


def test_mistral_ids_are_nine_alphanumerics():
    _, _, deltas = run(MistralToolParser(), ['[TOOL_CALLS][{"name": "f", "arguments": {}}]'])
    (first, _args) = deltas[0].tool_calls
    assert len(first.id) == 9 and first.id.isalnum()


def test_required_and_named():
    text = '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {"b": "]"}}]'
    assert whole(RequiredParser, text) == ("", [("f", '{"a": 1}'), ("g", '{"b": "]"}')])
    # cut off by max_tokens: the finished call stays, the rest is content
    assert whole(RequiredParser, '[{"name": "f", "parameters": {}}, {"name": "g", "param') == (
        '{"name": "g", "param', [("f", "{}")])
    assert whole(NamedParser, '{"city": "Paris"}', function_name="get_weather") == (
        "", [("get_weather", '{"city": "Paris"}')])


def test_named_streams_arguments_as_they_come():
    parser = NamedParser("f")
    first = parser.feed('{"a"')
    assert [(tc.id is not None, tc.name, tc.arguments) for tc in first.tool_calls] == [(True, "f", ""),
                                                                                         (False, None, '{"a"')]
    assert [tc.arguments for tc in parser.feed(": 1}").tool_calls] == [": 1}"]


def test_parallel_false_keeps_only_the_first_call():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": {}}</tool_call>'
    assert whole(HermesToolParser, text, parallel=False) == ("", [("f", "{}")])


def test_streaming_holds_back_a_partial_tag_and_an_unfinished_call():
    parser = HermesToolParser()
    assert parser.feed("Hi <tool_").content == "Hi"  # " <tool_" might open a call: held
    assert parser.feed('call>{"name": "f", "arguments": {"a"').tool_calls == []  # not complete yet
    out = parser.feed(": 1}}</tool_call>")
    assert [(tc.name, tc.arguments) for tc in out.tool_calls] == [("f", ""), (None, '{"a": 1}')]
    assert out.tool_calls[0].as_json() == {"index": 0, "id": out.tool_calls[0].id, "type": "function",
                                           "function": {"name": "f", "arguments": ""}}
    assert out.tool_calls[1].as_json() == {"index": 0, "function": {"arguments": '{"a": 1}'}}


ALL_CASES = ([(HermesToolParser, t) for t, _, _ in HERMES_CASES] + [(Llama3JsonToolParser, t) for t, _, _ in LLAMA_CASES]
             + [(MistralToolParser, t) for t, _, _ in MISTRAL_CASES])


@settings(max_examples=150, deadline=None)
@given(case=st.sampled_from(ALL_CASES), cuts=st.lists(st.integers(0, 200), max_size=12))
def test_any_split_gives_the_same_message(case, cuts):
    parser_cls, text = case
    bounds = sorted({c % (len(text) + 1) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)])]
    assert run(parser_cls(), pieces)[:2] == whole(parser_cls, text)


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet='{}[]"\\ ab:,;<>/_tolcaTOLSRG', max_size=60), st.integers(1, 5))
def test_random_text_never_breaks_a_parser(text, step):
    """Whatever a model emits: no exception, and without a call the text comes back unchanged."""
    for parser_cls in AUTO_PARSERS.values():
        pieces = [text[i:i + step] for i in range(0, len(text), step)]
        content, calls, _ = run(parser_cls(), pieces)
        assert (content, calls) == whole(parser_cls, text)
        if not calls:
            expected = text.replace("</s>", "") if parser_cls is MistralToolParser else text
            assert content == expected
        for _, arguments in calls:
            assert isinstance(json.loads(arguments), dict)


def test_json_end():
    assert json_end('{"a": "}"} tail', 0) == 10
    assert json_end('{"a": [1, {"b": "\\""}]}', 0) == 23
    assert json_end('{"a": [1', 0) is None
