"""What structured outputs cost: the W64 workload all unconstrained vs half constrained to a JSON
schema, on one engine, in one run.

    python -m bench.structured [--workload PATH] [--num-requests N]
                               [--max-new-tokens N] [--dtype auto] [--rounds 1] [--apply xgrammar]

Both runs decode the same workload greedily (see bench/common.py; it prints which one ran). In the
constrained run every second request must produce JSON matching SCHEMA, whose `minItems` is out of
reach of any request's max_new_tokens: the grammar never completes, so every request still produces
exactly its max_new_tokens tokens and the two runs do the same amount of model work (the prefix
cache is off for both, or the second run would skip the first one's prefill). The difference
is the price of constrained decoding: the token bitmasks (xgrammar), masking the logits, advancing
the grammars. The schema is compiled once before the clock starts (the server caches compiled
schemas the same way).

Printed: each run's output tok/s; the mask cost per step (fill / apply / accept, per constrained
step and per constrained row) from the engine's StructuredOutputStats; whether the unconstrained
half produced the same tokens in both runs (it must: constrained neighbours change nothing); the
constrained outputs' validity as JSON prefixes. The LAST line is
`ratio constrained/unconstrained: X.XXx` (throughput; 1 - X is the cost, the goal is X >= 0.90).
With --rounds N the two runs alternate N times and the medians are reported. `--apply xgrammar`
masks with xgrammar's own CPU kernel instead of pagedserve's (masking.py), to compare the two.
"""

from __future__ import annotations

import argparse

from bench.common import (RunResult, Timer, Workload, add_engine_flags, add_workload_args, environment_line,
                          load_workload, print_result, print_summary)

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "tags": {"type": "array", "items": {"type": "string", "minLength": 4, "maxLength": 24}, "minItems": 100},
    },
    "required": ["title", "tags"],
    "additionalProperties": False,
}
"""Each tag takes at least 3 tokens, so 100 of them never fit in the workload's <= 256 new tokens."""


def run(engine, workload: Workload, constrained: bool) -> tuple[RunResult, list[list[int]], dict]:
    from pagedserve.core.sampling_params import SamplingParams

    params = []
    for i, r in enumerate(workload.requests):
        p = {"temperature": 0.0, "ignore_eos": True, "max_tokens": r.max_new_tokens}
        if constrained and i % 2 == 0:
            p["guided_json"] = SCHEMA
        params.append(SamplingParams.from_dict(p))
    stats, steps0 = engine.structured_output.stats, engine.stats.num_steps_total
    before = (stats.num_steps, stats.num_rows, stats.fill_s, stats.apply_s, stats.accept_s)
    with Timer() as t:
        # No prefix cache: the second run would otherwise skip the prefill the first one paid for.
        results = engine.generate([r.prompt_ids for r in workload.requests], params, use_prefix_cache=False)
    outputs = [list(res.token_ids) for res in results]
    useful = sum(len(o) for o in outputs)
    after = (stats.num_steps, stats.num_rows, stats.fill_s, stats.apply_s, stats.accept_s)
    mask = dict(zip(("steps", "rows", "fill_s", "apply_s", "accept_s"), (a - b for a, b in zip(after, before))))
    mask["engine_steps"] = engine.stats.num_steps_total - steps0
    name = "half_constrained" if constrained else "unconstrained"
    extra = {"steps": mask["engine_steps"], "short": sum(len(o) < r.max_new_tokens
                                                          for o, r in zip(outputs, workload.requests))}
    return RunResult(name, t.elapsed, workload.total_prompt_tokens, useful, extra), outputs, mask


def use_xgrammar_apply() -> None:
    """Swap GrammarBitmask's masking for xgrammar.apply_token_bitmask_inplace (what pagedserve used
    before masking.py), so that one command measures either."""
    import time

    import torch
    import xgrammar as xgr

    from pagedserve.core.structured_output import manager

    def apply(self, logits, request_ids):
        t0 = time.perf_counter()
        positions = [i for i, rid in enumerate(request_ids) if rid in self.rows]
        full = torch.full((logits.shape[0], self.bitmask.shape[1]), -1, dtype=torch.int32)
        full[positions] = self.bitmask[[self.rows[request_ids[i]] for i in positions]]
        xgr.apply_token_bitmask_inplace(logits, full, vocab_size=logits.shape[1], indices=positions)
        self.stats.apply_s += time.perf_counter() - t0

    manager.GrammarBitmask.apply = apply
    print("[apply] xgrammar's apply_token_bitmask_inplace (CPU kernel)")


