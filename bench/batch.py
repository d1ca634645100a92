"""Offline batch job under KV pressure: the `throughput` scheduling policy against `fcfs`; and
`pagedserve tune`'s chosen setting against the shipped defaults on a latency SLO.

    python -m bench.batch [--num-requests 256] [--num-prefixes 4] [--prefix-len 192] [--suffix-len 16]
                          [--output-lens 4,8,16,32,64] [--num-kv-blocks 60] [--model default]
                          [--dtype float32] [--block-size 16] [--max-num-seqs 128]
                          [--max-num-batched-tokens 1024] [--policies fcfs,throughput] [--threads 1]
    python -m bench.batch --tune --ttft-p95 SECONDS [--arrival-rate 2] [--num-requests 64] [--max-trials 6]

Workload (BatchLLM's setting). `--num-prefixes` long system prompts of `--prefix-len` tokens of
real English text (distinct slices of the Debian license texts, else a built-in text), each request
one of them (round-robin, so requests of different prompts interleave in the file) + a unique
`--suffix-len`-token question + an output length drawn (seeded) from `--output-lens`, decoded
greedily with EOS ignored so every request produces exactly that many tokens.

KV pressure. `--num-kv-blocks` fixes the pool below what the shared prompts plus the working set
need (60 blocks of 16 = 960 tokens; the four prompts alone take 48 blocks): fcfs admits in file
order while blocks are free *now*, so the four prompts take turns evicting each other and are
prefilled again and again, and running requests grow until the newest is preempted (recompute);
throughput keeps to the prompt group that is cached, admits by the blocks requests will need at
max_tokens (no preemption), and starts long decodes first.

Same process, same settings, one engine per policy; each engine loads the model and runs a short
warm-up request before the clock starts; all requests are added at once, then the engine is stepped
until done. Printed per policy: output tok/s, wall, preemptions, prompt tokens actually computed,
prefix hit rate; then whether the greedy tokens are identical across policies (they must be), and
the LAST line `ratio throughput/fcfs: X.XXx` (output tok/s; target >= 1.5x).

With --tune: the same prompts (real token ids, so prefixes are shared) and output lengths arrive as
a seeded Poisson process at --arrival-rate; tools/tuner.py searches from the shipped defaults
(trial 0, with the KV pool at its default size, not --num-kv-blocks) for the best throughput
meeting TTFT p95 <= --ttft-p95, and the table shows both. The LAST line is
`ratio tuned/defaults: X.XXx` (output tok/s), and whether each met the SLO.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time

from bench.common import RunResult, add_engine_flags, environment_line, print_summary, ratio_line, source_text

WARMUP_TEXT = "The quick brown fox jumps over the lazy dog. A warm-up request before the clock starts."
TARGET_RATIO = 1.5


def build_job(tokenizer, args) -> tuple[list[list[int]], list[int], str]:
    text, label = source_text()
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    need = args.num_prefixes * args.prefix_len + args.suffix_len * 8 + 64
    while len(ids) < need:
        ids += ids
    prefixes = [ids[k * args.prefix_len:(k + 1) * args.prefix_len] for k in range(args.num_prefixes)]
    body = ids[args.num_prefixes * args.prefix_len:]
    rng = random.Random(args.seed)
    prompts, output_lens = [], []
    for i in range(args.num_requests):
        tag = list(tokenizer(f"\n\nItem {i}:", add_special_tokens=False)["input_ids"])
        off = rng.randrange(0, max(len(body) - args.suffix_len, 1))
        prompts.append(prefixes[i % args.num_prefixes] + (tag + body[off:off + args.suffix_len])[:args.suffix_len])
        output_lens.append(rng.choice(args.output_lens))
    return prompts, output_lens, label


def run(policy: str, args, prompts, output_lens) -> tuple[RunResult, list[tuple[int, ...]]]:
    from pagedserve.core.engine import LLMEngine
    from pagedserve.core.sampling_params import SamplingParams
    from pagedserve.tools.engine_args import engine_config_from_args

    # an offline job: reordering may delay any request for the whole run (no age bound)
    config = engine_config_from_args(args).replace(num_kv_blocks=args.num_kv_blocks, scheduling_policy=policy,
                                                   scheduling_age_bound_s=86400.0)
    engine = LLMEngine(config)
    warm = list(engine.tokenizer(WARMUP_TEXT, add_special_tokens=False)["input_ids"])
    engine.generate([warm], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    s = engine.stats
    base = (s.num_computed_prompt_tokens_total, s.prefix_cache_queries_total, s.prefix_cache_hits_total,
            s.num_preemptions_total, s.num_steps_total)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    s = engine.stats
    computed, queries, hits, preempt, steps = (
        now - b for now, b in zip((s.num_computed_prompt_tokens_total, s.prefix_cache_queries_total,
                                   s.prefix_cache_hits_total, s.num_preemptions_total, s.num_steps_total), base))
    tokens = [r.token_ids for r in results]
    result = RunResult(policy, wall, sum(map(len, prompts)), sum(map(len, tokens)), {
        "dtype": str(engine.dtype).removeprefix("torch."),
        "kv_blocks": engine.num_kv_blocks,
        "steps": steps,
        "preemptions": preempt,
        "prompt_tokens_computed": computed,
        "prefix_hit_rate": round(hits / queries, 3) if queries else 0.0,
    })
    del engine
    gc.collect()
    return result, tokens


def tune_vs_defaults(args, prompts, output_lens) -> int:
    from pagedserve.core.config import EngineConfig
    from pagedserve.core.workload import WorkloadItem
    from pagedserve.tools.tuner import Slo, best_trial, format_table, tune

    rng = random.Random(args.seed)
    items, t = [], 0.0
    for p, n in zip(prompts, output_lens):
        items.append(WorkloadItem(t, len(p), n, tuple(p)))
        t += rng.expovariate(args.arrival_rate)
    base = EngineConfig.from_dict({"model": args.model, "dtype": args.dtype})  # the shipped defaults, as trial 0
    slo = Slo(args.ttft_p95)
    print(f"[tune] {len(items)} requests at {args.arrival_rate}/s (Poisson) over {items[-1].arrival_time:.1f}s; "
          f"SLO TTFT p95 <= {args.ttft_p95}s; trial 0 = shipped defaults", flush=True)
    _, trials = tune(base, items, slo, args.max_trials, progress=True)
    best = best_trial(trials)
    print(format_table(trials, best))
    defaults = trials[0]
    print(f"[defaults] {defaults.label()}: {defaults.result.output_tokens_per_s:.1f} tok/s, TTFT p95 "
          f"{defaults.result.ttft_p95_s:.3f}s, SLO {'met' if defaults.meets_slo else 'missed'}")
    if best is None:
        print("[tuned] no setting tried met the SLO")
        return 1
    print(f"[tuned] {best.label()}: {best.result.output_tokens_per_s:.1f} tok/s, TTFT p95 "
          f"{best.result.ttft_p95_s:.3f}s, SLO met")
    print(f"ratio tuned/defaults: {best.result.output_tokens_per_s / defaults.result.output_tokens_per_s:.2f}x")
    return 0


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--num-prefixes", type=int, default=4)
    ap.add_argument("--prefix-len", type=int, default=192)
    ap.add_argument("--suffix-len", type=int, default=16)
    ap.add_argument("--output-lens", default="4,8,16,32,64",
                    help="comma-separated output lengths, one drawn per request")
    ap.add_argument("--num-kv-blocks", type=int, default=60)
    # float32 by default: identical greedy tokens across batch mixes need it
    add_engine_flags(ap, model="default", dtype="float32", block_size=16, max_num_seqs=128, max_num_batched_tokens=1024)
    ap.add_argument("--policies", default="fcfs,throughput",
                    help="run in this order; the peer is fcfs (else the first), ours throughput (else the last)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (as the other CPU benches)")
    ap.add_argument("--tune", action="store_true", help="tuned vs shipped defaults on an SLO instead")
    ap.add_argument("--ttft-p95", type=float, default=None, help="--tune: the TTFT p95 limit, seconds")
    ap.add_argument("--arrival-rate", type=float, default=2.0, help="--tune: requests/s (Poisson, seeded)")
    ap.add_argument("--max-trials", type=int, default=6, help="--tune: settings to try at most")
    args = ap.parse_args(argv)
    try:
        args.output_lens = [int(x) for x in args.output_lens.split(",")]
    except ValueError:
        ap.error("--output-lens must be comma-separated integers, e.g. 8,16,32")
    args.policies = args.policies.split(",")
    if args.tune and (args.ttft_p95 is None or args.ttft_p95 <= 0):
        ap.error("--tune needs --ttft-p95 SECONDS > 0")
    if min(args.output_lens) < 1 or args.num_requests < 1 or args.num_prefixes < 1:
        ap.error("--num-requests, --num-prefixes and every output length must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from pagedserve.core.models.default_model import resolve_model_path

    print(environment_line())
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model), local_files_only=True)
    prompts, output_lens, label = build_job(tokenizer, args)
    print(f"[workload] {args.num_requests} requests over {args.num_prefixes} shared {args.prefix_len}-token "
          f"prompts from {label} + a {args.suffix_len}-token suffix each, output lengths {args.output_lens} "
          f"({sum(output_lens)} output tokens); {args.num_kv_blocks} KV blocks of {args.block_size} tokens, "
          f"max_num_seqs {args.max_num_seqs}, max_num_batched_tokens {args.max_num_batched_tokens}", flush=True)

    if args.tune:
        return tune_vs_defaults(args, prompts, output_lens)
    results, outputs = [], []
    for policy in args.policies:
        res, toks = run(policy, args, prompts, output_lens)
        extra = ", ".join(f"{k}={v}" for k, v in res.extra.items())
        print(f"[{policy}] wall {res.wall_s:.2f}s, output {res.output_tokens_per_s:.1f} tok/s, {extra}", flush=True)
        results.append(res)
        outputs.append(toks)
    print_summary(results)
    # the peer is fcfs and ours is throughput wherever they sit in the run order (run them in
    # either order to see how much the machine's load drifted between runs)
    names = [r.system for r in results]
    i_peer = names.index("fcfs") if "fcfs" in names else 0
    i_ours = names.index("throughput") if "throughput" in names else len(names) - 1
    for policy, toks in zip(args.policies, outputs):
        if policy == names[i_peer]:
            continue
        same = sum(a == b for a, b in zip(toks, outputs[i_peer]))
        print(f"[agreement] {policy} vs {names[i_peer]}: {same}/{len(toks)} requests with identical greedy "
              f"tokens{'' if same == len(toks) else '  <-- NOT identical'}")
    peer, ours = results[i_peer], results[i_ours]
    ratio = ours.output_tokens_per_s / peer.output_tokens_per_s
    print(f"[target] {ours.system}/{peer.system} {ratio:.2f}x (target >= {TARGET_RATIO}x: "
          f"{'met' if ratio >= TARGET_RATIO else 'NOT met'})")
    print(ratio_line(ours, peer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
