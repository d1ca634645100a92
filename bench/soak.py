"""A bounded soak of a real `pagedserve kserve` server: abuse and overload for a few minutes, then
check that nothing leaked and nothing hung.

    python -m bench.soak [--model default] [--duration 180] [--concurrency 8] [--seed 0]
                         [--max-num-seqs 8] [--max-waiting-requests 8] [--num-kv-blocks 512]
                         [--warmup-requests 300] [--sample-every 2]

What it does. The server runs in a subprocess (bench and server compete for the same CPUs) with a
fixed KV pool (--num-kv-blocks) and a small waiting-queue bound. `--concurrency` clients loop until
the duration is over, each request drawn at random:

* stream (50%): a streamed completion, random prompt (5-300 words, fitting max_model_len) and
  max_tokens (1-64);
* whole (10%): the same, not streamed;
* cancel (15%): a stream the client drops after a random number of deltas;
* deadline (10%): a stream with X-Request-Timeout 0.05-1 s (finish_reason "timeout" or done);
* malformed (15%): bad JSON, a wrong type, an out-of-range value, an unknown model, a 9 MB body,
  a prompt longer than max_model_len, a bad X-Request-Timeout: each must get its 4xx.

Halfway through, one burst of max_num_seqs + max_waiting_requests + 16 streams arrives at once:
the ones past the queue bound must be refused at once (429), not queued.

At the end it waits for the server to go idle and prints: requests served, refused (429/503),
cancelled, timed out, errors by kind, leaked KV blocks (kv_cache_usage_perc x the pool; must be
0), requests that hung (no answer within --request-limit; must be 0; each is printed with how far
it got, then followed for another limit and reported "answered late" (slow: a starved host) or
"still no answer" (stuck)), the server's RSS (below),
p50/p99 TTFT and inter-token latency seen by the clients. Exit status 1 if anything leaked or
hung, RSS grew after warm-up, or a request got an answer it should not have.

RSS. The server's RSS is sampled every --sample-every seconds against the requests answered so far
(also written to rss.csv beside the server log while it runs). Two kinds of growth look alike in
a start-to-end difference and are told apart here:

* a high-water mark, which stops: the KV pool is allocated untouched and its pages become resident
  as blocks are first written (the LRU free queue cycles through all of them within the first
  tens of requests), and the C heap, oneDNN's bounded primitive caches and the Python heap grow to
  what the largest batch, the 9 MB bodies and the burst need, then are reused;
* a leak, which grows with every request (per-request state, caches, label sets, tasks).

So RSS before the first request is only reported; the bound starts after warm-up: the first
--warmup-requests requests (a quarter of the run's requests when it answered fewer than four
times that, as on a slow host). RSS at warm-up is the baseline; the end and the peak after it may
exceed it by at most RSS_SLACK_MIB, and the least-squares slope of RSS over requests after warm-up
is printed in MiB per 1,000 requests (a leak of 1 KiB per request is ~1 MiB per 1,000). The
former bound, the whole start-to-end growth against the KV pool + 64 MiB, failed on a host where
the start-to-end growth was 270 MiB (issue 29) although the growth was a high-water mark.
tests/test_per_request_state.py checks the per-request structures themselves, by name.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.common import FALLBACK_TEXT, add_engine_flags
from bench.rss_trend import MIB, RssSampler, rss_bytes, trace, trend_after_warmup
from tests.harness.kserve_launch import start_kserve

MODEL_NAME = "soak"
WORDS = FALLBACK_TEXT.split()
RSS_SLACK_MIB = 64
"""RSS growth allowed after warm-up (see RSS in the module docstring): glibc's heap is not
compacted, so a later batch shape or body size can still add a little to the high-water mark;
a leak of a few KiB per request exceeds it within some 10,000 requests."""
MALFORMED = ("bad_json", "wrong_type", "out_of_range", "unknown_model", "huge_body", "too_long", "bad_timeout")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_engine_flags(p, model="default", dtype="auto", max_num_seqs=8, max_waiting_requests=8, max_model_len=1024)
    p.add_argument("--duration", type=float, default=180.0, help="seconds of load")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-kv-blocks", type=int, default=512)
    p.add_argument("--sample-every", type=float, default=2.0, help="seconds between RSS samples")
    p.add_argument("--warmup-requests", type=int, default=300,
                   help="requests after which RSS must stay flat (a quarter of the run's requests if fewer)")
    p.add_argument("--request-limit", type=float, default=300.0, help="a request not answered within this hung")
    return p


@dataclass
class Track:
    """How far one request got, so a hung one can be told apart: never answered, answered and then
    silent, or still streaming (slow, not hung)."""

    kind: str
    started: float
    status: int | None = None
    deltas: int = 0
    last_progress: float = 0.0
    """time.monotonic() of the last thing the server sent (headers or a delta)."""
    completion_id: str | None = None
    finish: str | None = None

    def describe(self, began: float) -> str:
        now = time.monotonic()
        return (f"{self.kind} sent at {self.started - began:.1f} s: status {self.status}, {self.deltas} deltas, "
                f"last progress {now - self.last_progress:.1f} s ago, finish {self.finish}, id {self.completion_id}")


async def sse_lines(resp: httpx.Response):
    """The lines of an event stream, split where SSE splits them: at CR, LF or CRLF only.
    httpx's aiter_lines splits like str.splitlines, also at U+0085, U+2028 and U+2029, which JSON
    leaves unescaped inside a string: a random model's text holding one cut an event in two."""
    pending = b""
    async for chunk in resp.aiter_bytes():
        pending += chunk
        *lines, pending = pending.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        for line in lines:
            yield line.decode()
    if pending:
        yield pending.decode()


