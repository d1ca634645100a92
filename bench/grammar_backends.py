"""Pick the grammar library by measurement: xgrammar vs llguidance on the default model's tokenizer.

For each library, in one run: the one-off tokenizer preparation, the compile time of a typical
JSON schema (cold: no cache), and the per-step cost of constrained decoding at batch 64:
filling 64 token bitmasks, applying them to fp32 logits [64, vocab] (pagedserve's vectorized apply,
core/structured_output/masking.py, for both; each library's own CPU apply kernel is timed too and
printed last), and advancing 64 grammar states by one token. The 64 states walk 64 different valid
documents (token by token, as a model would produce them), so no two rows share a state.

    python -m bench.grammar_backends [--batch 64] [--steps 40] [--threads 1]

Prints one line per library and a last line with the ratio (llguidance / xgrammar per-step cost).
xgrammar is a pagedserve dependency; llguidance is not (`pip install llguidance` to compare).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pagedserve.core.structured_output.masking import apply_bitmask_rows

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9]+\\.[a-z]{2,4}$"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "role", "tags", "address", "active"],
    "additionalProperties": False,
}
"""A typical extraction schema (what json_schema response formats look like in practice)."""
_LLG_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""Both libraries produce the same layout: `{"a": 1, "b": [2, 3]}` (xgrammar's any_whitespace=False)."""


def documents(n: int) -> list[str]:
    """n different documents valid under SCHEMA, serialised as the grammars expect them."""
    names = ["Ada Lovelace", "Alan Turing", "Grace Hopper", "Edsger Dijkstra", "Barbara Liskov"]
    out = []
    for i in range(n):
        doc = {"name": f"{names[i % len(names)]} {i}", "age": 20 + i % 70, "email": f"user{i}@example.com",
               "role": ["admin", "editor", "viewer"][i % 3], "tags": [f"t{j}" for j in range(i % 4)],
               "address": {"city": f"City {i}", "zip": f"{10000 + i:05d}"}, "active": i % 2 == 0}
        out.append(json.dumps(doc, separators=(", ", ": ")))
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_xgrammar(tokenizer, vocab_size: int, docs: list[list[int]], steps: int, threads: int) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    prep = time.perf_counter() - t0
    compile_s = []
    for _ in range(3):  # cold each time: a fresh compiler has an empty cache
        compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        compile_s.append(_timed(lambda: compiler.compile_json_schema(SCHEMA, any_whitespace=False, separators=(", ", ": "))))
    compiled = compiler.compile_json_schema(SCHEMA, any_whitespace=False, separators=(", ", ": "))
    matchers = [xgr.GrammarMatcher(compiled) for _ in docs]
    bitmask = xgr.allocate_token_bitmask(len(docs), vocab_size)
    batch = xgr.BatchGrammarMatcher(max_threads=threads)
    logits = torch.randn(len(docs), vocab_size)
    rows = list(range(len(docs)))
    fill, apply, apply_own, accept = [], [], [], []
    for step in range(steps):
        fill.append(_timed(lambda: batch.batch_fill_next_token_bitmask(matchers, bitmask)))
        apply.append(_timed(lambda: apply_bitmask_rows(logits, rows, bitmask)))
        apply_own.append(_timed(lambda: xgr.apply_token_bitmask_inplace(logits, bitmask)))
        tokens = [d[step] for d in docs]
        accept.append(_timed(lambda: [m.accept_token(t) for m, t in zip(matchers, tokens)]))
        assert all(not m.is_terminated() for m in matchers)
    return {"prepare_tokenizer_s": prep, "compile_s": statistics.median(compile_s), "fill_s": fill,
            "apply_s": apply, "accept_s": accept, "library_apply_s": apply_own}


def bench_llguidance(tokenizer, vocab_size: int, docs: list[list[int]], steps: int, threads: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lltorch

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    prep = time.perf_counter() - t0
    compile_s = []
    for _ in range(3):  # llguidance compiles lazily: the grammar text plus the first mask
        def build():
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                SCHEMA, defaults=_LLG_OPTIONS)
            m = llguidance.LLMatcher(lltok, grammar)
            mask = lltorch.allocate_token_bitmask(1, vocab_size)
            lltorch.fill_next_token_bitmask(m, mask)
            assert not m.is_error(), m.get_error()
        compile_s.append(_timed(build))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=_LLG_OPTIONS)
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in docs]
    executor = llguidance.LLExecutor(num_threads=threads)
    bitmask = lltorch.allocate_token_bitmask(len(docs), vocab_size)
    logits = torch.randn(len(docs), vocab_size)
    rows = list(range(len(docs)))
    fill, apply, apply_own, accept = [], [], [], []
    for step in range(steps):
        fill.append(_timed(lambda: lltorch.fill_next_token_bitmask_par(
            executor, [(m, i) for i, m in enumerate(matchers)], bitmask)))
        apply.append(_timed(lambda: apply_bitmask_rows(logits, rows, bitmask)))
        apply_own.append(_timed(lambda: lltorch.apply_token_bitmask_inplace(logits, bitmask)))
        tokens = [d[step] for d in docs]
        accept.append(_timed(lambda: [m.consume_token(t) for m, t in zip(matchers, tokens)]))
        assert all(not m.is_error() for m in matchers), matchers[0].get_error()
    return {"prepare_tokenizer_s": prep, "compile_s": statistics.median(compile_s), "fill_s": fill,
            "apply_s": apply, "accept_s": accept, "library_apply_s": apply_own}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40, help="decode steps timed (each document is longer)")
    ap.add_argument("--threads", type=int, default=1, help="mask-filling threads for both libraries")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoConfig, AutoTokenizer

    from pagedserve.core.models.default_model import resolve_model_path

    path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    vocab_size = AutoConfig.from_pretrained(path, local_files_only=True).vocab_size
    docs = [tokenizer.encode(d, add_special_tokens=False) for d in documents(args.batch)]
    steps = min(args.steps, min(map(len, docs)) - 1)
    print(f"model {path.name}, vocab {vocab_size}, batch {args.batch}, {steps} steps, {args.threads} thread(s)")
    per_step = {}
    for name, fn in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
        try:
            r = fn(tokenizer, vocab_size, docs, steps, args.threads)
        except ImportError:
            print(f"{name:10s} not installed (pip install {name}); skipped")
            continue
        med = {k: statistics.median(r[k]) * 1e3 for k in ("fill_s", "apply_s", "accept_s")}
        per_step[name] = sum(med.values())
        print(f"{name:10s} tokenizer prep {r['prepare_tokenizer_s'] * 1e3:8.1f} ms | schema compile "
              f"{r['compile_s'] * 1e3:7.1f} ms | per step at batch {args.batch}: fill {med['fill_s']:6.2f} ms, "
              f"apply {med['apply_s']:5.2f} ms, accept {med['accept_s']:5.2f} ms = {per_step[name]:6.2f} ms "
              f"({per_step[name] / args.batch * 1e3:5.1f} us/row); the library's own apply "
              f"{statistics.median(r['library_apply_s']) * 1e3:5.2f} ms")
    if len(per_step) == 2:
        print(f"per-step cost llguidance / xgrammar: {per_step['llguidance'] / per_step['xgrammar']:.2f}x")


if __name__ == "__main__":
    main()
