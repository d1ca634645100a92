"""The `pagedserve` command line (the console script). Arguments are parsed in main(); nothing
runs at import.

  pagedserve generate [--model default] [--prompt TEXT ...] [--max-tokens N] [--temperature T]

  pagedserve triton ...      start a real tritonserver on model_repository/ (adapters/triton_server)
  pagedserve kserve ...      start a kserve ModelServer with OpenAI routes (adapters/kserve)
  pagedserve run-batch ...   run an OpenAI Batch file offline (tools/run_batch.py)
  pagedserve tune ...        search engine settings within a latency SLO (tools/tuner.py)

It is a tool (tools/): `generate` drives an LLMEngine itself, which adapters may not, and it
wires the platforms up, which core may not (docs/design.md). Each subcommand but `generate` is a
module whose `main(argv)` parses the rest of the command line, imported only when invoked: kserve
and tritonclient.grpc cannot share a process, and neither should slow down the others' start.
"""

from __future__ import annotations

import argparse
import sys
import time

from pagedserve.tools.engine_args import add_engine_args, engine_config_from_args

DEFAULT_PROMPTS = (
    "What is a paged KV cache?",
    "Write a haiku about batching.",
    "Name three primary colors.",
)


def _generate(args: argparse.Namespace) -> int:
    from pagedserve.core.engine import LLMEngine
    from pagedserve.core.sampling_params import SamplingParams

    engine = LLMEngine(engine_config_from_args(args))  # offline: no engine thread, no platform
    prompts = args.prompt or list(DEFAULT_PROMPTS)
    if not args.raw:
        prompts = [engine.apply_chat_template([{"role": "user", "content": p}]) if engine.tokenizer.chat_template
                   else p for p in prompts]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    shown = args.prompt or list(DEFAULT_PROMPTS)
    for prompt, res in zip(shown, results):
        print(f"### {prompt}\n{res.text.strip()}\n[{len(res.token_ids)} tokens, finish_reason={res.finish_reason}]\n")
    n = sum(len(r.token_ids) for r in results)
    print(f"{len(results)} requests, {n} tokens in {elapsed:.2f}s ({n / elapsed:.1f} tokens/s) "
          f"on {engine.device} in {str(engine.dtype).removeprefix('torch.')}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text offline for a few prompts")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable); defaults to three examples")
    gen.add_argument("--raw", action="store_true", help="send prompts as-is, without the chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.set_defaults(func=_generate)
    for name, (_, help_text) in PLATFORM_COMMANDS.items():
        sub.add_parser(name, help=help_text + f" (see `pagedserve {name} --help`)", add_help=False)
    return parser


# subcommand -> module whose main(argv) parses the rest of the command line (loaded only when used)
PLATFORM_COMMANDS = {
    "triton": ("pagedserve.adapters.triton_server.launcher", "start a real tritonserver serving pagedserve"),
    "kserve": ("pagedserve.adapters.kserve.server", "start a kserve ModelServer serving pagedserve"),
    "run-batch": ("pagedserve.tools.run_batch", "run an OpenAI Batch file (JSONL) offline, resumable"),
    "tune": ("pagedserve.tools.tuner", "search engine settings for the best throughput within a TTFT/ITL SLO"),
}


def main(argv: list[str] | None = None) -> int:
    import importlib
    import logging

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in PLATFORM_COMMANDS:
        module = importlib.import_module(PLATFORM_COMMANDS[argv[0]][0])
        return module.main(argv[1:])

    from pagedserve.core.errors import PagedServeError

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except PagedServeError as exc:
        print(f"pagedserve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
