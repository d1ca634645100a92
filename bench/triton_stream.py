"""Serving overhead of the Triton adapter: the workload over gRPC streaming to a real tritonserver,
against the same engine called in-process, in one run.

    python -m bench.triton_stream [--workload PATH] [--num-requests N] [--max-tokens N]
                                  [--model default] [--engine-json PATH] [--threads N]

What is compared. One workload (bench/common.py; it prints which one ran), decoded greedily with
EOS ignored so every request produces exactly its max_new_tokens (capped by --max-tokens). Prompts
are the workload's token ids decoded to text, so both sides see the same strings and tokenize them
the same way; both sides detokenize their output.

* inprocess_async (the peer): AsyncLLMEngine in this process, every request submitted at once
  (asyncio.gather), each stream read to its end: the engine with no server around it.
* triton_grpc_stream: `pagedserve triton`'s start_server on a copy of model_repository/ with the
  same engine.json, only the `pagedserve` model loaded; every request sent at once, one
  tritonclient.grpc stream each (stream=true), each read to its FINAL response.

Both sides run a warm-up request before the clock starts; one side finishes (engine shut down,
server stopped) before the other starts, so they never share the CPU. The in-process side runs
first unless --triton-first. The wall time runs from the first request
sent to the last final response. The LAST line is `ratio triton_grpc_stream/inprocess_async: X.XXx`
(target >= 0.9).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import queue
import shutil
import tempfile
from pathlib import Path

from pagedserve.adapters.triton_server.launcher import DEFAULT_REPOSITORY

from bench.common import (RunResult, Timer, add_workload_args, environment_line, load_workload,
                          print_result, print_summary, ratio_line)
from tests.harness.local_ports import free_ports

WARMUP = "The quick brown fox jumps over the lazy dog."


def engine_settings(args: argparse.Namespace) -> dict:
    data = json.loads(Path(args.engine_json).read_text())
    if args.model:
        data["model"] = args.model
    return data


def run_inprocess(settings: dict, prompts: list[str], lengths: list[int]) -> tuple[RunResult, list[str]]:
    from pagedserve.core.async_engine import AsyncLLMEngine
    from pagedserve.core.config import EngineConfig
    from pagedserve.core.sampling_params import SamplingParams

    engine = AsyncLLMEngine(EngineConfig.from_dict(settings))

    async def one(rid: str, prompt: str, n: int) -> tuple[str, int]:
        text, tokens = [], 0
        async for out in engine.generate(rid, prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)):
            text.append(out.text)
            tokens += len(out.new_token_ids)
        return "".join(text), tokens

    async def all_requests():
        return await asyncio.gather(*(one(f"r{i}", p, n) for i, (p, n) in enumerate(zip(prompts, lengths))))

    asyncio.run(one("warmup", WARMUP, 8))
    with Timer() as t:
        results = asyncio.run(all_requests())

    async def count_prompt_tokens():
        return sum([len(ids) for ids in await asyncio.gather(*(engine.tokenize(p) for p in prompts))])

    prompt_tokens = asyncio.run(count_prompt_tokens())
    engine.shutdown()
    return (RunResult("inprocess_async", t.elapsed, prompt_tokens, sum(n for _, n in results)),
            [text for text, _ in results])


def _inputs(prompt: str, n: int):
    import numpy as np
    import tritonclient.grpc as grpcclient

    sampling = json.dumps({"temperature": 0, "max_tokens": n, "ignore_eos": True})
    arrays = [("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
              ("stream", np.array([True]), "BOOL"),
              ("sampling_parameters", np.array([sampling.encode()], dtype=np.object_), "BYTES"),
              ("return_num_output_tokens", np.array([True]), "BOOL")]
    out = []
    for name, array, dtype in arrays:
        x = grpcclient.InferInput(name, [1], dtype)
        x.set_data_from_numpy(array)
        out.append(x)
    return out


def run_triton(settings: dict, prompts: list[str], lengths: list[int], prompt_tokens: int,
               log_dir: Path) -> tuple[RunResult, list[str]]:
    import tritonclient.grpc as grpcclient

    from pagedserve.adapters.triton_server.launcher import start_server

    repo = log_dir / "model_repository"
    shutil.copytree(DEFAULT_REPOSITORY, repo)
    (repo / "pagedserve" / "1" / "engine.json").write_text(json.dumps(settings))
    http, grpc, metrics = free_ports(3)
    with Timer() as load:
        server = start_server(repo, http_port=http, grpc_port=grpc, metrics_port=metrics, models=["pagedserve"],
                              log_path=log_dir / "tritonserver.log", timeout=900)
    print(f"[triton] server ready in {load.elapsed:.1f}s (log: {log_dir / 'tritonserver.log'})")
    events: queue.Queue = queue.Queue()
    clients = []
    try:
        for i in range(len(prompts) + 1):  # one stream per request, plus the warm-up's
            c = grpcclient.InferenceServerClient(server.grpc_url)
            c.start_stream(callback=lambda result, error, i=i: events.put((i, result, error)))
            clients.append(c)
        clients[-1].async_stream_infer("pagedserve", _inputs(WARMUP, 8), enable_empty_final_response=True)
        _drain(events, {len(prompts)}, {})
        texts: dict[int, list[str]] = {i: [] for i in range(len(prompts))}
        with Timer() as t:
            for i, (p, n) in enumerate(zip(prompts, lengths)):
                clients[i].async_stream_infer("pagedserve", _inputs(p, n), enable_empty_final_response=True)
            tokens = _drain(events, set(range(len(prompts))), texts)
    finally:
        for c in clients:
            c.stop_stream()
            c.close()
        server.stop()
    result = RunResult("triton_grpc_stream", t.elapsed, prompt_tokens, tokens)
    return result, ["".join(texts[i]) for i in range(len(prompts))]


def _drain(events: queue.Queue, waiting: set[int], texts: dict[int, list[str]]) -> int:
    """Read responses until every stream in `waiting` got its FINAL one; returns tokens received."""
    tokens = 0
    while waiting:
        i, result, error = events.get(timeout=1800)
        if error is not None:
            raise RuntimeError(f"request {i} failed: {error}")
        if i in texts:
            texts[i].append(result.as_numpy("text_output")[0].decode())
            tokens += int(result.as_numpy("num_output_tokens")[0])
        if result.get_response().parameters["triton_final_response"].bool_param:
            waiting.discard(i)
    return tokens


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(ap)
    ap.add_argument("--max-tokens", type=int, default=None, help="cap every request's output length")
    ap.add_argument("--model", default=None, help="override the engine JSON's model (local HF dir or 'default')")
    ap.add_argument("--engine-json", default=str(DEFAULT_REPOSITORY / "pagedserve" / "1" / "engine.json"),
                    help="engine settings for both sides (default: the shipped pagedserve model's)")
    ap.add_argument("--threads", type=int, default=None, help="torch/OpenMP threads for both sides")
    ap.add_argument("--triton-first", action="store_true",
                    help="run the server side first (swap the order to see how much the order matters)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the server's stub
        import torch
        torch.set_num_threads(args.threads)
    print(environment_line())
    settings = engine_settings(args)
    print(f"[engine] settings for both sides: {json.dumps(settings)}")
    from pagedserve.core.engine import LLMEngine  # noqa: F401 - fail early if the package is missing
    from pagedserve.core.models.default_model import resolve_model_path
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(settings.get("model", "default")))
    workload = load_workload(args.workload, tokenizer).head(args.num_requests).cap_new_tokens(args.max_tokens or None)
    prompts = [tokenizer.decode(r.prompt_ids) for r in workload.requests]
    lengths = [r.max_new_tokens for r in workload.requests]
    print(f"[workload] using {len(prompts)} requests, {sum(lengths)} output tokens"
          + (f" (capped at {args.max_tokens} each)" if args.max_tokens else ""))

    def inprocess():
        result, texts = run_inprocess(settings, prompts, lengths)
        print_result(result)
        gc.collect()
        return result, texts

    def triton(prompt_tokens: int):
        with tempfile.TemporaryDirectory(prefix="pagedserve-bench-") as tmp:
            result, texts = run_triton(settings, prompts, lengths, prompt_tokens, Path(tmp))
        print_result(result)
        return result, texts

    if args.triton_first:
        prompt_tokens = sum(len(tokenizer.encode(p)) for p in prompts)
        ours, our_texts = triton(prompt_tokens)
        peer, peer_texts = inprocess()
    else:
        peer, peer_texts = inprocess()
        ours, our_texts = triton(peer.prompt_tokens)
    same = sum(a == b for a, b in zip(our_texts, peer_texts))
    print(f"[agreement] output text identical in {same}/{len(prompts)} requests")
    print_summary([ours, peer])
    print(ratio_line(ours, peer))


if __name__ == "__main__":
    main()
