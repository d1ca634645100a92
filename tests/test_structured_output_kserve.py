"""Structured outputs through a real kserve ModelServer serving the embedded SmolLM2, queried with
the stock openai client. Judges: jsonschema, Python's re, the choice list; unconstrained outputs
are compared with the engine run in-process with no constraint anywhere in its batch."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time

import httpx
import jsonschema
import openai
import pytest

from pagedserve.core.config import EngineConfig
from pagedserve.core.engine import LLMEngine
from pagedserve.core.sampling_params import SamplingParams

from tests.kserve_server import engine_value, scrape

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "smollm2"
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0},
                         "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3}},
          "required": ["name", "age", "hobbies"], "additionalProperties": False}
PHONE = r"\d{3}-\d{3}-\d{4}"
ANSWERS = ["yes", "no", "it depends"]


@pytest.fixture(scope="module")
def client(smollm2_kserve):
    return openai.OpenAI(base_url=smollm2_kserve.openai_url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def oracle():
    return LLMEngine(EngineConfig.from_dict({"model": "default", "dtype": "float32", "max_model_len": 1024}))


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_chat_json_schema_strict_streamed_and_not(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    kw = dict(model=MODEL, messages=user("Invent a person with a name, an age and hobbies."),
              response_format=fmt, max_tokens=120, temperature=0)
    full = client.chat.completions.create(**kw)
    assert full.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(full.choices[0].message.content), PERSON)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    sampled = client.chat.completions.create(**{**kw, "temperature": 1.0}, n=3, seed=4, logprobs=True,
                                             top_logprobs=3)
    for choice in sampled.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)
        # logprobs are of the masked distribution: every token with any probability opens the object
        # ("{" or a merge such as '{"'), and forbidden ones carry vLLM's stand-in for -inf.
        first = choice.logprobs.content[0]
        allowed = [t for t in first.top_logprobs if t.logprob > -9999.0]
        assert allowed and all(t.token.startswith("{") for t in allowed), first.top_logprobs
        assert sum(math.exp(t.logprob) for t in allowed) <= 1 + 1e-5 and first.token.startswith("{")


def test_chat_json_object(client):
    r = client.chat.completions.create(
        model=MODEL, messages=user('What is the capital of France? Answer as a JSON object with the key "capital".'),
        response_format={"type": "json_object"}, max_tokens=60, temperature=0)
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_completions_guided_fields_and_the_structured_outputs_spelling(client):
    def complete(prompt, **extra):
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0.7, seed=2,
                                         extra_body=extra).choices[0]

    phone = complete("Call me at", guided_regex=PHONE)
    assert re.fullmatch(PHONE, phone.text) and phone.finish_reason == "stop"
    assert complete("Is the sky blue? Answer:", guided_choice=ANSWERS).text in ANSWERS
    grammar = 'root ::= "The answer is " [0-9]+ "."'
    assert re.fullmatch(r"The answer is [0-9]+\.", complete("What is 6 times 7?", guided_grammar=grammar).text)
    person = complete("A person as JSON:", guided_json=json.dumps(PERSON))  # JSON text works too
    if person.finish_reason == "stop":
        jsonschema.validate(json.loads(person.text), PERSON)
    assert complete("Pick one:", structured_outputs={"choice": ANSWERS}).text in ANSWERS
    chat = client.chat.completions.create(model=MODEL, messages=user("Give me a phone number."), max_tokens=30,
                                          temperature=0, extra_body={"guided_regex": PHONE})
    assert re.fullmatch(PHONE, chat.choices[0].message.content)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar"),
    ({"structured_outputs": {"json": "{oops"}}, "structured_outputs.json"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
])
def test_invalid_constraints_are_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=5, extra_body=body)
    assert err.value.param == param and param in err.value.message, err.value.body
    ok = client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=3)  # still serving
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_streamed_invalid_constraint_gets_its_status_before_the_stream(smollm2_kserve):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 5, "stream": True, "guided_regex": "[z-a]"}
    r = httpx.post(f"{smollm2_kserve.openai_url}/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex"


def test_unsatisfiable_constraint_has_its_own_finish_reason(client):
    r = client.completions.create(model=MODEL, prompt="Say:", max_tokens=10, temperature=0,
                                  extra_body={"guided_choice": ["yes", "no"], "min_tokens": 4})
    assert r.choices[0].finish_reason == "unsatisfiable" and r.choices[0].text in ("yes", "no")


def test_cancelled_constrained_stream_frees_the_engine(smollm2_kserve, client):
    stream = client.chat.completions.create(model=MODEL, messages=user("Write a very long list of people."),
                                            max_tokens=400, temperature=0, stream=True,
                                            extra_body={"guided_json": {"type": "array", "items": PERSON}})
    for _i, _chunk in zip(range(3), stream):
        pass
    stream.close()
    deadline = time.monotonic() + 30
    while engine_value(scrape(smollm2_kserve.url), "pagedserve:num_requests_running", MODEL) != 0:
        assert time.monotonic() < deadline, "the cancelled request is still running"
        time.sleep(0.1)
    r = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=5, temperature=0,
                                  extra_body={"guided_choice": ANSWERS})
    assert r.choices[0].text in ANSWERS


def test_64_concurrent_mixed_requests(smollm2_kserve, oracle):
    """32 unconstrained greedy requests between 32 constrained ones: the constrained outputs
    satisfy their constraints and the unconstrained ones are token-identical to the engine run
    with no constraint in the batch."""
    topics = ["a cache", "a planet", "a river", "a violin", "a bridge", "a forest", "a robot", "a city"]
    free_prompts = [f"Write one sentence about {t}, number {i}." for i in range(4) for t in topics]
    kinds = [("json", {"guided_json": PERSON}), ("regex", {"guided_regex": PHONE}),
             ("choice", {"guided_choice": ANSWERS}), ("json_object", {"response_format": {"type": "json_object"}})]

    async def main():
        aclient = openai.AsyncOpenAI(base_url=smollm2_kserve.openai_url, api_key="unused", max_retries=0, timeout=600)
        free = [aclient.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0)
                for p in free_prompts]
        constrained = [aclient.chat.completions.create(
            model=MODEL, messages=user(f"Answer number {i}: describe a person, or a phone number, or yes/no."),
            max_tokens=120, temperature=0.8, seed=i, extra_body=kinds[i % 4][1]) for i in range(32)]
        mixed = [c for pair in zip(free, constrained) for c in pair]
        results = await asyncio.gather(*mixed)
        await aclient.close()
        return results[0::2], results[1::2]

    free, constrained = asyncio.run(main())
    want = oracle.generate(free_prompts, SamplingParams(temperature=0, max_tokens=24))
    assert [r.choices[0].text for r in free] == [w.text for w in want]
    assert [r.usage.completion_tokens for r in free] == [len(w.token_ids) for w in want]
    for i, r in enumerate(constrained):
        kind, text = kinds[i % 4][0], r.choices[0].message.content
        if r.choices[0].finish_reason == "length":  # out of tokens mid-document: only a prefix is promised
            assert kind in ("json", "json_object"), text
            continue
        assert r.choices[0].finish_reason == "stop", (kind, text)
        if kind == "json":
            jsonschema.validate(json.loads(text), PERSON)
        elif kind == "regex":
            assert re.fullmatch(PHONE, text)
        elif kind == "choice":
            assert text in ANSWERS
        else:
            assert isinstance(json.loads(text), dict)
    assert sum(r.choices[0].finish_reason == "stop" for r in constrained) >= 28
