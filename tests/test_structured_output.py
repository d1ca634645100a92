"""Constrained decoding in the engine, on the embedded SmolLM2: every output is checked by an
independent judge (jsonschema, Python's re, membership in the choices), and unconstrained requests
are checked token for token against a run without any constraint in the batch."""

from __future__ import annotations

import asyncio
import json
import math
import re
import threading

import jsonschema
import pytest

from pagedserve.core.async_engine import AsyncLLMEngine
from pagedserve.core.config import EngineConfig
from pagedserve.core.engine import LLMEngine
from pagedserve.core.errors import InvalidRequest
from pagedserve.core.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0},
                         "city": {"type": "string", "maxLength": 30}},
          "required": ["name", "age", "city"], "additionalProperties": False}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
COLORS = ["red", "green", "blue", "light yellow"]


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig.from_dict({"model": "default", "dtype": "float32", "max_model_len": 1024}))


def chat(engine, text: str) -> str:
    return engine.apply_chat_template([{"role": "user", "content": text}])


def run(engine, prompt, **params):
    return engine.generate([prompt], SamplingParams.from_dict(params))


def test_json_schema_greedy_and_sampled_outputs_validate(engine):
    prompt = chat(engine, "Describe a fictional person as JSON with name, age and city.")
    results = run(engine, prompt, guided_json=PERSON, temperature=0, max_tokens=80)
    results += run(engine, prompt, guided_json=PERSON, temperature=1.0, seed=7, n=3, max_tokens=80)
    for r in results:
        assert r.finish_reason == "stop", r.text
        jsonschema.validate(json.loads(r.text), PERSON)
    assert len({r.text for r in results[1:]}) > 1, "three seeded samples were identical"


def test_regex_choice_grammar_and_json_object(engine):
    prompt = chat(engine, "Give me a US phone number.")
    (phone,) = run(engine, prompt, guided_regex=PHONE, temperature=0.8, seed=1, max_tokens=30)
    assert re.fullmatch(PHONE, phone.text) and phone.finish_reason == "stop"
    prompt = chat(engine, "Pick a color.")
    picks = run(engine, prompt, guided_choice=COLORS, temperature=1.0, seed=3, n=6, max_tokens=10)
    assert all(p.text in COLORS and p.finish_reason == "stop" for p in picks)
    grammar = 'root ::= "Answer: " ("yes" | "no") "."'
    (g,) = run(engine, chat(engine, "Is water wet?"), guided_grammar=grammar, temperature=0, max_tokens=20)
    assert g.text in ("Answer: yes.", "Answer: no.")
    question = 'What is the capital of France? Answer as a JSON object with the key "capital".'
    (obj,) = run(engine, chat(engine, question), structured_outputs={"json_object": True}, temperature=0,
                 max_tokens=60)
    assert obj.finish_reason == "stop" and isinstance(json.loads(obj.text), dict)


def test_logprobs_are_computed_after_masking(engine):
    """As vLLM: the reported distribution is the masked one. The first token of a choice must be a
    non-empty prefix of one of the choices; there are fewer such tokens than 20, so the top 20
    hold every allowed token, their probabilities add up to one, and the rest are -inf."""
    (r,) = run(engine, chat(engine, "Pick a color."), guided_choice=COLORS, temperature=0, max_tokens=10,
               logprobs=20)
    tok = engine.tokenizer
    allowed = {t for t in range(len(tok)) if (s := tok.decode([t])) and any(c.startswith(s) for c in COLORS)}
    assert 0 < len(allowed) < 20
    first = r.logprobs[0]
    finite = {t: lp for t, lp in first.top if lp > -math.inf}
    assert set(finite) == allowed
    assert math.isclose(sum(math.exp(lp) for lp in finite.values()), 1.0, rel_tol=1e-4)
    assert first.rank == 1 and first.token_id == max(finite, key=finite.get)  # greedy: the best allowed


def test_stop_strings_still_end_a_constrained_output(engine):
    (r,) = run(engine, chat(engine, "Describe a person as JSON."), guided_json=PERSON, temperature=0,
               max_tokens=80, stop=['"age"'])
    assert r.finish_reason == "stop" and r.stop_reason == '"age"'
    assert r.text.startswith('{"name": "') and '"age"' not in r.text


