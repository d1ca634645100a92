"""Shared pieces of the pagedserve benchmarks: workloads, timing, and one printed summary format.

A workload is a list of requests in arrival order, each `(prompt_ids, max_new_tokens)`, decoded
greedily with EOS ignored so that every request produces exactly `max_new_tokens` tokens. It comes
from a JSON file (`--workload PATH`; by default the reference workload tests/data/workloads/w64.json,
whose README says how it was made) or, with `--workload generated`, from a seeded generator that
tokenizes with the model's own tokenizer (w64.json holds SmolLM2 token ids: use `generated` for
another model). `load_workload` prints which one ran: a figure must say what it measured.

The generator follows the recipe of w64.json: the Debian license texts GPL-3, GFDL-1.3, Apache-2.0
and MPL-2.0 (copies in tests/data/license-texts/) are concatenated, whitespace collapsed, tokenized
without special tokens; then, per request, `random.Random(seed)` draws the prompt length, the output
length and the offset of a contiguous slice. With the SmolLM2 tokenizer it reproduces w64.json token
for token.
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from pagedserve.core.validation import parse_json

DATA_DIR = Path(__file__).resolve().parents[1] / "tests" / "data"
LICENSE_DIR = DATA_DIR / "license-texts"
LICENSE_TEXTS = ("GPL-3", "GFDL-1.3", "Apache-2.0", "MPL-2.0")
W64 = DATA_DIR / "workloads" / "w64.json"
"""The reference workload: the default --workload."""
GENERATED = "generated"
"""The --workload value that asks for the seeded generated workload instead of a file."""

# A short English paragraph for benchmarks that need text of their own (bench/prefix.py, soak.py).
FALLBACK_TEXT = (
    "A serving engine keeps many requests in flight at once. Each request brings a prompt, which the "
    "model reads in one pass, and then asks for new tokens, which the model writes one at a time. "
    "Reading a prompt is a wide matrix product that keeps the processor busy; writing one token is a "
    "narrow one that mostly waits on memory. Batching many requests together turns those narrow "
    "products into wide ones again, and that is where throughput comes from. The key and value "
    "vectors of every token already seen are kept in a cache, cut into fixed-size blocks so that a "
    "request can grow without copying and a finished request gives its blocks back at once. When the "
    "cache runs short, the newest request is paused and its blocks are freed; it resumes later by "
    "reading its tokens again. None of this changes the answer: greedy decoding must give the same "
    "tokens whether a request runs alone or shares every step with sixty others. "
)


class WorkloadError(ValueError):
    """A workload file that cannot be used; the message names the file, the entry and the fix."""


class WorkloadRequest(NamedTuple):
    prompt_ids: list[int]
    max_new_tokens: int


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    requests: list[WorkloadRequest]

    @property
    def total_prompt_tokens(self) -> int:
        return sum(len(r.prompt_ids) for r in self.requests)

    @property
    def total_new_tokens(self) -> int:
        return sum(r.max_new_tokens for r in self.requests)

    def head(self, n: int | None) -> "Workload":
        """The first n requests in arrival order (all of them for None)."""
        if n is None or n >= len(self.requests):
            return self
        if n < 1:
            raise ValueError(f"num_requests={n}: ask for at least one request")
        return Workload(f"{self.name}[:{n}]", self.description, self.requests[:n])

    def cap_new_tokens(self, max_new_tokens: int | None) -> "Workload":
        """Every request's output length capped at max_new_tokens (unchanged for None)."""
        if max_new_tokens is None:
            return self
        requests = [WorkloadRequest(r.prompt_ids, min(r.max_new_tokens, max_new_tokens)) for r in self.requests]
        return Workload(f"{self.name}[new<={max_new_tokens}]", self.description, requests)

    def summary(self) -> str:
        return (f"workload {self.name}: {len(self.requests)} requests, {self.total_prompt_tokens} prompt tokens, "
                f"{self.total_new_tokens} output tokens ({self.description})")


