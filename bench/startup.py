"""Start-up and footprint of the two launchers, as a user runs them: `pagedserve triton` and
`pagedserve kserve` started as commands, timed from the command to READY and to the first token,
with the resident memory of the whole process tree sampled throughout.

    python -m bench.startup [--launcher triton|kserve|both] [--workload PATH] [--num-requests N]
                            [--no-workload] [--breakdown] [--model default]

Per launcher, in this order (one launcher at a time, never two servers at once):

1. the command starts (`<venv>/bin/pagedserve triton|kserve` on loopback free ports); the clock starts;
2. READY: the model's `/v2/models/<name>/ready` answers 200 (polled every 50 ms);
3. first token: one streaming request (Triton `generate_stream`, KServe OpenAI completions with
   `stream: true`) sent at READY; the clock stops at its first streamed token;
4. unless --no-workload: the workload (bench/common.py: the reference w64.json unless --workload
   names another file or `generated`) sent all at once, non-streaming, one HTTP client thread per request;
5. 2 s idle (the engine hands freed heap back on going idle), the last RSS sample; the server is
   stopped as Ctrl-C / SIGTERM would.

RSS is summed over the launcher's whole process tree (pagedserve, tritonserver and its Python
backend stubs; the kserve server) from /proc every 100 ms: the peak until the first token, the
peak over the whole run, and the value at the end. Shared pages count once per process (what `ps`
and the kernel's OOM accounting see). The CPU time the tree used until READY is printed beside the
wall time: on a busy machine it, unlike wall time, does not grow with other processes' work.

--breakdown also times the pieces in fresh interpreters (imports, the C++ kernel load, the engine's
own phases, a bare tritonserver with no model) so the totals can be read; beside each wall time, the
CPU time that process used for it (all its threads). It also splits the final RSS of each process
over 100 MiB by kind of mapping (bench/proctree.memory_breakdown): anonymous mappings of 1 GiB+
(the KV pool, unless other mappings split it), the heap, other anonymous memory (weights, malloc
arenas, Python) and the libraries mapped from files.

vLLM's CPU figures printed for comparison are the ones in issue 15, measured on that issue's host,
not in this run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import add_workload_args, environment_line, load_workload
from bench.proctree import memory_breakdown, process_tree, tree_cpu_seconds, tree_rss
from tests.harness.local_ports import free_ports

PROMPT = "What is a paged KV cache?"
MODEL_NAME = "pagedserve"
SETTLE_S = 2.0
"""Idle seconds before the final RSS sample."""
VLLM_FROM_ISSUE = "vLLM CPU build (issue 15's figures, measured on that issue's host, not here): " \
                  "60-90 s to load, 4.8-5.4 GB peak RSS"


# -- the process tree's memory ----------------------------------------------------------------------
class RssSampler(threading.Thread):
    """Samples the tree's RSS every `interval`; also notices when this process was not scheduled
    for a while (`stalled_s`): a benchmark that stops other processes (SIGSTOP) to get a quiet
    machine would otherwise silently add its pause to every wall time measured here."""

    def __init__(self, root: int, interval: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.root, self.interval = root, interval
        self.peak, self.peak_parts, self.last, self.last_parts = 0, {}, 0, {}
        self.stalled_s = 0.0
        self.done = threading.Event()

    def sample(self) -> int:
        total, parts = tree_rss(self.root)
        self.last, self.last_parts = total, parts
        if total > self.peak:
            self.peak, self.peak_parts = total, parts
        return total

    def run(self) -> None:
        last = time.monotonic()
        while not self.done.is_set():
            self.sample()
            self.done.wait(self.interval)
            now = time.monotonic()
            self.stalled_s += max(0.0, now - last - 1.0)  # far beyond the interval: we were stopped
            last = now


# -- talking to the servers (plain HTTP, stdlib only) -----------------------------------------------
def _post(url: str, body: dict, timeout: float = 1800.0):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


@dataclass
class Launcher:
    name: str
    http_port: int
    args: list[str]
    stop_signal: signal.Signals

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def ready_url(self) -> str:
        return f"{self.base}/v2/models/{MODEL_NAME}/ready"

    def first_token(self) -> float:
        """One streaming request; returns the monotonic time its first token arrived, after
        reading the stream to its end (a stream closed early is a cancellation, and tritonserver
        2.51 has crashed on shutdown after those)."""
        if self.name == "triton":
            url, body = f"{self.base}/v2/models/{MODEL_NAME}/generate_stream", {
                "text_input": PROMPT, "stream": True, "parameters": {"max_tokens": 8, "temperature": 0}}
        else:
            url, body = f"{self.base}/openai/v1/completions", {
                "model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}
        first = None
        with _post(url, body, timeout=120) as resp:
            for line in resp:
                if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise RuntimeError(f"{self.name}: first request failed: {event['error']}")
                    first = first or time.monotonic()
        if first is None:
            raise RuntimeError(f"{self.name}: the first request streamed no token")
        return first

    def one(self, prompt: str | list[int], max_tokens: int) -> int:
        """One non-streaming greedy request of the workload; returns the tokens it generated."""
        if self.name == "triton":
            with _post(f"{self.base}/v2/models/{MODEL_NAME}/generate", {
                    "text_input": prompt, "return_num_output_tokens": True, "parameters": {
                        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}}) as resp:
                return int(json.loads(resp.read())["num_output_tokens"])
        with _post(f"{self.base}/openai/v1/completions", {
                "model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}) as resp:
            return int(json.loads(resp.read())["usage"]["completion_tokens"])


def pagedserve_command() -> list[str]:
    script = Path(sys.executable).parent / "pagedserve"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "pagedserve.tools.cli"]


def make_launcher(name: str, model: str) -> Launcher:
    http, grpc, metrics = free_ports(3)
    if name == "triton":
        args = ["triton", "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics)]
        if model != "default":
            args += ["--model", model]
        return Launcher(name, http, args, signal.SIGINT)
    return Launcher(name, http, ["kserve", "--model", model, "--model-name", MODEL_NAME, "--host", "127.0.0.1",
                                 "--http-port", str(http), "--grpc-port", str(grpc)], signal.SIGTERM)


@dataclass
class Figures:
    launcher: str
    ready_s: float = float("nan")
    ready_cpu_s: float = float("nan")
    first_token_s: float = float("nan")
    startup_peak: int = 0
    run_peak: int = 0
    after_workload: int = 0
    after_parts: dict[str, int] = field(default_factory=dict)
    after_memory: dict[str, dict[str, int]] = field(default_factory=dict)
    """With --breakdown: process name -> resident bytes by kind of mapping, at the end."""
    workload_s: float = float("nan")
    workload_tokens: int = 0
    stalled_to_first_token_s: float = 0.0
    stalled_s: float = 0.0


def measure(name: str, model: str, requests, log_dir: Path, timeout: float, memory: bool = False) -> Figures:
    launcher, fig = make_launcher(name, model), Figures(name)
    log_path = log_dir / f"{name}.log"
    with open(log_path, "wb") as log:
        start = time.monotonic()
        proc = subprocess.Popen(pagedserve_command() + launcher.args, stdout=log, stderr=subprocess.STDOUT)
    sampler = RssSampler(proc.pid)
    sampler.start()
    try:
        while _status(launcher.ready_url()) != 200:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}; see {log_path}")
            if time.monotonic() - start > timeout:
                raise RuntimeError(f"{name} not ready after {timeout:.0f}s; see {log_path}")
            time.sleep(0.05)
        fig.ready_s = time.monotonic() - start
        fig.ready_cpu_s = tree_cpu_seconds(proc.pid)
        fig.first_token_s = launcher.first_token() - start
        sampler.sample()
        fig.startup_peak, fig.stalled_to_first_token_s = sampler.peak, sampler.stalled_s
        if requests:
            t0 = time.monotonic()
            with ThreadPoolExecutor(len(requests)) as pool:
                fig.workload_tokens = sum(pool.map(lambda r: launcher.one(*r), requests))
            fig.workload_s = time.monotonic() - t0
        time.sleep(SETTLE_S)  # idle: the engine hands freed heap back (core/heap.py)
        sampler.sample()
        fig.after_workload, fig.after_parts = sampler.last, sampler.last_parts
        if memory:  # where the large processes' memory is, by kind of mapping
            for pid, pname in process_tree(proc.pid):
                kinds = memory_breakdown(pid)
                if sum(kinds.values()) >= 100 << 20:
                    fig.after_memory[pname] = kinds
        fig.run_peak, fig.stalled_s = sampler.peak, sampler.stalled_s
    finally:
        sampler.done.set()
        tree = process_tree(proc.pid)
        proc.send_signal(launcher.stop_signal)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        _reap_leftovers(tree[1:])
    return fig


def _reap_leftovers(tree: list[tuple[int, str]]) -> None:
    """Kill what the server left behind: tritonserver 2.51 can crash while unloading after
    cancelled streams, leaving its Python backend stub running without a parent."""
    time.sleep(1)
    alive = dict(process_tree(1))
    for pid, name in tree:
        if alive.get(pid) != name:  # gone (or the pid now names another program)
            continue
        try:
            os.kill(pid, signal.SIGKILL)
            print(f"[cleanup] killed leftover process {pid} of the server's tree", file=sys.stderr)
        except ProcessLookupError:
            pass


# -- where the time goes ------------------------------------------------------------------------------
_PHASES = r"""
import json, sys, time
t = [("interpreter", time.perf_counter(), time.process_time())]
def mark(name): t.append((name, time.perf_counter(), time.process_time()))
import torch; mark("import torch")
import pagedserve.core.engine; mark("import pagedserve.core.engine")
from pagedserve.kernels.cpu.build import load_extension
try:
    load_extension(); mark("C++ kernel load")