class Soak:
    def __init__(self, url: str, args: argparse.Namespace, count_tokens) -> None:
        self.url, self.args, self.count_tokens = url, args, count_tokens
        self.counts: Counter = Counter()
        self.errors: Counter = Counter()
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.hung: list[str] = []
        """What each request that hung had seen (Track.describe), and then how it ended."""
        self.late: list[asyncio.Task] = []
        self.began = time.monotonic()

    # -- one request ---------------------------------------------------------------------------
    def _prompt(self, rng: random.Random) -> str:
        """5-300 words that fit max_model_len with 64 tokens to spare (too long is the malformed
        kind's business, not this one's)."""
        n, start = rng.randint(5, 300), rng.randrange(len(WORDS))
        while True:
            prompt = " ".join(WORDS[(start + i) % len(WORDS)] for i in range(n))
            if n <= 5 or self.count_tokens(prompt) + 64 < self.args.max_model_len:
                return prompt
            n //= 2

    async def _stream(self, client: httpx.AsyncClient, body: dict, headers: dict | None = None,
                      drop_after: int | None = None, track: Track | None = None) -> None:
        sent = time.monotonic()
        track = track or Track("stream", sent)
        last, finish = None, None
        async with client.stream("POST", f"{self.url}/openai/v1/completions", json={**body, "stream": True},
                                 headers=headers) as resp:
            track.status, track.last_progress = resp.status_code, time.monotonic()
            if resp.status_code != 200:
                await resp.aread()
                return self._status(resp)
            deltas = 0
            async for line in sse_lines(resp):
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    self.errors[f"stream:{chunk['error'].get('code') or chunk['error'].get('type')}"] += 1
                    return
                now = time.monotonic()
                (self.ttft if last is None else self.itl).append(now - (sent if last is None else last))
                last, deltas = now, deltas + 1
                finish = chunk["choices"][0]["finish_reason"] or finish
                track.deltas, track.last_progress, track.finish = deltas, now, finish
                track.completion_id = chunk.get("id")
                if drop_after is not None and deltas >= drop_after:
                    self.counts["cancelled"] += 1
                    return  # leaving the block closes the connection: the server aborts the request
        self.counts["timed_out" if finish == "timeout" else "served"] += 1

    async def _whole(self, client: httpx.AsyncClient, body: dict, track: Track) -> None:
        resp = await client.post(f"{self.url}/openai/v1/completions", json=body)
        track.status, track.last_progress = resp.status_code, time.monotonic()
        if resp.status_code != 200:
            return self._status(resp)
        self.counts["served"] += 1

    def _status(self, resp: httpx.Response) -> None:
        if resp.status_code in (429, 503):
            assert resp.headers.get("retry-after"), f"{resp.status_code} without Retry-After"
            self.counts[f"refused_{resp.status_code}"] += 1
        else:
            self.errors[f"unexpected_{resp.status_code}:{resp.text[:80]}"] += 1

    async def _malformed(self, client: httpx.AsyncClient, kind: str) -> None:
        url, ok = f"{self.url}/openai/v1/completions", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
        headers, content, expect = None, None, 400
        if kind == "bad_json":
            content, expect = b'{"model": "soak", "prompt": ', (400, 422)
        elif kind == "wrong_type":
            content = json.dumps({**ok, "temperature": "hot"}).encode()
        elif kind == "out_of_range":
            content = json.dumps({**ok, "max_tokens": -1}).encode()
        elif kind == "unknown_model":
            content, expect = json.dumps({**ok, "model": "nope"}).encode(), 404
        elif kind == "huge_body":
            content, expect = json.dumps({**ok, "prompt": "a" * (9 * 2**20)}).encode(), 413
        elif kind == "too_long":
            content = json.dumps({**ok, "prompt": "a" * (20 * self.args.max_model_len * 8)}).encode()
        else:
            content, headers = json.dumps(ok).encode(), {"X-Request-Timeout": "-3"}
        resp = await client.post(url, content=content, headers={"Content-Type": "application/json", **(headers or {})})
        expected = expect if isinstance(expect, tuple) else (expect,)
        if resp.status_code in expected and "error" in resp.json():
            self.counts["malformed_rejected"] += 1
        elif resp.status_code in (429, 503):
            self._status(resp)
        else:
            self.errors[f"malformed_{kind}_got_{resp.status_code}"] += 1

    async def one(self, client: httpx.AsyncClient, rng: random.Random) -> None:
        body = {"model": MODEL_NAME, "prompt": self._prompt(rng), "max_tokens": rng.randint(1, 64),
                "temperature": rng.choice([0.0, 0.8])}
        kind = rng.choices(["stream", "whole", "cancel", "deadline", "malformed"], [50, 10, 15, 10, 15])[0]
        track = Track(kind, time.monotonic())
        malformed = rng.choice(MALFORMED) if kind == "malformed" else None
        if malformed:
            track.kind = f"malformed:{malformed}"
        coro = {"stream": lambda: self._stream(client, body, track=track),
                "whole": lambda: self._whole(client, body, track),
                "cancel": lambda: self._stream(client, {**body, "max_tokens": 64}, drop_after=rng.randint(1, 8),
                                               track=track),
                "deadline": lambda: self._stream(client, {**body, "max_tokens": 64},
                                                 headers={"X-Request-Timeout": f"{rng.uniform(0.05, 1.0):.2f}"},
                                                 track=track),
                "malformed": lambda: self._malformed(client, malformed)}[kind]
        task = asyncio.ensure_future(coro())
        try:
            done, _ = await asyncio.wait({task}, timeout=self.args.request_limit)
            if not done:  # hung: say how far it got, and whether it ends at all (slow, or stuck)
                self.errors["hung"] += 1
                self.hung.append(track.describe(self.began))
                print(f"[soak] hung: {self.hung[-1]}", flush=True)
                self.late.append(asyncio.ensure_future(self._late(task, track)))
                return
            task.result()
        except httpx.HTTPError as exc:
            self.errors[f"transport:{type(exc).__name__}"] += 1
        except Exception as exc:  # noqa: BLE001 - a bad answer is counted, not the end of the soak
            self.errors[f"client:{type(exc).__name__}"] += 1
            print(f"[soak] {track.kind}: {exc!r}", flush=True)

    async def _late(self, task: asyncio.Task, track: Track) -> None:
        """Wait up to another request limit for a hung request, and say whether it ended."""
        done, _ = await asyncio.wait({task}, timeout=self.args.request_limit)
        outcome = "still no answer; cancelled" if not done else (
            f"answered late: {task.exception()!r}" if task.exception() else "answered late")
        if not done:
            task.cancel()
        self.hung.append(f"  -> {outcome} ({track.describe(self.began)})")
        print(f"[soak] hung, {outcome}: {track.describe(self.began)}", flush=True)

    # -- load ----------------------------------------------------------------------------------
    async def client_loop(self, seed: int, until: float) -> None:
        rng = random.Random(seed)
        async with httpx.AsyncClient(timeout=None) as client:
            first_late = len(self.late)
            while time.monotonic() < until:
                await self.one(client, rng)
            # Closing the client closes the connections of its hung requests still followed: wait
            # for them first (a closed connection reads as ReadError, not as the server's answer).
            await asyncio.gather(*self.late[first_late:])

    async def burst(self, at: float) -> Counter:
        await asyncio.sleep(max(at - time.monotonic(), 0))
        n = self.args.max_num_seqs + self.args.max_waiting_requests + 16
        before = Counter(self.counts)
        limits = httpx.Limits(max_connections=n + 4)
        async with httpx.AsyncClient(timeout=None, limits=limits) as client:
            body = {"model": MODEL_NAME, "prompt": " ".join(WORDS[:40]), "max_tokens": 16}
            await asyncio.gather(*(asyncio.wait_for(self._stream(client, body), self.args.request_limit)
                                   for _ in range(n)), return_exceptions=True)
        return Counter({k: self.counts[k] - before[k] for k in self.counts})

    def requests_done(self) -> int:
        return sum(self.counts.values()) + sum(self.errors.values())

    async def run(self, rss: RssSampler) -> Counter:
        start = self.began = time.monotonic()
        until = start + self.args.duration
        clients = [self.client_loop(self.args.seed * 1000 + i, until) for i in range(self.args.concurrency)]
        burst = asyncio.ensure_future(self.burst(start + self.args.duration / 2))
        sampler = asyncio.ensure_future(rss.run(until))
        await asyncio.gather(*clients)
        await sampler
        await asyncio.gather(*self.late)
        return await burst


