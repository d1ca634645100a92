"""Two `pagedserve kserve` replicas behind a real vllm-router (PyPI's, cache-aware policy), driven with
the openai SDK at the router's port as a client would (docs/replicas.md).

Where a request landed is read from the replicas themselves: each one's `vllm:request_success_total`
(the one that served it moves by one) and `vllm:prefix_cache_hits_total` (only the replica holding
the prefix moves, by exactly the request's `usage.prompt_tokens_details.cached_tokens`).

1. Requests that share a long prefix land on the replica that already holds it. This is the router's
   doing, not chance: with both replicas idle, a request whose prefix neither holds goes to the
   first replica in the router's list, so the second group's prefix is first sent while the first
   replica is busy (a long stream), and every later request of that group, sent while both are
   idle, must still land on the second replica.
2. One replica killed mid-run: the router sends the rest to the other and no request hangs (each
   gets an answer or a 5xx error within the client's timeout).

Allowed to be slow (two servers and a router); the figures are printed (pytest -s) for the docs.
"""

from __future__ import annotations

import platform
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.harness.router_launch import start_router
from tests.kserve_server import scrape, start_server, with_chat_template

if not (sys.platform == "linux" and platform.machine() == "x86_64"):
    pytest.importorskip("vllm_router", reason="vllm-router ships wheels for Linux x86_64 only")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODEL = "tiny"
BLOCK = 16  # KV block size: the prefix cache shares whole blocks
PREFIXES = {  # two long shared prefixes (~290 tokens each with the tiny model's tokenizer)
    "A": "Agent A's standing instructions. " + " ".join(f"alpha{i}" for i in range(40)),
    "B": "Agent B's standing instructions. " + " ".join(f"omega{i}" for i in range(40)),
}
LONG_TOKENS = 640
"""Tokens of each of the 16 samples of the request that keeps one replica busy (within the tiny model's
1024-token context with the prefix)."""
ROUNDS = 4
CLIENT_TIMEOUT_S = 60.0
"""The bound on every request in the kill test: an answer or an error before it, never a hang."""
FIGURES: dict[str, object] = {}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    return with_chat_template(tiny_model_dir("llama"), tmp_path_factory.mktemp("router") / "tiny-chat")


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("router-logs")
    replicas = {}
    try:
        for name in ("r0", "r1"):
            replicas[name] = start_server(model_dir, logs / f"{name}.log", MODEL, timeout=600)
        router = start_router([replicas["r0"].url, replicas["r1"].url], logs / "router.log")
    except BaseException:
        for srv in replicas.values():
            srv.stop()
        raise
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="unused", max_retries=0, timeout=CLIENT_TIMEOUT_S)
    yield replicas, router, client
    router.stop()
    for srv in replicas.values():
        srv.stop()
    if FIGURES:
        print("\nrouter figures:", FIGURES)


def counters(replicas) -> dict[str, tuple[float, float] | None]:
    """replica -> (requests finished, prefix-cache hit tokens); None for a replica that is gone."""
    out: dict[str, tuple[float, float] | None] = {}
    for name, srv in replicas.items():
        if srv.proc.poll() is not None:
            out[name] = None
            continue
        samples = scrape(srv.url)
        done = sum(v for (n, _), v in samples.items() if n == "vllm:request_success_total")
        hits = sum(v for (n, _), v in samples.items() if n == "vllm:prefix_cache_hits_total")
        out[name] = (done, hits)
    return out


def moved(before, after) -> dict[str, tuple[float, float]]:
    return {n: (after[n][0] - before[n][0], after[n][1] - before[n][1]) for n in before if after.get(n)}


def ask(client, group: str, suffix: str, **kw):
    """Group A asks on /v1/completions, group B on /v1/chat/completions (the prefix as system
    message): both routes and both of the router's prefix paths (prompt text, chat messages)."""
    if group == "A":
        return client.completions.create(model=MODEL, prompt=f"{PREFIXES['A']} {suffix}", temperature=0, **kw)
    return client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": PREFIXES["B"]},
                                                                 {"role": "user", "content": suffix}], **kw)