except Exception as exc:
    mark(f"C++ kernel load (failed: {exc})")
from pagedserve.core.config import EngineConfig
from pagedserve.core.engine import LLMEngine
from pagedserve.core.sampling_params import SamplingParams
engine = LLMEngine(EngineConfig.from_dict(json.loads(sys.argv[1]))); mark("LLMEngine()")
engine.generate(["Hello"], SamplingParams(max_tokens=1, temperature=0)); mark("first step (1 token)")
print(json.dumps({"marks": [(n, b - a, cb - ca) for (n, b, cb), (_, a, ca) in zip(t[1:], t)],
                  "engine": getattr(engine, "load_seconds", {})}))
"""


def breakdown(model: str) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    print(f"[breakdown] bare interpreter: {time.monotonic() - t0:.2f}s")
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", _PHASES, json.dumps({"model": model})], env=env, check=True,
                         capture_output=True, text=True).stdout
    total = time.monotonic() - start
    data = json.loads(out.strip().splitlines()[-1])
    for name, seconds, cpu_seconds in data["marks"]:
        print(f"[breakdown]   {name:<34}{seconds:>7.2f}s (CPU {cpu_seconds:.2f}s)")
    for name, seconds in data["engine"].items():
        print(f"[breakdown]     LLMEngine: {name:<23}{seconds:>7.2f}s")
    print(f"[breakdown] engine process total: {total:.2f}s")
    for what, code in (("import kserve (+fastapi, grpc)", "import kserve"),
                       ("import tritonclient-free Triton adapter",
                        "import pagedserve.adapters.triton_server.codec")):
        t0 = time.monotonic()
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
        print(f"[breakdown] {what}: {time.monotonic() - t0:.2f}s (interpreter included)")
    bare_triton()


def bare_triton() -> None:
    """tritonserver on an empty repository: the server's own share of start-up."""
    from pagedserve.adapters.triton_server.launcher import start_server

    http, grpc, metrics = free_ports(3)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "repo").mkdir()
        t0 = time.monotonic()
        server = start_server(Path(tmp) / "repo", http_port=http, grpc_port=grpc, metrics_port=metrics, timeout=60,
                              log_path=Path(tmp) / "tritonserver.log")
        ready = time.monotonic() - t0
        rss, _ = tree_rss(server.process.pid)
        server.stop()
    print(f"[breakdown] tritonserver with no model: ready in {ready:.2f}s, {rss / 2**20:.0f} MiB RSS")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--launcher", choices=("triton", "kserve", "both"), default="both")
    ap.add_argument("--model", default="default", help="local HF directory or 'default' (SmolLM2-135M-Instruct)")
    add_workload_args(ap)
    ap.add_argument("--no-workload", action="store_true", help="only start-up and the first token")
    ap.add_argument("--breakdown", action="store_true", help="also time the pieces of start-up separately")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for READY")
    args = ap.parse_args(argv)
    print(environment_line())
    requests = []
    if not args.no_workload:
        from transformers import AutoTokenizer

        from pagedserve.core.models.default_model import resolve_model_path

        tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model), local_files_only=True)
        workload = load_workload(args.workload, tokenizer).head(args.num_requests)
        requests = [(tokenizer.decode(r.prompt_ids), r.max_new_tokens) for r in workload.requests]
    if args.breakdown:
        breakdown(args.model)
    names = ("triton", "kserve") if args.launcher == "both" else (args.launcher,)
    results = []
    with tempfile.TemporaryDirectory(prefix="pagedserve-startup-") as tmp:
        for name in names:
            fig = measure(name, args.model, requests, Path(tmp), args.timeout, memory=args.breakdown)
            report(fig, len(requests))
            results.append(fig)
    print(f"{'launcher':<10}{'READY s':>9}{'(CPU s)':>9}{'1st token s':>13}{'peak RSS MiB':>14}{'end RSS MiB':>13}")
    for f in results:
        print(f"{f.launcher:<10}{f.ready_s:>9.2f}{f.ready_cpu_s:>9.2f}{f.first_token_s:>13.2f}"
              f"{f.run_peak / 2**20:>14.0f}{f.after_workload / 2**20:>13.0f}")
    print(VLLM_FROM_ISSUE)


