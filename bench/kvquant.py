"""KV-cache quantization: concurrency and throughput of bf16 vs int8 KV caches in one memory budget.

    python -m bench.kvquant [--workload PATH] [--num-requests N] [--concurrency 16]
                            [--kv-dtypes bf16,int8] [--dtype float32] [--block-size 16]
    python -m bench.kvquant --decode-microbench      (CUDA only: Triton decode attention GB/s)

What is compared. One workload (bench/common.py; the 64-request throughput workload by default,
decoded greedily with EOS ignored) runs once per KV cache dtype, in this process, each time on a
fresh engine with the SAME `kv_cache_memory`. The budget is sized so that bf16 admits only about
`--concurrency` requests at once: concurrency x the mean blocks a request holds at full length x
the bytes of one bf16 block. An int8 block costs 64 + 2 (bf16 scale) bytes per token and head instead
of 128 at head_dim 64, so the same bytes hold 1.94x the tokens, and the scheduler keeps more
requests running (fewer waits and preemptions).

Output: per KV dtype the pool (blocks, tokens), the most requests running in one step (requests
that held KV blocks during that step), preemptions, wall time and output tok/s. The last lines are
the int8/bf16 ratios of concurrency (target >= 1.9x) and of throughput, then the greedy agreement
of each dtype with the first (first 16 tokens per request; a sanity check, never a failure).
On this AVX2 CPU the model runs in fp32 (--dtype float32); only the KV cache dtype changes.

--decode-microbench times the Triton paged attention on decode-only batches (Llama-3-8B-like heads:
8 KV heads x 4, head_dim 128, blocks of 16 scattered at random) and prints the achieved bandwidth
(K/V codes + scales + block table read, queries read and outputs written, per call) against the
device's peak (spec sheet by name, and a measured device-to-device copy), with the pure-torch
reference on the same GPU as the peer.
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

from bench.common import (RunResult, Timer, Workload, add_engine_flags, add_workload_args, environment_line,
                          load_workload, print_result)

WARMUP = [[1, 2, 3, 4, 5, 6, 7, 8] * 4]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(ap)
    add_engine_flags(ap, model="default", dtype="float32", block_size=16, max_model_len=2048)
    ap.add_argument("--kv-dtypes", default="bf16,int8", help="comma-separated kv_cache_dtype values, baseline first")
    ap.add_argument("--concurrency", type=int, default=16, help="requests the baseline budget admits at once")
    ap.add_argument("--decode-microbench", action="store_true", help="only the GPU decode-attention microbenchmark")
    return ap.parse_args(argv)


# Spec-sheet HBM bandwidth (GB/s), matched against torch.cuda.get_device_name().
PEAK_GBS = [("H200", 4800), ("H100 NVL", 3900), ("H100 PCIe", 2000), ("H100", 3350), ("GH200", 4000),
            ("A100-SXM4-80GB", 2039), ("A100 80GB PCIe", 1935), ("A100", 1555), ("L40S", 864), ("L4", 300)]


def decode_microbench() -> None:
    import torch
    import triton.testing

    from pagedserve.kernels import reference, triton as tri

    dev = torch.device("cuda")
    name = torch.cuda.get_device_name(dev)
    peak = next((gbs for key, gbs in PEAK_GBS if key in name), None)
    buf = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    copy_ms = triton.testing.do_bench(lambda b=buf: b[1 << 29:].copy_(b[: 1 << 29]))
    copy_gbs = 2 * (1 << 29) / copy_ms / 1e6
    del buf
    print(f"[device] {name}: spec peak {peak or 'unknown'} GB/s, measured d2d copy {copy_gbs:.0f} GB/s")
    hkv, group, d, bs = 8, 4, 128, 16
    gen = torch.Generator(device=dev).manual_seed(0)
    for num_seqs, ctx in ((64, 4096), (8, 32768), (256, 1024)):
        nblk = num_seqs * ctx // bs
        block_table = torch.randperm(nblk, device=dev, generator=gen).view(num_seqs, -1).to(torch.int32)
        query = torch.randn(num_seqs, hkv * group, d, device=dev, dtype=torch.bfloat16)
        meta = dict(block_table=block_table, query_start_loc=torch.arange(num_seqs + 1, device=dev, dtype=torch.int32),
                    seq_lens=torch.full((num_seqs,), ctx, device=dev, dtype=torch.int32), scale=d**-0.5,
                    max_query_len=1, max_seq_len=ctx)
        for kv in (torch.bfloat16, torch.float8_e4m3fn, torch.int8):
            shape = (nblk, bs, hkv, d)
            caches = [torch.randn(shape, device=dev).mul_(20).to(kv) for _ in range(2)]
            scales = {} if kv == torch.bfloat16 else {
                "k_scale": torch.rand(shape[:3], device=dev) / 20, "v_scale": torch.rand(shape[:3], device=dev) / 20}
            args = dict(query=query, key_cache=caches[0], value_cache=caches[1], **meta, **scales)
            ms = triton.testing.do_bench(lambda a=args: tri.paged_attention(**a))
            moved = (2 * caches[0].numel() * caches[0].element_size() + sum(t.numel() * 4 for t in scales.values())
                     + block_table.numel() * 4 + 2 * query.numel() * query.element_size())
            gbs = moved / ms / 1e6
            line = (f"[decode] {num_seqs:>3} seqs x {ctx:>5} ctx, kv {str(kv).removeprefix('torch.'):<14} "
                    f"triton {ms * 1e3:8.1f} us  {gbs:6.0f} GB/s"
                    + (f" = {100 * gbs / peak:4.1f}% of peak" if peak else "")
                    + f", {100 * gbs / copy_gbs:4.1f}% of copy")
            if num_seqs * ctx <= 64 * 4096:
                ref_ms = triton.testing.do_bench(lambda a=args: reference.paged_attention(**a), rep=50)
                line += f"; reference {ref_ms * 1e3:9.1f} us (triton {ref_ms / ms:.1f}x faster)"
            print(line, flush=True)
            del caches, scales, args
        torch.cuda.empty_cache()


def budget_bytes(args: argparse.Namespace, workload: Workload, model_path: Path, baseline: str) -> int:
    """kv_cache_memory that holds `concurrency` average requests at full length in the baseline dtype."""
    import torch
    from transformers import AutoConfig

    from pagedserve.core.kv_cache.cache_tensors import make_kv_cache_spec
    from pagedserve.core.models.arch import ModelArch

    arch = ModelArch.from_hf_config(AutoConfig.from_pretrained(model_path, local_files_only=True))
    spec = make_kv_cache_spec(baseline, torch.float32, arch.num_layers, args.block_size, arch.num_kv_heads,
                              arch.head_dim)
    bs = args.block_size
    reqs = workload.requests
    mean_blocks = sum(-(-(len(r.prompt_ids) + r.max_new_tokens) // bs) for r in reqs) / len(reqs)
    return int(args.concurrency * mean_blocks * spec.bytes_per_block)


def run(engine, workload: Workload, label: str) -> tuple[RunResult, list[list[int]]]:
    from pagedserve.core.sampling_params import SamplingParams

    engine.generate(WARMUP, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    base_preempt = engine.stats.num_preemptions_total
    ids = [engine.add_request(f"{label}-{i}", r.prompt_ids,
                              SamplingParams(temperature=0.0, max_tokens=r.max_new_tokens, ignore_eos=True))
           for i, r in enumerate(workload.requests)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    max_running = steps = 0
    with Timer() as t:
        while engine.has_unfinished_requests():
            outs = engine.step()
            steps += 1
            finished = 0
            for out in outs:
                tokens[out.request_id].extend(out.new_token_ids)
                finished += out.finished
            # Requests holding KV during this step: still running after it, plus those it finished.
            max_running = max(max_running, engine.stats.num_running + finished)
    outputs = [tokens[i] for i in ids]
    useful = sum(min(len(o), r.max_new_tokens) for o, r in zip(outputs, workload.requests))
    extra = {"kv_cache_dtype": label, "kv_blocks": engine.num_kv_blocks,
             "kv_tokens": engine.num_kv_blocks * engine.config.cache.block_size,
             "max_concurrent_requests": max_running, "preemptions": engine.stats.num_preemptions_total - base_preempt,
             "steps": steps}
    return RunResult(f"pagedserve_kv_{label}", t.elapsed, workload.total_prompt_tokens, useful, extra), outputs


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.decode_microbench:
        decode_microbench()
        return
    from transformers import AutoTokenizer

    from pagedserve.core.engine import LLMEngine
    from pagedserve.core.models.default_model import resolve_model_path
    from pagedserve.tools.engine_args import engine_config_from_args

    print(environment_line())
    kv_dtypes = [k.strip() for k in args.kv_dtypes.split(",") if k.strip()]
    model_path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
    workload = load_workload(args.workload, tokenizer).head(args.num_requests)
    budget = budget_bytes(args, workload, model_path, kv_dtypes[0])
    print(f"[budget] kv_cache_memory = {budget} bytes ({budget / 2**20:.1f} MiB): about {args.concurrency} "
          f"{kv_dtypes[0]} requests at full length")
    results, outputs = [], []
    for kv in kv_dtypes:
        engine = LLMEngine(engine_config_from_args(args).replace(kv_cache_dtype=kv, kv_cache_memory=budget))
        result, out = run(engine, workload, kv)
        print_result(result)
        results.append(result)
        outputs.append(out)
        del engine
        gc.collect()

    base = results[0]
    print(f"{'kv dtype':<10}{'blocks':>8}{'tokens':>9}{'max conc':>10}{'preempt':>9}{'wall s':>9}{'out tok/s':>11}")
    for r in results:
        e = r.extra
        print(f"{e['kv_cache_dtype']:<10}{e['kv_blocks']:>8}{e['kv_tokens']:>9}{e['max_concurrent_requests']:>10}"
              f"{e['preemptions']:>9}{r.wall_s:>9.1f}{r.output_tokens_per_s:>11.1f}")
    for r, out in zip(results[1:], outputs[1:]):
        same = sum(a[:16] == b[:16] for a, b in zip(outputs[0], out))
        print(f"[agreement] {r.extra['kv_cache_dtype']} vs {base.extra['kv_cache_dtype']}: first 16 greedy tokens "
              f"equal in {same}/{len(out)} requests")
    for r in results[1:]:
        k, b = r.extra, base.extra
        print(f"ratio blocks {k['kv_cache_dtype']}/{b['kv_cache_dtype']}: {k['kv_blocks'] / b['kv_blocks']:.2f}x")
        print(f"ratio throughput {k['kv_cache_dtype']}/{b['kv_cache_dtype']}: "
              f"{r.output_tokens_per_s / base.output_tokens_per_s:.2f}x")
        print(f"ratio concurrency {k['kv_cache_dtype']}/{b['kv_cache_dtype']}: "
              f"{k['max_concurrent_requests'] / b['max_concurrent_requests']:.2f}x (target >= 1.9x)")


if __name__ == "__main__":
    main()
