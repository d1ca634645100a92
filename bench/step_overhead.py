"""Engine step overhead: the host-side cost of one LLMEngine.step() with the model faked.

    python -m bench.step_overhead [--running 64,256] [--output-len 2048] [--prompt-len 32]
                                  [--model tiny|DIR] [engine flags]

The model's forward is replaced by a stub that returns zero logits over --fake-vocab tokens, so
what is timed is everything around it: scheduling, the KV block tables, the runner's batch
metadata, sampling (greedy: argmax of zeros), the scheduler's update and the output stage. For
each count in --running, that many samples are added at once (--prompt-len tokens each, greedy,
EOS ignored, --output-len tokens, no detokenization) and stepped until all finish; every one runs
for the whole time, so a step's cost at output position p shows what grows with the context.

The model (default `tiny`: the 2-layer random Llama of tests/tiny_models.py, built in a temporary
folder) only sets the KV pool's shape; its weights are never used.

Output per count: ms per step over the whole run, over the first and the last 10% of the steps
(contexts near --prompt-len and near prompt + output), and steps/s. The LAST line is
`step ms at <last count> running, last 10%: X.XX`.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from bench.common import add_engine_flags, environment_line


def fake_forward(vocab: int):
    """A forward that returns zero logits, one row per logits index (as the model does)."""

    def forward(batch, kv_caches):
        return torch.zeros(batch.logits_indices.shape[0], vocab)

    return forward


def run(engine, running: int, prompt_len: int, output_len: int) -> list[float]:
    """Seconds per step while `running` samples decode from prompt_len to prompt_len + output_len."""
    from pagedserve.core.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for i in range(running):
        engine.add_request(f"r{i}", [1 + (i + j) % 200 for j in range(prompt_len)], params, detokenize=False,
                           use_prefix_cache=False)
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_flags(ap, model="tiny", dtype="float32", max_num_seqs=256, max_num_batched_tokens=8192)
    ap.add_argument("--running", default="64,256", help="comma-separated counts of samples running at once")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=2048)
    ap.add_argument("--fake-vocab", type=int, default=384, help="columns of the fake logits")
    args = ap.parse_args(argv)
    counts = [int(c) for c in args.running.split(",")]
    from pagedserve.core.engine import LLMEngine
    from pagedserve.tools.engine_args import engine_config_from_args

    print(environment_line())
    with tempfile.TemporaryDirectory(prefix="step-overhead-") as tmp:
        if args.model == "tiny":
            from tests.tiny_models import build_tiny_model

            args.model = str(build_tiny_model(Path(tmp) / "tiny", "llama"))
        total = args.prompt_len + args.output_len
        blocks = max(counts) * -(-total // (args.block_size or 16)) + 16
        config = engine_config_from_args(args, defaults={"max_model_len": total, "num_kv_blocks": blocks})
        engine = LLMEngine(config.replace(max_num_seqs=max(config.scheduler.max_num_seqs, max(counts))))
        engine.runner.model.forward = fake_forward(args.fake_vocab)
        run(engine, 4, args.prompt_len, 16)  # warm-up
        line = ""
        for count in counts:
            times = run(engine, count, args.prompt_len, args.output_len)
            tenth = max(len(times) // 10, 1)
            ms = [1000 * sum(t) / len(t) for t in (times, times[:tenth], times[-tenth:])]
            print(f"[{count} running] {len(times)} steps, {ms[0]:.2f} ms/step ({len(times) / sum(times):.1f} steps/s); "
                  f"first 10% {ms[1]:.2f} ms, last 10% {ms[2]:.2f} ms", flush=True)
            line = f"step ms at {count} running, last 10%: {ms[2]:.2f}"
        print(line)


if __name__ == "__main__":
    main()