def scrape(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name.startswith("pagedserve:") and s.labels.get("model") == MODEL_NAME and len(s.labels) == 2}


def kv_pool_bytes(model_dir: Path, num_blocks: int, block_size: int, dtype_bytes: int) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * block_size * num_blocks * dtype_bytes


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(int(q * len(values)), len(values) - 1)]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from pagedserve.core.models.default_model import resolve_model_path
    from pagedserve.tools.engine_args import engine_config_from_args

    model_dir = Path(resolve_model_path(args.model))
    # fails here, with the field named, if a value is wrong
    config = engine_config_from_args(args).replace(model=str(model_dir), num_kv_blocks=args.num_kv_blocks)
    settings = config.to_dict()
    tmp = Path(tempfile.mkdtemp(prefix="pagedserve-soak-"))
    (tmp / "engine.json").write_text(json.dumps(settings))
    print(f"[soak] model {model_dir}, {args.duration:g} s, {args.concurrency} clients, seed {args.seed}, "
          f"max_num_seqs {args.max_num_seqs}, max_waiting_requests {args.max_waiting_requests}, "
          f"{args.num_kv_blocks} KV blocks; server log {tmp / 'server.log'}, RSS samples {tmp / 'rss.csv'}", flush=True)
    srv = start_kserve(model_dir, tmp / "server.log", MODEL_NAME, args=("--engine-config", str(tmp / "engine.json")),
                       env={"TOKENIZERS_PARALLELISM": "false"}, timeout=600)
    try:
        rss_start = rss_bytes(srv.proc.pid)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        soak = Soak(srv.url, args, lambda text: len(tokenizer(text).input_ids))
        rss = RssSampler(srv.proc.pid, soak.requests_done, args.sample_every, tmp / "rss.csv")
        began = time.monotonic()
        burst = asyncio.run(soak.run(rss))
        elapsed = time.monotonic() - began
        deadline = time.monotonic() + 60
        while True:  # idle: nothing running or waiting (a stream the client dropped is aborted within a step)
            snap = scrape(srv.url)
            if snap.get("pagedserve:num_requests_running") == 0 and snap.get("pagedserve:num_requests_waiting") == 0:
                break
            if time.monotonic() > deadline:
                soak.errors["not_idle_60s_after_the_end"] += 1
                break
            time.sleep(0.25)
        leaked = round(snap.get("pagedserve:kv_cache_usage_perc", 0.0) * args.num_kv_blocks)
        rss_end = rss_bytes(srv.proc.pid)
        alive = srv.proc.poll() is None
    finally:
        srv.stop()
    dtype_bytes = 4 if str(config.model.dtype).endswith("float32") else 2
    kv_bytes = kv_pool_bytes(model_dir, args.num_kv_blocks, config.cache.block_size, dtype_bytes)
    total = sum(soak.counts.values()) + sum(soak.errors.values())
    mib = MIB
    print(f"[soak] {total} requests in {elapsed:.0f} s: " + ", ".join(f"{k} {v}" for k, v in sorted(soak.counts.items())))
    print(f"[soak] while the burst of {args.max_num_seqs + args.max_waiting_requests + 16} ran (all clients): "
          + ", ".join(f"{k} {v}" for k, v in sorted(burst.items()) if v))
    print(f"[soak] errors by kind: {dict(soak.errors) or 'none'}")
    print(f"[soak] engine: {snap.get('pagedserve:engine_step_failures_total', 0):.0f} step failures; "
          f"server alive at the end: {alive}")
    print(f"[soak] leaked KV blocks: {leaked}; hung requests: {soak.errors['hung']}")
    for line in soak.hung:
        print(f"[soak]   hung: {line}")
    trend = trend_after_warmup(rss.samples, args.warmup_requests)
    print(f"[soak] RSS MiB by requests answered: {trace(rss.samples)}")
    if trend is None:
        print("[soak] RSS: no sample after warm-up (no request answered?)")
    else:
        print(f"[soak] RSS before the first request {rss_start / mib:.0f} MiB, after warm-up ({trend.warmup_requests} "
              f"requests) {trend.at_warmup.rss / mib:.0f} MiB (+{(trend.at_warmup.rss - rss_start) / mib:.0f}: the KV "
              f"pool, {kv_bytes / mib:.0f} MiB, is touched as blocks are first used, and the heap reaches its "
              f"high-water mark), peak after warm-up {trend.peak_after / mib:.0f} MiB, at the end {rss_end / mib:.0f} MiB")
        print(f"[soak] RSS growth after warm-up {trend.growth_after / mib:+.0f} MiB (allowed {RSS_SLACK_MIB} MiB); "
              f"slope {trend.slope:+.2f} MiB per 1,000 requests over requests {trend.at_warmup.requests}-"
              f"{trend.end.requests}")
    print(f"[soak] TTFT p50 {pct(soak.ttft, 0.5) * 1e3:.0f} ms, p99 {pct(soak.ttft, 0.99) * 1e3:.0f} ms; "
          f"inter-token p50 {pct(soak.itl, 0.5) * 1e3:.0f} ms, p99 {pct(soak.itl, 0.99) * 1e3:.0f} ms "
          f"({len(soak.ttft)} streams, {len(soak.itl)} gaps)")
    bad = (leaked or soak.errors["hung"] or any(not k.startswith("stream:") for k in soak.errors)
           or not burst.get("refused_429") or trend is None or trend.growth_after > RSS_SLACK_MIB * mib or not alive)
    print(f"[soak] {'FAIL' if bad else 'PASS'}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