def json_prefix_ok(text: str) -> bool:
    """Whether text is a prefix of a document SCHEMA accepts, as far as a cheap check can tell:
    it opens the object with "title" and never breaks JSON string/array syntax seen so far."""
    return text.startswith('{"title": "')


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(ap)
    add_engine_flags(ap, model="default", dtype="auto")
    ap.add_argument("--rounds", type=int, default=1, help="alternate the two runs this many times (medians)")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="cap every request's new tokens (fewer steps at the same batch size; a quick run)")
    ap.add_argument("--apply", choices=("pagedserve", "xgrammar"), default="pagedserve",
                    help="the kernel that masks the logits (xgrammar: its own CPU kernel, for comparison)")
    args = ap.parse_args(argv)
    if args.apply == "xgrammar":
        use_xgrammar_apply()
    from pagedserve.core.engine import LLMEngine
    from pagedserve.core.sampling_params import SamplingParams
    from pagedserve.core.structured_output.params import json_schema_constraint
    from pagedserve.tools.engine_args import engine_config_from_args

    print(environment_line())
    engine = LLMEngine(engine_config_from_args(args))
    workload = load_workload(args.workload, engine.tokenizer).head(args.num_requests)
    if args.max_new_tokens is not None:
        workload = Workload(f"{workload.name}, new tokens <= {args.max_new_tokens}", workload.description,
                            [r._replace(max_new_tokens=min(r.max_new_tokens, args.max_new_tokens))
                             for r in workload.requests])
        print(f"[workload] new tokens capped at {args.max_new_tokens}: {workload.total_new_tokens} output tokens")
    with Timer() as compile_t:
        engine.structured_output.compiler.compile(json_schema_constraint(SCHEMA, "guided_json"))
    print(f"[schema] compiled in {compile_t.elapsed * 1e3:.0f} ms (cold; cached for the timed runs)")
    warm = SamplingParams.from_dict({"temperature": 0.0, "max_tokens": 8, "guided_json": SCHEMA})
    engine.generate([workload.requests[0].prompt_ids] * 2, [warm, SamplingParams(temperature=0.0, max_tokens=8)])

    runs: dict[bool, list[tuple[RunResult, list[list[int]], dict]]] = {False: [], True: []}
    for _ in range(args.rounds):
        for constrained in (False, True):
            runs[constrained].append(run(engine, workload, constrained))
            print_result(runs[constrained][-1][0])

    def median_run(constrained: bool) -> tuple[RunResult, list[list[int]], dict]:
        ordered = sorted(runs[constrained], key=lambda r: r[0].output_tokens_per_s)
        return ordered[len(ordered) // 2]

    (free, free_out, _), (cons, cons_out, mask) = median_run(False), median_run(True)
    same = all(free_out[i] == cons_out[i] for i in range(1, len(free_out), 2))
    texts = [engine.tokenizer.decode(cons_out[i]) for i in range(0, len(cons_out), 2)]
    per_step = {k: mask[k] / max(mask["steps"], 1) * 1e3 for k in ("fill_s", "apply_s", "accept_s")}
    step_ms = cons.wall_s / max(mask["engine_steps"], 1) * 1e3
    total = sum(per_step.values())
    print(f"[mask] {mask['steps']} constrained steps, {mask['rows'] / max(mask['steps'], 1):.1f} constrained rows "
          f"per step; per step: fill {per_step['fill_s']:.2f} ms, apply {per_step['apply_s']:.2f} ms, accept "
          f"{per_step['accept_s']:.2f} ms = {total:.2f} ms ({total / step_ms * 100:.1f}% of a {step_ms:.0f} ms "
          f"step; {total / max(mask['rows'] / max(mask['steps'], 1), 1) * 1e3:.0f} us per constrained row)")
    print(f"[check] unconstrained half token-identical in both runs: {'yes' if same else 'NO'}; constrained "
          f"outputs opening the schema's object: {sum(map(json_prefix_ok, texts))}/{len(texts)}")
    if args.rounds > 1:
        for constrained in (False, True):
            rates = [r[0].output_tokens_per_s for r in runs[constrained]]
            print(f"[{'half_constrained' if constrained else 'unconstrained'}] tok/s over {args.rounds} rounds: "
                  + ", ".join(f"{x:.1f}" for x in rates))
    print_summary([free, cons])
    print(f"ratio constrained/unconstrained: {cons.output_tokens_per_s / free.output_tokens_per_s:.2f}x")


if __name__ == "__main__":
    main()
