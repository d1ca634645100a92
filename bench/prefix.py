"""Prefix caching: many requests sharing one long system prompt, with caching on vs off.

    python -m bench.prefix [--num-requests 64] [--prefix-len 512] [--suffix-len 32] [--output-len 32]
                           [--model default] [--dtype auto] [--block-size 16]
                           [--max-num-batched-tokens 1024] [--max-num-seqs 128]

Workload. One shared prompt of `--prefix-len` tokens of real English text (the Apache-2.0 license
text in tests/data/license-texts), tokenized with the engine's own
tokenizer; each request appends a unique `--suffix-len`-token suffix ("Question i:" + a different
slice of the text) and decodes `--output-len` tokens greedily with EOS ignored.

What is compared. The same engine settings, in the same process, once with enable_prefix_caching
on and once off (the peer). Each engine loads the model and runs a short unrelated warm-up request
before the clock starts. All requests are added at once, then the engine is stepped until done.

Printed per run: output tok/s (output tokens / wall time), mean and p50 time to first token (wall
time from adding the requests to each request's first output token), prompt tokens actually run
through the model (`num_computed_prompt_tokens_total`; prefix hits excluded), prefix-cache hit rate
and preemptions. Then the ratios, the targets (>= 3x throughput, >= 80% fewer prompt tokens
computed), and an agreement check of the greedy tokens between the two runs (a sanity check: a
different batch mix may flip a near-tie in reduced precision). The LAST line is
`ratio prefix_on/prefix_off: X.XXx` (output tok/s).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
from bench.common import LICENSE_DIR, RunResult, add_engine_flags, environment_line, print_summary, ratio_line

APACHE = LICENSE_DIR / "Apache-2.0"
WARMUP_TEXT = "The quick brown fox jumps over the lazy dog. A warm-up request before the clock starts."
TARGET_SPEEDUP = 3.0
TARGET_SAVED = 0.80


def text_tokens(tokenizer, min_len: int) -> tuple[list[int], str]:
    text, label = " ".join(APACHE.read_text(encoding="utf-8").split()), str(APACHE.relative_to(ROOT))
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    base = list(ids)
    while len(ids) < min_len:  # short text: repeat it
        ids += base
    return ids, label


def build_prompts(tokenizer, num_requests: int, prefix_len: int, suffix_len: int) -> tuple[list[list[int]], str]:
    stream, label = text_tokens(tokenizer, prefix_len + 4 * suffix_len + 64)
    prefix = stream[:prefix_len]
    body = stream[prefix_len:]
    prompts = []
    for i in range(num_requests):
        # a numbered question makes every suffix unique; a different slice of text fills it up
        tag = list(tokenizer(f"\n\nQuestion {i}:", add_special_tokens=False)["input_ids"])
        off = (i * 7 * max(suffix_len, 1)) % max(len(body) - suffix_len, 1)
        prompts.append(prefix + (tag + body[off:off + suffix_len])[:suffix_len])
    return prompts, label


def run(caching: bool, args, prompts: list[list[int]]) -> tuple[RunResult, dict[str, list[int]]]:
    from pagedserve.core.engine import LLMEngine
    from pagedserve.core.sampling_params import SamplingParams
    from pagedserve.tools.engine_args import engine_config_from_args

    engine = LLMEngine(engine_config_from_args(args).replace(enable_prefix_caching=caching))
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    warm = list(engine.tokenizer(WARMUP_TEXT, add_special_tokens=False)["input_ids"])
    engine.add_request("warmup", warm, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    s = engine.stats
    base = (s.num_computed_prompt_tokens_total, s.prefix_cache_queries_total, s.prefix_cache_hits_total,
            s.num_preemptions_total, s.num_steps_total, s.num_evicted_blocks_total)

    tokens: dict[str, list[int]] = {}
    first_token_at: dict[str, float] = {}
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
        tokens[f"r{i}"] = []
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if out.new_token_ids and out.request_id not in first_token_at:
                first_token_at[out.request_id] = now - start
            tokens[out.request_id].extend(out.new_token_ids)
    wall = time.perf_counter() - start

    s = engine.stats
    computed, queries, hits, preempt, steps, evicted = (
        now_ - b for now_, b in zip((s.num_computed_prompt_tokens_total, s.prefix_cache_queries_total,
                                     s.prefix_cache_hits_total, s.num_preemptions_total, s.num_steps_total,
                                     s.num_evicted_blocks_total), base))
    ttft = sorted(first_token_at.values())
    name = "prefix_on" if caching else "prefix_off"
    result = RunResult(name, wall, sum(map(len, prompts)), sum(map(len, tokens.values())), {
        "dtype": str(engine.dtype).removeprefix("torch."),
        "kv_blocks": engine.num_kv_blocks,
        "steps": steps,
        "ttft_mean_s": round(statistics.fmean(ttft), 3),
        "ttft_p50_s": round(statistics.median(ttft), 3),
        "prompt_tokens_computed": computed,
        "prefix_hit_rate": round(hits / queries, 3) if queries else 0.0,
        "evicted_blocks": evicted,
        "preemptions": preempt,
    })
    del engine
    gc.collect()
    return result, tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    add_engine_flags(ap, model="default", dtype="auto", block_size=16, max_num_batched_tokens=1024, max_num_seqs=128)
    args = ap.parse_args(argv)
    for name in ("num_requests", "prefix_len", "output_len"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.suffix_len < 0:
        ap.error("--suffix-len must be at least 0")

    from transformers import AutoTokenizer

    from pagedserve.core.models.default_model import resolve_model_path

    print(environment_line())
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model), local_files_only=True)
    prompts, label = build_prompts(tokenizer, args.num_requests, args.prefix_len, args.suffix_len)
    print(f"[workload] {args.num_requests} requests: a shared {args.prefix_len}-token prefix from {label} "
          f"+ a unique {args.suffix_len}-token suffix each, {args.output_len} output tokens each "
          f"(block_size {args.block_size}, max_num_batched_tokens {args.max_num_batched_tokens})")

    results, outputs = [], []
    for caching in (True, False):
        res, toks = run(caching, args, prompts)
        extra = ", ".join(f"{k}={v}" for k, v in res.extra.items())
        print(f"[{res.system}] wall {res.wall_s:.2f}s, output {res.output_tokens_per_s:.1f} tok/s, {extra}",
              flush=True)
        results.append(res)
        outputs.append(toks)
    on, off = results
    print_summary(results)

    speedup = on.output_tokens_per_s / off.output_tokens_per_s
    ttft_ratio = off.extra["ttft_mean_s"] / on.extra["ttft_mean_s"]
    c_on, c_off = on.extra["prompt_tokens_computed"], off.extra["prompt_tokens_computed"]
    saved = 1 - c_on / c_off if c_off else 0.0
    same = sum(outputs[0][k] == outputs[1][k] for k in outputs[0])
    print(f"[agreement] {same}/{len(outputs[0])} requests produced identical greedy tokens with caching on and off")
    print(f"[ratios] throughput on/off {speedup:.2f}x (target >= {TARGET_SPEEDUP:.0f}x: "
          f"{'met' if speedup >= TARGET_SPEEDUP else 'NOT met'}); mean TTFT off/on {ttft_ratio:.2f}x; "
          f"prompt tokens computed {c_on} vs {c_off}: {saved:.1%} fewer (target >= {TARGET_SAVED:.0%}: "
          f"{'met' if saved >= TARGET_SAVED else 'NOT met'})")
    print(ratio_line(on, off))
    return 0


if __name__ == "__main__":
    sys.exit(main())