def report(fig: Figures, num_requests: int) -> None:
    mib = 2**20
    parts = ", ".join(f"{k} {v / mib:.0f}" for k, v in sorted(fig.after_parts.items(), key=lambda kv: -kv[1]))
    print(f"[{fig.launcher}] READY {fig.ready_s:.2f}s (CPU time of the tree {fig.ready_cpu_s:.2f}s), "
          f"first token {fig.first_token_s:.2f}s, peak RSS to the first token {fig.startup_peak / mib:.0f} MiB", flush=True)
    if num_requests:
        print(f"[{fig.launcher}] workload: {num_requests} requests, {fig.workload_tokens} tokens in "
              f"{fig.workload_s:.1f}s; peak RSS {fig.run_peak / mib:.0f} MiB", flush=True)
    print(f"[{fig.launcher}] RSS at the end (idle {SETTLE_S:.0f}s): {fig.after_workload / mib:.0f} MiB ({parts})",
          flush=True)
    for pname, kinds in fig.after_memory.items():
        print(f"[{fig.launcher}]   {pname}: " + ", ".join(
            f"{kind} {size / mib:.0f}" for kind, size in sorted(kinds.items(), key=lambda kv: -kv[1])), flush=True)
    if fig.stalled_s:
        print(f"[{fig.launcher}] WARNING: this process was stopped for {fig.stalled_s:.1f}s during the run "
              f"({fig.stalled_to_first_token_s:.1f}s before the first token): wall times are not valid", flush=True)


if __name__ == "__main__":
    main()
