"""Offline throughput: pagedserve continuous batching vs Hugging Face transformers static batching.

    python -m bench.throughput [--workload PATH] [--num-requests N] [--skip-peer]
                               [--dtype auto] [--max-num-batched-tokens N] [--max-num-seqs N]
                               [--noisy-neighbour N]

What is compared. One workload (see bench/common.py; it prints which one ran) is decoded greedily
with EOS ignored, so every request produces exactly its `max_new_tokens`:

* pagedserve: all requests submitted at once to `LLMEngine.generate` at the engine's default
  settings (dtype "auto": fp32 on AVX2-only CPUs, bf16 on GPU / AMX); the scheduler does the rest.
* transformers_static (the peer): `AutoModelForCausalLM.generate` in fp32 on the same converted
  model directory, on left-padded batches of 32 in arrival order. Each batch runs until its longest
  request, the way a static-batching server works; only each request's own `max_new_tokens` count.

Both sides load the model before the clock starts and run a short warm-up request first.

How to read the output. `output tok/s` = useful output tokens / wall time of the timed run: the
throughput a serving user sees. Prompt tokens are listed because the prefill work differs per
workload. The agreement line compares each request's greedy tokens between the two systems (first
16 tokens; plus exact full-length matches when both ran fp32); it is a sanity check, never a
failure, since fp32 reductions in a different order may flip a near-tie later in a long output.
The LAST line is always `ratio pagedserve/transformers_static: X.XXx` (or says the peer was skipped).

On a shared CPU (`--noisy-neighbour N`): after the quiet run the same engine runs the workload again
while N busy processes spin on the last N CPUs (bench/neighbours.py); the peer is then this quiet
run, not transformers, and the LAST line is `ratio noisy/quiet (N busy CPUs): X.XXx`. The engine's
compute-thread count before and after is printed (core/cpu_threads.py adjusts it to the cores left).
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

import torch

from bench.common import (RunResult, Timer, Workload, add_engine_flags, add_workload_args, environment_line,
                          load_workload, print_result, print_summary, ratio_line)
from bench.neighbours import add_neighbour_arg, busy_neighbours

PEER_BATCH_SIZE = 32
AGREEMENT_PREFIX = 16
WARMUP_TEXT = "The quick brown fox jumps over the lazy dog. A warm-up request before the clock starts."


def run_pagedserve(engine, workload: Workload) -> tuple[RunResult, list[list[int]]]:
    from pagedserve.core.sampling_params import SamplingParams

    warm_ids = engine.tokenizer(WARMUP_TEXT, add_special_tokens=False)["input_ids"]
    engine.generate([warm_ids], [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)])
    before = engine.stats
    base = (before.num_steps_total, before.num_preemptions_total, before.num_computed_prompt_tokens_total)
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_new_tokens, ignore_eos=True)
              for r in workload.requests]
    with Timer() as t:
        results = engine.generate([r.prompt_ids for r in workload.requests], params)
    outputs = [list(res.token_ids) for res in results]
    short = sum(len(o) < r.max_new_tokens for o, r in zip(outputs, workload.requests))
    if short:
        print(f"[pagedserve] WARNING: {short} requests produced fewer than max_new_tokens tokens")
    useful = sum(min(len(o), r.max_new_tokens) for o, r in zip(outputs, workload.requests))
    st = engine.stats
    extra = {
        "dtype": str(engine.dtype).removeprefix("torch."),
        "steps": st.num_steps_total - base[0],
        "preemptions": st.num_preemptions_total - base[1],
        "prompt_tokens_computed": st.num_computed_prompt_tokens_total - base[2],
    }
    return RunResult("pagedserve", t.elapsed, workload.total_prompt_tokens, useful, extra), outputs


def _left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


def run_transformers_static(model_path: Path, tokenizer, workload: Workload,
                            batch_size: int = PEER_BATCH_SIZE) -> tuple[RunResult, list[list[int]]]:
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, local_files_only=True).eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def gen(prompts: list[list[int]], n: int) -> list[list[int]]:
        ids, mask = _left_pad(prompts, pad_id)
        # eos_token_id=None: EOS may be sampled but never stops a row (pagedserve's ignore_eos);
        # min_new_tokens pins the length should a default EOS sneak back in.
        cfg = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None,
                               pad_token_id=pad_id, bos_token_id=tokenizer.bos_token_id)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        return out[:, ids.shape[1]:].tolist()

    gen([tokenizer(WARMUP_TEXT, add_special_tokens=False)["input_ids"]], 8)
    outputs: list[list[int]] = []
    generated = 0
    reqs = workload.requests
    with Timer() as t:
        for start in range(0, len(reqs), batch_size):
            batch = reqs[start:start + batch_size]
            n = max(r.max_new_tokens for r in batch)
            rows = gen([r.prompt_ids for r in batch], n)
            generated += len(batch) * n
            outputs += [row[:r.max_new_tokens] for row, r in zip(rows, batch)]
    del model
    gc.collect()
    useful = workload.total_new_tokens
    extra = {"dtype": "float32", "batch_size": batch_size,
             "padding_waste": f"{100 * (generated - useful) / generated:.0f}% of {generated} generated"}
    return RunResult("transformers_static", t.elapsed, workload.total_prompt_tokens, useful, extra), outputs


def print_agreement(ours: list[list[int]], peer: list[list[int]], both_fp32: bool) -> None:
    k = AGREEMENT_PREFIX
    prefix = sum(a[:k] == b[:k] for a, b in zip(ours, peer))
    line = f"[agreement] first {k} greedy tokens equal in {prefix}/{len(ours)} requests"
    if both_fp32:
        full = sum(a == b for a, b in zip(ours, peer))
        first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(ours, peer)]
        diverged = sorted(d for d in first_diff if d is not None)
        line += f"; all tokens equal in {full}/{len(ours)} (both fp32)"
        if diverged:
            line += f"; first divergence at output positions {diverged[:8]}{' ...' if len(diverged) > 8 else ''}"
    print(line)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(ap)
    ap.add_argument("--skip-peer", action="store_true", help="run pagedserve only")
    add_engine_flags(ap, model="default", dtype="auto")
    ap.add_argument("--peer-batch-size", type=int, default=PEER_BATCH_SIZE)
    add_neighbour_arg(ap)
    return ap.parse_args(argv)


def run_noisy(engine, workload: Workload, quiet: RunResult, count: int) -> None:
    """The same workload again beside `count` busy neighbours; the ratio to the quiet run last."""
    before = engine.threads.threads
    engine.kv_cache_manager.reset_prefix_cache()  # the same prompts again: recompute them, as the quiet run did
    with busy_neighbours(count) as cpus:
        noisy, _ = run_pagedserve(engine, workload)
    noisy = RunResult(f"pagedserve+{count} busy", noisy.wall_s, noisy.prompt_tokens, noisy.output_tokens, noisy.extra)
    print_result(noisy)
    print(f"[threads] busy neighbours on CPUs {cpus}; compute threads {before} before, {engine.threads.threads} "
          f"after ({engine.threads.changes} changes in all)")
    print_summary([quiet, noisy])
    print(f"ratio noisy/quiet ({count} busy CPUs): {noisy.output_tokens_per_s / quiet.output_tokens_per_s:.2f}x")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from pagedserve.core.engine import LLMEngine
    from pagedserve.tools.engine_args import engine_config_from_args

    print(environment_line())
    with Timer() as load:
        engine = LLMEngine(engine_config_from_args(args))
    sc = engine.config.scheduler
    print(f"[pagedserve] loaded {engine.model_path} in {load.elapsed:.1f}s: dtype {engine.dtype}, "
          f"{engine.num_kv_blocks} KV blocks x {engine.config.cache.block_size}, max_num_seqs {sc.max_num_seqs}, "
          f"max_num_batched_tokens {sc.max_num_batched_tokens}")
    workload = load_workload(args.workload, engine.tokenizer).head(args.num_requests)
    if args.num_requests is not None:
        print(f"[workload] using {workload.summary()}")

    ours, our_tokens = run_pagedserve(engine, workload)
    print_result(ours)
    if args.noisy_neighbour:
        run_noisy(engine, workload, ours, args.noisy_neighbour)
        return
    model_path, tokenizer, both_fp32 = engine.model_path, engine.tokenizer, engine.dtype == torch.float32
    del engine
    gc.collect()
    if args.skip_peer:
        print("ratio pagedserve/transformers_static: skipped (--skip-peer)")
        return

    peer, peer_tokens = run_transformers_static(model_path, tokenizer, workload, args.peer_batch_size)
    print_result(peer)
    print_agreement(our_tokens, peer_tokens, both_fp32)
    print_summary([ours, peer])
    print(ratio_line(ours, peer))


if __name__ == "__main__":
    main()