def test_unsatisfiable_constraints_end_without_garbage(engine):
    prompt = chat(engine, "Say something.")
    (empty,) = run(engine, prompt, guided_regex=r"[^\s\S]", temperature=0, max_tokens=10)
    assert (empty.finish_reason, empty.text, empty.token_ids) == ("unsatisfiable", "", ())
    # "yes" is complete after one word; min_tokens bans the end token, and nothing else fits.
    (short,) = run(engine, prompt, guided_choice=["yes", "no"], min_tokens=5, temperature=0, max_tokens=10)
    assert short.finish_reason == "unsatisfiable" and short.text in ("yes", "no")
    # Out of tokens before the constraint completes: "length", as any other request.
    (cut,) = run(engine, prompt, guided_regex=r"[a-z]{40}", temperature=0, max_tokens=3)
    assert cut.finish_reason == "length" and re.fullmatch(r"[a-z]*", cut.text)


def test_completed_grammar_stops_even_with_ignore_eos(engine):
    (r,) = run(engine, chat(engine, "Pick a color."), guided_choice=COLORS, temperature=0, max_tokens=30,
               ignore_eos=True)
    assert r.finish_reason == "stop" and r.text in COLORS


def test_unconstrained_requests_are_token_identical_beside_constrained_ones(engine):
    prompts = [chat(engine, q) for q in ("What is a cache?", "Name a planet.", "Count to five.")]
    free = SamplingParams(temperature=0, max_tokens=24)
    alone = engine.generate(prompts, free)
    mixed = engine.generate(prompts + prompts, [free] * 3 + [SamplingParams.from_dict(
        {"guided_json": PERSON, "temperature": 0, "max_tokens": 40})] * 3)
    assert [r.token_ids for r in mixed[:3]] == [r.token_ids for r in alone]
    seeded = SamplingParams(temperature=0.9, seed=11, max_tokens=24)
    alone = engine.generate(prompts, seeded)
    mixed = engine.generate(prompts + prompts, [seeded] * 3 + [SamplingParams.from_dict(
        {"guided_choice": COLORS, "temperature": 0.9, "seed": 5, "max_tokens": 10})] * 3)
    assert [r.token_ids for r in mixed[:3]] == [r.token_ids for r in alone]


def test_a_constraint_the_output_already_satisfies_changes_no_token(engine):
    """Masking only removes tokens: where the unconstrained output is allowed at every step, greedy
    and plain temperature sampling (the exponential race over the renormalised allowed set) pick the
    same tokens, and the request ends the same way. top_k / top_p / min_p are left out on purpose:
    they cut the distribution after masking, so a constraint may change what survives the cut."""
    prompts = [chat(engine, q) for q in ("Name a planet.", "What is 2+3?", "Say hello in French.")]
    for free in (SamplingParams(temperature=0, max_tokens=24),
                 SamplingParams(temperature=0.8, seed=21, max_tokens=24)):
        alone = engine.generate(prompts, free)
        for prompt, want in zip(prompts, alone):
            constraints = {"guided_choice": [want.text, want.text + " and more", "something else"],
                           "guided_regex": "[^<>]*" if "<" not in want.text and ">" not in want.text else None}
            for key, value in constraints.items():
                if value is None:
                    continue
                params = SamplingParams.from_dict({"temperature": free.temperature, "seed": free.seed,
                                                   "max_tokens": free.max_tokens, key: value})
                (got,) = engine.generate([prompt], params)
                assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason), (key, want.text)


