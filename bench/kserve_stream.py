"""Streaming throughput through the KServe adapter vs the in-process engine, in one run.

    python -m bench.kserve_stream [--workload PATH] [--num-requests N] [--max-new-tokens N]
                                  [--model default] [--dtype auto] [--max-num-seqs N]
                                  [--max-num-batched-tokens N]

What is compared. One workload (bench/common.py; it prints which one ran), greedy, EOS ignored,
so every request produces exactly its max_new_tokens:

* in_process: all requests submitted at once to LLMEngine.generate (bench/throughput.py's run).
* kserve_openai_stream: the same requests, all sent at once as streaming
  `POST /openai/v1/completions` (token-id prompts, stream_options.include_usage) to a real
  `pagedserve kserve` server in a subprocess with the same engine settings; an httpx client
  parses every SSE chunk. The clock runs from the first request sent to the last `[DONE]`;
  useful tokens are each stream's usage.completion_tokens.

Both sides load before the clock and serve one warm-up request first; they run one after the
other, never at the same time. The client runs on the same machine as the server and competes
with it for the CPU, so the ratio is a lower bound on what a remote client would see.
A reduced run: --num-requests 16 --max-new-tokens 32 (first 16 requests, outputs capped at 32).
The LAST line is `ratio kserve_openai_stream/in_process: X.XXx` (target >= 0.90).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import tempfile
from pathlib import Path

import httpx

from bench.common import (RunResult, Timer, Workload, WorkloadRequest, add_engine_flags, add_workload_args,
                          environment_line, load_workload, print_result, print_summary, ratio_line)
from bench.throughput import run_pagedserve

MODEL_NAME = "bench"


async def _stream_one(client: httpx.AsyncClient, url: str, req: WorkloadRequest) -> tuple[str, int]:
    body = {"model": MODEL_NAME, "prompt": req.prompt_ids, "max_tokens": req.max_new_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    parts, completion_tokens = [], 0
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread()).decode()}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"error in stream: {chunk['error']}")
            if chunk["choices"]:
                parts.append(chunk["choices"][0]["text"])
            elif chunk.get("usage"):
                completion_tokens = chunk["usage"]["completion_tokens"]
    return "".join(parts), completion_tokens


async def _stream_all(base_url: str, requests: list[WorkloadRequest]) -> list[tuple[str, int]]:
    limits = httpx.Limits(max_connections=len(requests) + 1, max_keepalive_connections=len(requests) + 1)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        url = f"{base_url}/completions"
        return await asyncio.gather(*(_stream_one(client, url, r) for r in requests))


def run_kserve_stream(model: str, engine_settings: dict, workload: Workload,
                      threads: int | None) -> tuple[RunResult, list[str]]:
    """The workload streamed from a `pagedserve kserve` server whose engine has `engine_settings`
    (the in-process engine's, passed as --engine-config)."""
    from tests.harness.kserve_launch import start_kserve

    env = {"OMP_NUM_THREADS": str(threads)} if threads else None
    with tempfile.TemporaryDirectory() as tmp:
        settings = Path(tmp) / "engine.json"
        settings.write_text(json.dumps(engine_settings))
        with Timer() as load:
            server = start_kserve(model, Path(tmp) / "server.log", MODEL_NAME, args=["--engine-config", str(settings)],
                                  env=env, timeout=900)
        try:
            print(f"[kserve_openai_stream] server ready in {load.elapsed:.1f}s at {server.openai_url}")
            asyncio.run(_stream_all(server.openai_url, [WorkloadRequest(workload.requests[0].prompt_ids[:16], 8)]))
            with Timer() as t:
                results = asyncio.run(_stream_all(server.openai_url, workload.requests))
        finally:
            server.stop()
    useful = sum(min(n, r.max_new_tokens) for (_, n), r in zip(results, workload.requests))
    short = sum(n < r.max_new_tokens for (_, n), r in zip(results, workload.requests))
    if short:
        print(f"[kserve_openai_stream] WARNING: {short} requests produced fewer than max_new_tokens tokens")
    return (RunResult("kserve_openai_stream", t.elapsed, workload.total_prompt_tokens, useful, {"streams": len(results)}),
            [text for text, _ in results])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(ap)
    ap.add_argument("--max-new-tokens", type=int, default=None, help="cap every request's output length")
    add_engine_flags(ap, model="default", dtype="auto")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads on both sides (default: torch's own choice)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import torch

    from pagedserve.tools.engine_args import engine_config_from_args

    if args.threads:
        torch.set_num_threads(args.threads)
    from pagedserve.core.engine import LLMEngine

    print(environment_line())
    config = engine_config_from_args(args)
    engine = LLMEngine(config)
    workload = load_workload(args.workload, engine.tokenizer).head(args.num_requests).cap_new_tokens(args.max_new_tokens)
    if args.num_requests is not None or args.max_new_tokens is not None:
        print(f"[workload] reduced run: {workload.summary()}")

    ours, tokens = run_pagedserve(engine, workload)
    ours.system = "in_process"
    print_result(ours)
    in_process_texts = [engine.tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
    del engine
    gc.collect()

    served, texts = run_kserve_stream(args.model, config.to_dict(), workload, args.threads)
    print_result(served)
    same = sum(a == b for a, b in zip(texts, in_process_texts))
    print(f"[agreement] streamed text equals the in-process text in {same}/{len(texts)} requests")
    print_summary([ours, served])
    print(ratio_line(served, ours) + " (target >= 0.90)")


if __name__ == "__main__":
    main()