def _vocab_size(tokenizer: Any) -> int | None:
    try:
        return len(tokenizer)
    except TypeError:
        return None


def parse_workload(data: Any, where: str, vocab_size: int | None = None) -> list[WorkloadRequest]:
    """Validate the JSON of a workload file; `where` names the file in every error."""
    if not isinstance(data, dict) or not isinstance(data.get("requests"), list) or not data["requests"]:
        raise WorkloadError(f"{where}: expected a JSON object with a non-empty list 'requests' "
                            "of {'prompt_ids': [int, ...], 'max_new_tokens': int}")
    requests = []
    for i, entry in enumerate(data["requests"]):
        if not isinstance(entry, dict):
            raise WorkloadError(f"{where}: requests[{i}] is {type(entry).__name__}, expected an object")
        ids, n = entry.get("prompt_ids"), entry.get("max_new_tokens")
        if not isinstance(ids, list) or not ids:
            raise WorkloadError(f"{where}: requests[{i}].prompt_ids must be a non-empty list of token ids")
        for j, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab_size and t >= vocab_size):
                limit = f"[0, {vocab_size})" if vocab_size else ">= 0"
                raise WorkloadError(f"{where}: requests[{i}].prompt_ids[{j}] = {t!r}; token ids must be "
                                    f"integers in {limit} (was the file made with this model's tokenizer?)")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise WorkloadError(f"{where}: requests[{i}].max_new_tokens = {n!r}; expected an integer >= 1")
        requests.append(WorkloadRequest(list(ids), n))
    for key, got in (("total_prompt_tokens", sum(len(r.prompt_ids) for r in requests)),
                     ("total_new_tokens", sum(r.max_new_tokens for r in requests))):
        if key in data and data[key] != got:
            raise WorkloadError(f"{where}: header says {key}={data[key]} but the requests add up to {got}; "
                                "the file is inconsistent, regenerate it")
    return requests


def source_text() -> tuple[str, str]:
    """(text, label): the license texts of tests/data/license-texts, whitespace collapsed."""
    text = " ".join("".join((LICENSE_DIR / name).read_text(encoding="utf-8") for name in LICENSE_TEXTS).split())
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    return text, f"Debian license texts {'+'.join(LICENSE_TEXTS)} (sha256 {digest})"


