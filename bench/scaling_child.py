"""One side of bench/scaling.py, run in its own process: vLLM (inside the side virtualenv) or
pagedserve. Loads, warms up, prints `READY`, then runs each cell the driver writes to its stdin
(one JSON object per line) and answers one line `CELL {json}` per cell, until stdin closes.

    <python> bench/scaling_child.py --side vllm|pagedserve --model DIR --dtype bfloat16|float32
        --pool FILE --max-num-seqs N --max-model-len N --kv-gib G

Only the standard library and the side's own engine are imported (the vLLM side runs in a
virtualenv that has no pagedserve). Both sides are driven the same way, step by step through
their LLMEngine: every request of a cell is added at once, then step() runs until all have
finished; a request's TTFT is the time from the cell's start to the first step that returns a
token for it. Greedy, EOS ignored, no detokenization, prefix caching off.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

WARMUP_IDS = [1, 2, 3, 4, 5, 6, 7, 8]


def run_cell(engine, add, cell: dict, pool: list[int]) -> dict:
    """add(request_id, prompt_ids, max_tokens) queues one request on `engine`."""
    length, concurrency, output = cell["prompt_len"], cell["concurrency"], cell["output_len"]
    start = time.perf_counter()
    for i in range(concurrency):  # a different slice of real text per request
        offset = (i * 997) % (len(pool) - length)
        add(f"c{length}x{concurrency}-{i}", pool[offset:offset + length], output)
    first: dict[str, float] = {}
    tokens: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter() - start
            count = new_tokens(out)
            if count:
                first.setdefault(out.request_id, now)
                tokens[out.request_id] = count
    wall = time.perf_counter() - start
    ttfts = sorted(first.values())
    return {**cell, "wall_s": wall, "output_tokens": sum(tokens.values()),
            "output_tok_s": sum(tokens.values()) / wall, "ttft_mean_s": statistics.fmean(ttfts),
            "ttft_p50_s": statistics.median(ttfts)}


def new_tokens(out) -> int:
    """Tokens the request has produced so far (both engines' outputs carry the count)."""
    if hasattr(out, "num_output_tokens"):  # pagedserve: one output per sample, a delta
        return out.num_output_tokens
    return len(out.outputs[0].token_ids)  # vLLM: cumulative outputs


def vllm_side(args: argparse.Namespace):
    from vllm import EngineArgs, LLMEngine, SamplingParams
    from vllm.inputs import TokensPrompt

    engine = LLMEngine.from_engine_args(EngineArgs(
        model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs, enable_chunked_prefill=True,
        enable_prefix_caching=False, max_model_len=args.max_model_len, seed=0))

    def add(request_id: str, prompt: list[int], max_tokens: int) -> None:
        engine.add_request(request_id, TokensPrompt(prompt_token_ids=prompt),
                           SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False))

    return engine, add


def pagedserve_side(args: argparse.Namespace):
    from pagedserve.core.config import EngineConfig
    from pagedserve.core.engine import LLMEngine
    from pagedserve.core.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig.from_dict({
        "model": args.model, "dtype": args.dtype, "max_num_seqs": args.max_num_seqs,
        "enable_prefix_caching": False, "max_model_len": args.max_model_len,
        "kv_cache_memory": int(args.kv_gib * 2**30)}))

    def add(request_id: str, prompt: list[int], max_tokens: int) -> None:
        engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                              ignore_eos=True))

    return engine, add


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--side", choices=["vllm", "pagedserve"], required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", required=True)
    ap.add_argument("--pool", required=True, help="JSON list of token ids the prompts are sliced from")
    ap.add_argument("--max-num-seqs", type=int, required=True)
    ap.add_argument("--max-model-len", type=int, required=True)
    ap.add_argument("--kv-gib", type=float, required=True)
    args = ap.parse_args()
    with open(args.pool, encoding="utf-8") as f:
        pool = json.load(f)
    engine, add = (vllm_side if args.side == "vllm" else pagedserve_side)(args)
    add("warmup", WARMUP_IDS, 8)
    while engine.has_unfinished_requests():
        engine.step()
    print("READY", flush=True)
    for line in sys.stdin:
        print("CELL " + json.dumps(run_cell(engine, add, json.loads(line), pool)), flush=True)


if __name__ == "__main__":  # vLLM starts its engine core with multiprocessing: the guard is required
    main()