def test_preemption_replays_nothing_wrong(engine):
    """A KV cache too small for the batch preempts (recompute); the grammar state survives it and
    the greedy outputs equal those of a roomy engine."""
    tight = LLMEngine(EngineConfig.from_dict({"model": "default", "dtype": "float32", "num_kv_blocks": 12,
                                              "block_size": 16, "max_model_len": 1024,
                                              "max_num_batched_tokens": 64}))
    prompts = [chat(engine, f"Describe person number {i} as JSON.") for i in range(8)]
    params = SamplingParams.from_dict({"guided_json": PERSON, "temperature": 0, "max_tokens": 60})
    got = tight.generate(prompts, params)
    assert tight.stats.num_preemptions_total > 0, "the test needs preemptions to mean anything"
    want = engine.generate(prompts, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    for r in got:
        jsonschema.validate(json.loads(r.text), PERSON)


def test_grammar_state_is_replayed_when_it_falls_behind(engine):
    """The replay path itself: drop a running request's grammar progress and let the next step
    rebuild it from the request's output tokens."""
    engine.add_request("replay", chat(engine, "Describe a person as JSON."),
                       SamplingParams.from_dict({"guided_json": PERSON, "temperature": 0, "max_tokens": 60}))
    outputs = []
    for _ in range(8):
        outputs += engine.step()
    (sample,) = [r for r in engine.scheduler.samples.values() if r.request_id == "replay"]
    state = engine.structured_output._states[sample.seq_id]
    state.matcher.reset()
    state.num_accepted = 0
    while engine.has_unfinished_requests():
        outputs += engine.step()
    text = "".join(o.text for o in outputs if o.request_id == "replay")
    jsonschema.validate(json.loads(text), PERSON)


def test_prefix_cache_hits_and_aborts_leave_no_grammar_state(engine):
    prompt = chat(engine, "Describe a person as JSON. " * 8)
    params = SamplingParams.from_dict({"guided_json": PERSON, "temperature": 0, "max_tokens": 40})
    (first,) = engine.generate([prompt], params)
    hits = engine.stats.prefix_cache_hits_total
    (second,) = engine.generate([prompt], params)
    assert engine.stats.prefix_cache_hits_total > hits and second.token_ids == first.token_ids
    engine.add_request("gone", prompt, params)
    engine.step()
    engine.abort_request("gone")
    while engine.has_unfinished_requests():
        engine.step()
    engine.generate([prompt], SamplingParams(max_tokens=2))  # one more step drops finished states
    assert not engine.structured_output._states


@pytest.mark.parametrize("params, field", [
    ({"guided_json": {"type": "strin"}}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ({"structured_outputs": {"json": {"type": "string", "minLength": 5, "maxLength": 2}}}, "structured_outputs.json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
])
def test_invalid_constraints_are_rejected_naming_the_field(engine, params, field):
    with pytest.raises(InvalidRequest) as err:
        engine.add_request(None, "hi", SamplingParams.from_dict(params))
    assert err.value.param == field and field in str(err.value)
    assert not engine.has_unfinished_requests()


def test_a_slow_compile_holds_back_only_its_own_request(engine):
    """Compilation runs on the compiler's worker threads, awaited before the engine thread sees the
    request: while one schema is still compiling (held here by an event, as a huge schema would
    be), an unconstrained request is served to the end. Equal constraints share one compile."""
    compiler = engine.structured_output.compiler
    release, started = threading.Event(), threading.Event()
    real_compile = compiler._compile

    def slow_compile(params):
        started.set()
        release.wait(120)
        return real_compile(params)

    schema = {**PERSON, "title": "compiled slowly"}  # not in the compiler's cache yet
    constrained = SamplingParams.from_dict({"guided_json": schema, "temperature": 0, "max_tokens": 60})
    compiler._compile = slow_compile
    async_engine = AsyncLLMEngine(engine=engine)

    async def collect(request_id, prompt, params):
        return "".join([out.text async for out in async_engine.generate(request_id, prompt, params)])

    async def main():
        slow = asyncio.create_task(collect("slow", chat(engine, "Describe a person as JSON."), constrained))
        await asyncio.to_thread(started.wait, 60)
        free = await collect("free", chat(engine, "Name a planet."), SamplingParams(temperature=0, max_tokens=16))
        assert not slow.done(), "the unconstrained request waited for the slow compile"
        assert compiler.submit(constrained.structured_output) is compiler.submit(constrained.structured_output)
        release.set()
        return free, await slow

    try:
        free, text = asyncio.run(main())
    finally:
        release.set()
        compiler._compile = real_compile
        async_engine.shutdown()
    (want,) = engine.generate([chat(engine, "Name a planet.")], SamplingParams(temperature=0, max_tokens=16))
    assert free == want.text
    jsonschema.validate(json.loads(text), schema)
