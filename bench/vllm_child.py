"""One side of bench/vllm_peer.py, run in its own process: vLLM (inside the side virtualenv) or
pagedserve, over the workload file the driver wrote. Prints one line `RESULT {json}` and writes
each request's token ids to --tokens-out.

    <python> bench/vllm_child.py --side vllm|pagedserve --model DIR --dtype bfloat16|float32
        --workload FILE --max-num-seqs N --tokens-out FILE

Only the standard library and the side's own engine are imported, so the vLLM side runs in a
virtualenv that has no pagedserve. Both sides load, run an 8-token warm-up request, then time
one `generate` over every request (greedy, EOS ignored, no detokenization).
"""

from __future__ import annotations

import argparse
import json
import time

WARMUP_IDS = [1, 2, 3, 4, 5, 6, 7, 8]


def run_vllm(args: argparse.Namespace, requests: list[dict]) -> tuple[float, float, list[list[int]]]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    start = time.perf_counter()
    # The settings the peer figures were measured with: chunked prefill on, prefix
    # caching off (pagedserve's default benchmark runs without a shared prefix either way).
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
    return load_s, wall_s, [list(o.outputs[0].token_ids) for o in outputs]


def run_pagedserve(args: argparse.Namespace, requests: list[dict]) -> tuple[float, float, list[list[int]]]:
    from pagedserve.core.config import EngineConfig
    from pagedserve.core.engine import LLMEngine
    from pagedserve.core.sampling_params import SamplingParams

    start = time.perf_counter()
    engine = LLMEngine(EngineConfig.from_dict({"model": args.model, "dtype": args.dtype,
                                               "max_num_seqs": args.max_num_seqs,
                                               "max_model_len": args.max_model_len}))
    load_s = time.perf_counter() - start
    engine.generate([WARMUP_IDS], [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)])
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_new_tokens"], ignore_eos=True) for r in requests]
    start = time.perf_counter()
    results = engine.generate([r["prompt_ids"] for r in requests], params)
    wall_s = time.perf_counter() - start
    return load_s, wall_s, [list(r.token_ids) for r in results]


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
    with open(args.workload, encoding="utf-8") as f:
        requests = json.load(f)["requests"]
    run = run_vllm if args.side == "vllm" else run_pagedserve
    load_s, wall_s, tokens = run(args, requests)
    with open(args.tokens_out, "w", encoding="utf-8") as f:
        json.dump(tokens, f)
    print("RESULT " + json.dumps({"load_s": load_s, "wall_s": wall_s,
                                  "output_tokens": sum(len(t) for t in tokens)}), flush=True)


if __name__ == "__main__":  # vLLM starts its engine core with multiprocessing: the guard is required
    main()