def wait_running(replicas, timeout: float = 60.0) -> str:
    """The replica whose engine is running a request (polled on /metrics)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, srv in replicas.items():
            if any(v > 0 for (n, _), v in scrape(srv.url).items() if n == "vllm:num_requests_running"):
                return name
        time.sleep(0.05)
    raise AssertionError(f"no replica started the long request within {timeout} s")


def prefix_tokens(replica, group: str) -> int:
    r = httpx.post(f"{replica.url}/tokenize", json={"prompt": PREFIXES[group]}, timeout=30)
    return r.json()["count"]


def test_requests_sharing_a_prefix_land_on_the_replica_that_holds_it(cluster):
    replicas, _router, client = cluster
    c0 = counters(replicas)
    # A long request of group A keeps one replica busy (the router counts it as that replica's load
    # until its answer is through) while group B's first request is routed.
    busy: list[object] = []
    worker = threading.Thread(target=lambda: busy.append(ask(client, "A", "start", max_tokens=LONG_TOKENS, n=16,
                                                             extra_body={"ignore_eos": True})))
    started = time.monotonic()
    worker.start()
    home_a = wait_running(replicas)
    first_b = ask(client, "B", "start", max_tokens=2)
    b_answered_s = time.monotonic() - started
    a_still_running = worker.is_alive()
    c1 = counters(replicas)
    worker.join(timeout=CLIENT_TIMEOUT_S * 4)
    busy_s = time.monotonic() - started
    assert busy and not worker.is_alive(), "the long group-A request never answered"
    assert a_still_running, ("the long group-A request had finished before group B's first request was "
                             "answered: the router may have seen two idle replicas; make LONG_TOKENS larger")
    served_b = [n for n, (done, _) in moved(c0, c1).items() if done]
    assert served_b and home_a not in served_b, f"group B's first request landed beside busy group A: {moved(c0, c1)}"
    home = {"A": home_a, "B": served_b[0]}
    assert first_b.usage.prompt_tokens_details.cached_tokens == 0

    landed = {"A": {n: 0 for n in replicas}, "B": {n: 0 for n in replicas}}
    cached = {"A": [], "B": []}
    for i in range(ROUNDS):
        for group in ("A", "B"):
            before = counters(replicas)
            out = ask(client, group, f"question {i}", max_tokens=4)
            delta = moved(before, counters(replicas))
            where = [n for n, (done, _) in delta.items() if done]
            assert len(where) == 1, delta
            landed[group][where[0]] += 1
            hit = out.usage.prompt_tokens_details.cached_tokens
            cached[group].append(hit)
            other = next(n for n in replicas if n != home[group])
            assert where == [home[group]], f"group {group} round {i} landed on {where}, its prefix is on {home}"
            assert delta[other][1] == 0, f"the replica without group {group}'s prefix hit its cache: {delta}"
            assert delta[home[group]][1] == hit  # the replica's counter agrees with the usage it reported
            assert hit >= (prefix_tokens(replicas[home[group]], group) // BLOCK - 1) * BLOCK, (group, i, hit)
    FIGURES["prefix"] = {"requests": 2 + 2 * ROUNDS, "home": home, "landed": landed,
                         "first_b_answered_s": round(b_answered_s, 2), "busy_request_s": round(busy_s, 2),
                         "cached_tokens": cached, "hits": {n: c for n, c in counters(replicas).items()}}


def test_a_replica_killed_mid_run_sends_the_rest_to_the_other(cluster):
    """Must run last in this module: it kills a replica of the shared cluster."""
    replicas, router, client = cluster
    before = counters(replicas)
    ask(client, "A", "locate", max_tokens=1)
    after = counters(replicas)
    victim = next(n for n, (done, _) in moved(before, after).items() if done)  # holds group A's prefix
    survivor = next(n for n in replicas if n != victim)

    results: list[tuple[int, float, float, object]] = []  # (i, started, finished, usage or exception)
    lock = threading.Lock()

    def one(i: int) -> None:
        started = time.monotonic()
        try:
            res: object = ask(client, "A", f"kill test {i}", max_tokens=32, extra_body={"ignore_eos": True}).usage
        except Exception as exc:  # noqa: BLE001 - recorded and judged below
            res = exc
        with lock:
            results.append((i, started, time.monotonic(), res))

    total, kill_after = 16, 4
    survivor_before = counters(replicas)[survivor]
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(one, i) for i in range(total)]
        while len(results) < kill_after:
            time.sleep(0.01)
        replicas[victim].proc.kill()
        killed_at = time.monotonic()
        for f in futures:
            f.result(timeout=CLIENT_TIMEOUT_S * total)
    survivor_after = counters(replicas)[survivor]

    assert len(results) == total
    failed = [(i, r) for i, _s, _f, r in results if isinstance(r, Exception)]
    for i, exc in failed:  # at most the requests in flight at the kill, each with a clear 5xx
        assert isinstance(exc, openai.APIStatusError) and exc.status_code >= 500, (i, repr(exc))
    assert len(failed) <= 2, failed
    slowest = max(f - s for _i, s, f, _r in results)
    assert slowest < CLIENT_TIMEOUT_S
    ok_after_kill = sum(1 for _i, _s, f, r in results if not isinstance(r, Exception) and f > killed_at)
    # The survivor served the rest: every request but the 4 answered before the kill (all on the
    # victim, which held the prefix) and at most the 2 in flight when it died.
    by_survivor = survivor_after[0] - survivor_before[0]
    assert total - kill_after - 2 <= by_survivor <= total - kill_after, (by_survivor, ok_after_kill)
    # and the survivor now holds the prefix: the next requests hit its cache
    follow_up = [ask(client, "A", f"after {i}", max_tokens=2).usage.prompt_tokens_details.cached_tokens
                 for i in range(3)]
    assert all(hit > 0 for hit in follow_up), follow_up
    # the router took the dead replica out: ready on the one left (/health, which wants every worker,
    # is 503 now; deploy/router probes /readiness for that reason)
    ready = httpx.get(f"{router.url}/readiness", timeout=10)
    assert ready.status_code == 200 and ready.json()["healthy_workers"] == 1, ready.text
    assert httpx.get(f"{router.url}/health", timeout=10).status_code == 503
    FIGURES["kill"] = {"requests": total, "killed": victim, "killed_after": kill_after,
                       "answered": total - len(failed),
                       "errors": [f"{r.status_code}: {r.response.text[:200]} (sent {s - killed_at:+.2f} s "
                                  "from the kill)" for _i, s, _f, r in results if isinstance(r, Exception)],
                       "answered_after_kill": ok_after_kill, "served_by_survivor": by_survivor,
                       "slowest_s": round(slowest, 2), "follow_up_cached_tokens": follow_up}
