"""One side of bench/vllm_peer.py, run in its own process: vLLM (inside the side virtualenv) or
pagedserve, over the workload file the driver wrote. Prints one line `RESULT {json}` and writes
each request's token ids to --tokens-out.

    <python> bench/vllm_child.py --side vllm|pagedserve --model DIR --dtype bfloat16|float32
        --workload FILE --max-num-seqs N --tokens-out FILE

Only the standard library and the side's own engine are imported, so the vLLM side runs in a
virtualenv that has no pagedserve. Both sides load, run an 8-token warm-up request, then time
one `generate` over every request (greedy, EOS ignored, no detokenization). After it, two
single-request latencies the same way on both sides (best of 3): a 512-token prompt with one
output token (prefill tok/s), and a 128-token prompt decoded for 1 and for 65 tokens (the
difference / 64 is the batch-1 decode time per token).
"""

from __future__ import annotations

import argparse
import json
import time

WARMUP_IDS = [1, 2, 3, 4, 5, 6, 7, 8]


LATENCY_REPEATS = 3


def latencies(generate_one, requests: list[dict]) -> dict:
    """generate_one(prompt_ids, max_tokens) runs one request to completion. Prompts are sliced from
    the workload's own prompts (real token ids), repeated where they are shorter."""
    tokens = [t for r in requests for t in r["prompt_ids"]]
    while len(tokens) < 4096:
        tokens += tokens

    def best(start: int, length: int, max_tokens: int) -> float:
        times = []
        for repeat in range(LATENCY_REPEATS):  # a different prompt each time: no cache can serve it
            prompt = tokens[start + 700 * repeat:start + 700 * repeat + length]
            began = time.perf_counter()
            generate_one(prompt, max_tokens)
            times.append(time.perf_counter() - began)
        return min(times)

    prefill_512 = best(0, 512, 1)
    first, longer = best(2000, 128, 1), best(2000, 128, 65)
    return {"prefill_512_tok_s": 512 / prefill_512, "decode_b1_ms": (longer - first) / 64 * 1e3}


def run_vllm(args: argparse.Namespace, requests: list[dict]) -> tuple[float, float, list[list[int]], dict]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    # The settings the peer figures were measured with: chunked prefill on, prefix
    # caching off (off on the pagedserve side too).
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs, enable_chunked_prefill=True,
              enable_prefix_caching=False, max_model_len=args.max_model_len, seed=0)
    load_s = time.perf_counter() - start
    greedy = dict(temperature=0.0, ignore_eos=True, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=WARMUP_IDS)], [SamplingParams(max_tokens=8, **greedy)],
                 use_tqdm=False)
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_ids"]) for r in requests]
    params = [SamplingParams(max_tokens=r["max_new_tokens"], **greedy) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall_s = time.perf_counter() - start

    def generate_one(prompt: list[int], max_tokens: int) -> None:
        llm.generate([TokensPrompt(prompt_token_ids=prompt)], [SamplingParams(max_tokens=max_tokens, **greedy)],
                     use_tqdm=False)

    return load_s, wall_s, [list(o.outputs[0].token_ids) for o in outputs], latencies(generate_one, requests)


def run_pagedserve(args: argparse.Namespace, requests: list[dict]) -> tuple[float, float, list[list[int]], dict]:
    from pagedserve.core.config import EngineConfig
    from pagedserve.core.engine import LLMEngine
    from pagedserve.core.sampling_params import SamplingParams

    start = time.perf_counter()
    engine = LLMEngine(EngineConfig.from_dict({"model": args.model, "dtype": args.dtype,
                                               "max_num_seqs": args.max_num_seqs, "enable_prefix_caching": False,
                                               "max_model_len": args.max_model_len}))
    load_s = time.perf_counter() - start
    engine.generate([WARMUP_IDS], [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)])
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_new_tokens"], ignore_eos=True) for r in requests]
    start = time.perf_counter()
    results = engine.generate([r["prompt_ids"] for r in requests], params)
    wall_s = time.perf_counter() - start

    def generate_one(prompt: list[int], max_tokens: int) -> None:
        engine.generate([prompt], [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)])

    return load_s, wall_s, [list(r.token_ids) for r in results], latencies(generate_one, requests)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--side", choices=["vllm", "pagedserve"], required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", required=True)
    ap.add_argument("--workload", required=True)
    ap.add_argument("--max-num-seqs", type=int, required=True)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--tokens-out", required=True)
    args = ap.parse_args()
    # Both engines refuse a max_model_len past the model's own (a tiny test model has 1024).
    with open(f"{args.model}/config.json", encoding="utf-8") as f:
        limit = json.load(f).get("max_position_embeddings")
    if limit:
        args.max_model_len = min(args.max_model_len, limit)
    with open(args.workload, encoding="utf-8") as f:
        requests = json.load(f)["requests"]
    run = run_vllm if args.side == "vllm" else run_pagedserve
    load_s, wall_s, tokens, latency = run(args, requests)
    with open(args.tokens_out, "w", encoding="utf-8") as f:
        json.dump(tokens, f)
    print("RESULT " + json.dumps({"load_s": load_s, "wall_s": wall_s,
                                  "output_tokens": sum(len(t) for t in tokens), **latency}), flush=True)


if __name__ == "__main__":  # vLLM starts its engine core with multiprocessing: the guard is required
    main()