def generate_workload(tokenizer: Any, num_requests: int = 64, prompt_len: tuple[int, int] = (16, 512),
                      new_tokens: tuple[int, int] = (16, 256), seed: int = 1234,
                      text: str | None = None, text_label: str = "given text") -> Workload:
    """Seeded requests whose prompts are contiguous token slices of real English text."""
    if text is None:
        text, text_label = source_text()
    # verbose=False: the stream is longer than the model's context on purpose (it is only sliced)
    stream = list(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
    base = list(stream)
    while len(stream) < 2 * prompt_len[1]:  # short fallback text: repeat it
        stream += base
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        p = rng.randint(*prompt_len)
        n = rng.randint(*new_tokens)
        off = rng.randint(0, len(stream) - p)
        requests.append(WorkloadRequest(stream[off:off + p], n))
    name = f"generated(seed={seed}, n={num_requests})"
    desc = (f"prompts {prompt_len[0]}-{prompt_len[1]} tokens sliced from {text_label}, "
            f"outputs {new_tokens[0]}-{new_tokens[1]}")
    return Workload(name, desc, requests)


def add_engine_flags(ap: argparse.ArgumentParser, **defaults: Any) -> None:
    """The engine's flags (and --engine-config) as every pagedserve command spells them
    (tools/engine_args.py), with this benchmark's own defaults; read them back with
    `engine_config_from_args(args)`, plus `.replace(...)` for what the benchmark varies."""
    from pagedserve.tools.engine_args import add_engine_args

    add_engine_args(ap)
    ap.set_defaults(**defaults)


def refuse_engine_flags(ap: argparse.ArgumentParser, args: argparse.Namespace, taken: Sequence[str],
                        where: str) -> None:
    """Exit with a usage error naming every engine flag given but not in `taken` (EngineConfig keys):
    a benchmark whose child processes take only some flags must not ignore the others silently."""
    from pagedserve.tools.engine_args import ENGINE_FLAGS

    unused = [f"--{key.replace('_', '-')}" for key in ENGINE_FLAGS
              if key not in taken and getattr(args, key) is not None]
    unused += ["--engine-config"] * bool(args.engine_config)
    if unused:
        ap.error(f"{', '.join(unused)}: not passed on; {where}, which take only "
                 f"{', '.join('--' + k.replace('_', '-') for k in taken)}")


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """--workload and --num-requests, the same in every benchmark."""
    ap.add_argument("--workload", default=str(W64),
                    help=f"workload JSON, or {GENERATED!r} for the seeded generated one tokenized with the model's "
                         f"tokenizer (default: the reference workload {W64.relative_to(DATA_DIR.parents[1])}, "
                         "SmolLM2 token ids)")
    ap.add_argument("--num-requests", type=int, default=None, help="use only the first N requests")


def load_workload(path: str | Path | None, tokenizer: Any, verbose: bool = True) -> Workload:
    """The workload in `path` (JSON like tests/data/workloads/w64.json), or the seeded generated one
    for None or "generated"."""
    if path is None or str(path) == GENERATED:
        workload = generate_workload(tokenizer)
        if verbose:
            print(f"[workload] generated a seeded workload with the model's tokenizer (the reference file: "
                  f"--workload {W64})")
    else:
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as e:
            raise WorkloadError(f"{p}: cannot read the workload file ({e.strerror}); check --workload") from e
        data = parse_json(text, WorkloadError, str(p), "check --workload")
        requests = parse_workload(data, str(p), _vocab_size(tokenizer))
        workload = Workload(p.name, str(data.get("description", "no description")), requests)
    if verbose:
        print(f"[workload] {workload.summary()}")
    return workload


# -- timing and reporting ---------------------------------------------------------------------------
class Timer:
    """`with Timer() as t: ...` then `t.elapsed` (seconds, perf_counter)."""

    def __enter__(self) -> "Timer":
        self.start = time.perf_counter()
        self.elapsed = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.elapsed = time.perf_counter() - self.start


@dataclass
class RunResult:
    """One system's timed run over a workload. `output_tokens` counts useful tokens only."""

    system: str
    wall_s: float
    prompt_tokens: int
    output_tokens: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s if self.wall_s > 0 else float("nan")


def environment_line() -> str:
    import torch
    return (f"[env] python {platform.python_version()}, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, {platform.machine()}, cuda={torch.cuda.is_available()}")


def print_result(r: RunResult) -> None:
    extra = "".join(f", {k}={v}" for k, v in r.extra.items())
    print(f"[{r.system}] wall {r.wall_s:.2f}s, output {r.output_tokens_per_s:.1f} tok/s "
          f"({r.output_tokens} useful output tokens), prompt {r.prompt_tokens} tokens, "
          f"prompt+output {r.total_tokens_per_s:.1f} tok/s{extra}")


def print_summary(results: Sequence[RunResult]) -> None:
    """A fixed-width table: one row per system."""
    print(f"{'system':<26}{'wall s':>10}{'out tok/s':>12}{'prompt tok':>12}{'out tok':>10}")
    for r in results:
        print(f"{r.system:<26}{r.wall_s:>10.2f}{r.output_tokens_per_s:>12.1f}"
              f"{r.prompt_tokens:>12}{r.output_tokens:>10}")


def ratio_line(ours: RunResult, peer: RunResult) -> str:
    """The fixed last line every benchmark prints, e.g. `ratio pagedserve/transformers_static: 3.41x`."""
    return f"ratio {ours.system}/{peer.system}: {ours.output_tokens_per_s / peer.output_tokens_per_s:.2f}x"
