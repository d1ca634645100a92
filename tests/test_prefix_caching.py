"""Prefix caching (issue #4), proved: chained SHA-256 block hashes, exact hit counts, LRU eviction,
salts and opt-out, and greedy outputs token-identical with caching on and off (and to transformers)
under shared-prefix workloads with preemption.

Unit tests drive KVCacheManager / BlockPool directly with block_size 4; engine tests run tiny
random-weight models with block_size 16 and hand-computed expectations.
"""

from __future__ import annotations

import hashlib
import struct

import pytest
import torch

from pagedserve.core.config import EngineConfig
from pagedserve.core.engine import LLMEngine
from pagedserve.core.errors import InvalidRequest
from pagedserve.core.kv_cache.manager import KVCacheManager
from pagedserve.core.kv_cache.prefix_hash import ROOT_HASH, extend_block_hashes, hash_block
from pagedserve.core.request import Sample
from pagedserve.core.sampling_params import SamplingParams

from tests.oracle import hf_greedy


# -- helpers -------------------------------------------------------------------------------------------
def req(rid: str, ids: list[int], salt: str | None = None, use: bool = True) -> Sample:
    return Sample(request_id=rid, prompt_token_ids=list(ids), sampling_params=SamplingParams(),
                   eos_token_id=None, max_tokens=8, cache_salt=salt, use_prefix_cache=use)


def admit(kv: KVCacheManager, r: Sample) -> int:
    """What the scheduler does on admission, with the whole prompt in one chunk; returns hit tokens."""
    hits, num_hit = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - num_hit, hits) is not None
    kv.record_prefix_lookup(r, num_hit)
    r.num_computed_tokens = r.num_tokens
    kv.check_invariants()
    return num_hit


def finish(kv: KVCacheManager, r: Sample) -> None:
    kv.free(r)
    kv.forget(r)
    kv.check_invariants()


def admit_and_finish(kv: KVCacheManager, r: Sample) -> int:
    hit = admit(kv, r)
    finish(kv, r)
    return hit


def hashes_of(ids: list[int], block_size: int, salt: str | None = None) -> list[bytes]:
    out: list[bytes] = []
    extend_block_hashes(out, ids, block_size, salt)
    return out


def make_engine(path, **overrides) -> LLMEngine:
    # an explicit pool: the default 2 GiB budget would allocate ~10^5 blocks for these tiny models
    config = {"model": str(path), "dtype": "float32", "block_size": 16, "num_kv_blocks": 256, **overrides}
    return LLMEngine(EngineConfig.from_dict(config))


def rand_ids(n: int, seed: int) -> list[int]:
    return torch.randint(1, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def assert_all_free(engine: LLMEngine) -> None:
    engine.kv_cache_manager.check_invariants()
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks


def run_one(engine: LLMEngine, rid: str, prompt: list[int], n: int, **kw) -> tuple[list[int], dict[str, int]]:
    """Run one request alone to completion; return its tokens and the stat counters it moved."""
    before = _counters(engine)
    engine.add_request(rid, prompt, greedy(n), **kw)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.new_token_ids)
        engine.kv_cache_manager.check_invariants()
    after = _counters(engine)
    return tokens, {k: after[k] - before[k] for k in after}


def _counters(engine: LLMEngine) -> dict[str, int]:
    s = engine.stats
    return {"queries": s.prefix_cache_queries_total, "hits": s.prefix_cache_hits_total,
            "computed": s.num_computed_prompt_tokens_total, "evicted": s.num_evicted_blocks_total}


class HeldBlockWatch:
    """After every step: a block a live request holds keeps the hash it had (never evicted under it)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.kv = engine.kv_cache_manager
        self.scheduler = engine.scheduler
        self.seen: dict[tuple[int, int], bytes] = {}

    def check(self) -> None:
        self.kv.check_invariants()
        # The null block stands in for blocks a sliding-window group has returned (core/kv_cache/layout.py).
        live = {seq_id: [b for b in self.kv.get_blocks(r) if b is not self.kv.null_block]
                for seq_id, r in self.scheduler.samples.items()}
        live = {seq_id: blocks for seq_id, blocks in live.items() if blocks}
        held = {(seq_id, b.block_id) for seq_id, blocks in live.items() for b in blocks}
        # Preempted, finished, or (sliding window) returned to the pool: held no longer.
        self.seen = {k: h for k, h in self.seen.items() if k in held}
        for seq_id, blocks in live.items():
            for b in blocks:
                assert b.ref_cnt >= 1
                key = (seq_id, b.block_id)
                if key in self.seen:
                    assert b.block_hash == self.seen[key], f"block {b.block_id} of {seq_id} evicted while held"
                elif b.block_hash is not None:
                    self.seen[key] = b.block_hash


# -- hashes --------------------------------------------------------------------------------------------
def test_block_hash_is_sha256_of_parent_salt_and_tokens():
    ids = list(range(1, 14))  # 3 full blocks of 4 + 1 token
    hs = hashes_of(ids, 4, "tenant")
    assert len(hs) == 3 and all(len(h) == 32 for h in hs)
    salt = b"tenant"
    expected0 = hashlib.sha256(ROOT_HASH + struct.pack("<I", len(salt)) + salt + struct.pack("<4q", 1, 2, 3, 4))
    assert hs[0] == expected0.digest()
    assert hs[1] == hash_block(hs[0], ids[4:8], "tenant") and hs[2] == hash_block(hs[1], ids[8:12], "tenant")
    inc: list[bytes] = []
    for end in range(1, len(ids) + 1):  # extended one token at a time, as decoding does
        extend_block_hashes(inc, ids[:end], 4, "tenant")
    assert inc == hs


def test_same_block_content_after_a_different_prefix_has_a_different_hash():
    x, y, z = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    assert hashes_of(x + y, 4)[1] != hashes_of(z + y, 4)[1]
    assert hashes_of(x + y, 4)[1] == hashes_of(x + y + z, 4)[1]
    # the salt enters every block, and None / "a" / "b" all differ
    for i in range(2):
        assert len({hashes_of(x + y, 4, s)[i] for s in (None, "a", "b")}) == 3


# -- KVCacheManager / BlockPool ------------------------------------------------------------------------
A = list(range(1, 13))  # 12 tokens = 3 full blocks of 4


@pytest.mark.parametrize("prompt,expected_hit", [
    (A[:3], 0),                      # shorter than a block
    (A[:4], 0),                      # exactly one block: its last token must run, so no hit
    (A[:8], 4),                      # exactly 2 blocks -> 1 block hit
    (A[:8] + [99], 8),               # 2 blocks + 1 token
    (A[:10] + [99, 98], 8),          # 2 blocks + a few, diverging inside block 3
    (A, 8),                          # the same prompt: the last block is recomputed
    (A + [99], 12),                  # all 3 blocks
    ([99] + A[1:] + [7], 0),         # first block differs: the chain is broken from the start
    (A[:4] + [99] + A[5:] + [7], 4),  # second block differs: only block 1
])
def test_longest_cached_run_is_reused_exactly(prompt, expected_hit):
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a = req("a", A)
    assert admit(kv, a) == 0
    finish(kv, a)
    a_blocks = [kv.cached_block(h) for h in hashes_of(A, 4)]
    b = req("b", prompt)
    assert admit(kv, b) == expected_hit
    n_hit = expected_hit // 4
    assert kv.get_blocks(b)[:n_hit] == a_blocks[:n_hit]  # the very same blocks, not copies
    assert kv.prefix_stats.queries == len(A) + len(prompt)
    assert kv.prefix_stats.hits == expected_hit
    finish(kv, b)
    assert kv.num_free_blocks == 16


def test_running_requests_share_blocks_by_reference_count():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    a, b, c = req("a", A + [50]), req("b", A + [60]), req("c", A[:8] + [70])
    admit(kv, a)
    assert admit(kv, b) == 12 and admit(kv, c) == 8
    shared = kv.get_blocks(a)[:3]
    assert [blk.ref_cnt for blk in shared] == [3, 3, 2]
    assert kv.num_used_blocks == 4 + 1 + 1  # a's 4, one private tail each for b and c
    finish(kv, a)
    assert [blk.ref_cnt for blk in shared] == [2, 2, 1]
    finish(kv, b)
    finish(kv, c)
    assert kv.num_free_blocks == 16


def test_lru_eviction_order_uncached_first_then_least_recently_freed_tail_first():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = req("a", list(range(1, 11)))  # 10 tokens: 2 full cached blocks + a partial (uncached) one
    b = req("b", list(range(101, 109)))  # 8 tokens: 2 full blocks
    admit(kv, a)
    admit(kv, b)
    a_ids, b_ids = kv.get_block_ids(a), kv.get_block_ids(b)
    never_used = sorted(set(range(8)) - set(a_ids) - set(b_ids))
    finish(kv, a)  # A freed first: least recently used
    finish(kv, b)
    assert kv.num_evicted_blocks == 0
    c = req("c", list(range(201, 225)))  # 24 fresh tokens: 6 blocks
    admit(kv, c)
    # A's uncached tail and the never-used blocks first, then A's cached blocks tail first
    assert kv.get_block_ids(c)[:4] == [a_ids[2], *never_used]
    assert kv.get_block_ids(c)[4:] == [a_ids[1], a_ids[0]]
    assert kv.num_evicted_blocks == 2
    assert all(kv.cached_block(h) is None for h in hashes_of(a.prompt_token_ids, 4))
    assert all(kv.cached_block(h) is not None for h in hashes_of(b.prompt_token_ids, 4))
    finish(kv, c)
    assert admit(kv, req("b2", list(range(101, 109)) + [5])) == 8  # B survived eviction


def test_hit_on_a_free_block_revives_it_and_makes_it_most_recent():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    a, b = req("a", [1, 2, 3, 4, 5]), req("b", [11, 12, 13, 14, 15])
    admit(kv, a)
    admit(kv, b)
    a0, b0 = kv.get_blocks(a)[0], kv.get_blocks(b)[0]
    a_hash, b_hash = a0.block_hash, b0.block_hash
    finish(kv, a)
    finish(kv, b)
    a2 = req("a2", [1, 2, 3, 4, 6])
    free_before = kv.num_free_blocks
    assert admit(kv, a2) == 4
    assert a0.ref_cnt == 1 and kv.num_free_blocks == free_before - 2  # revived + one new block
    finish(kv, a2)  # A's block is now more recent than B's
    c = req("c", list(range(200, 212)))
    admit(kv, c)  # 3 blocks: the 2 uncached tails, then B's block
    assert kv.cached_block(b_hash) is None and kv.cached_block(a_hash) is a0
    assert b0.block_id in kv.get_block_ids(c)
    assert kv.num_evicted_blocks == 1


def test_a_block_held_by_a_running_request_is_never_evicted():
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    a = req("a", A + [50])  # holds 4 blocks, 3 of them cached
    admit(kv, a)
    held = {blk.block_id: blk.block_hash for blk in kv.get_blocks(a)}
    admit_and_finish(kv, req("b", [7] * 8))
    c = req("c", list(range(300, 308)))
    admit(kv, c)  # takes the 2 free blocks (evicting b's)
    assert kv.num_free_blocks == 0 and kv.num_evicted_blocks == 2
    d = req("d", list(range(400, 405)))
    hits, n = kv.get_computed_blocks(d)
    assert kv.allocate_slots(d, d.num_tokens - n, hits) is None  # out of blocks: refuse, never steal
    assert {blk.block_id: blk.block_hash for blk in kv.get_blocks(a)} == held
    # a request sharing a's cached blocks costs no free block beyond its own tail
    finish(kv, c)
    e = req("e", A + [60])
    assert admit(kv, e) == 12 and kv.num_free_blocks == 1
    assert {blk.block_id: blk.block_hash for blk in kv.get_blocks(a)} == held
    finish(kv, a)
    finish(kv, e)


def test_allocation_that_needs_revived_blocks_counts_them_and_fails_without_side_effects():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    admit_and_finish(kv, req("a", A))
    b = req("b", A[:8] + list(range(100, 112)))  # 20 tokens: 2 hit blocks + 3 new > 4 blocks in all
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    assert kv.allocate_slots(b, b.num_tokens - n, hits) is None
    assert kv.num_free_blocks == 4 and kv.num_evicted_blocks == 0
    assert all(kv.cached_block(h) is not None for h in hashes_of(A, 4))
    kv.check_invariants()
    c = req("c", A[:8] + list(range(100, 108)))  # 16 tokens: 2 hits + 2 new = exactly the pool
    assert admit(kv, c) == 8 and kv.num_free_blocks == 0


def test_different_salts_never_share_and_the_same_salt_does():
    kv = KVCacheManager(num_blocks=32, block_size=4, enable_prefix_caching=True)
    x1, y, none, x2 = req("x1", A + [1], "x"), req("y", A + [1], "y"), req("n", A + [1]), req("x2", A + [2], "x")
    assert [admit(kv, r) for r in (x1, y, none, x2)] == [0, 0, 0, 12]
    ids = {r.request_id: set(kv.get_block_ids(r)) for r in (x1, y, none, x2)}
    assert not ids["x1"] & ids["y"] and not ids["x1"] & ids["n"] and not ids["y"] & ids["n"]
    assert len(ids["x1"] & ids["x2"]) == 3


def test_opt_out_neither_hits_nor_publishes():
    kv = KVCacheManager(num_blocks=32, block_size=4, enable_prefix_caching=True)
    admit(kv, req("a", A + [1]))
    b = req("b", A + [1], use=False)
    assert admit(kv, b) == 0
    assert all(blk.block_hash is None for blk in kv.get_blocks(b))
    assert kv.prefix_stats.queries == 13 and kv.prefix_stats.hits == 0  # b is not a lookup
    finish(kv, b)
    q = list(range(500, 513))
    admit_and_finish(kv, req("c", q, use=False))
    assert admit(kv, req("d", q + [1])) == 0


def test_caching_disabled_in_config_hashes_nothing():
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=False)
    admit_and_finish(kv, req("a", A))
    assert admit(kv, req("b", A + [1])) == 0
    assert all(blk.block_hash is None for blk in kv._pool.blocks)
    assert kv.prefix_stats.queries == 0 and kv.num_evicted_blocks == 0


# -- engine, hand-computed counts ----------------------------------------------------------------------
def test_exact_hit_counts_end_to_end_including_generated_tokens(tiny_model_dir):
    path = tiny_model_dir("llama")
    engine = make_engine(path)
    p = rand_ids(40, seed=1)
    out1, d = run_one(engine, "r1", p, 10)
    # r1 computes 40 prompt + 9 generated tokens: 3 full blocks (48 tokens) are cached
    assert d == {"queries": 40, "hits": 0, "computed": 40, "evicted": 0}
    cases = [
        ("shares 35, diverges in block 3", p[:35] + rand_ids(5, seed=2), 32),
        ("same prompt", p, 32),                        # (40 - 1) // 16 = 2 blocks
        ("exactly 2 blocks", p[:32], 16),              # the last token must run
        ("shorter than a block", p[:10], 0),
        ("multi-turn: prompt + generated", p + out1[:12], 48),  # block 3 holds generated tokens
    ]
    for i, (what, prompt, hit) in enumerate(cases):
        tokens, d = run_one(engine, f"c{i}", prompt, 6)
        assert d == {"queries": len(prompt), "hits": hit, "computed": len(prompt) - hit, "evicted": 0}, what
        assert tokens == hf_greedy(path, prompt, 6), what
    assert out1 == hf_greedy(path, p, 10)
    assert_all_free(engine)


def test_a_request_blocked_at_admission_is_counted_once(tiny_model_dir):
    """Regression: the lookup of a request waiting for blocks was counted again every step."""
    path = tiny_model_dir("llama")
    engine = make_engine(path, block_size=4, num_kv_blocks=4)
    p = rand_ids(12, seed=3)
    engine.add_request("a", p, greedy(4))  # 12 + 3 computed tokens: all 4 blocks
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    for out in engine.step():
        tokens[out.request_id].extend(out.new_token_ids)
    engine.add_request("b", p, greedy(4))  # hits 2 blocks, but must wait for a's 4th block to free
    steps_blocked = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps_blocked += engine.stats.num_waiting > 0
        for out in outs:
            tokens[out.request_id].extend(out.new_token_ids)
        engine.kv_cache_manager.check_invariants()
    assert steps_blocked >= 2 and engine.stats.num_preemptions_total == 0
    assert engine.stats.prefix_cache_queries_total == 24
    assert engine.stats.prefix_cache_hits_total == 8
    assert engine.stats.num_computed_prompt_tokens_total == 12 + 4
    assert tokens["a"] == tokens["b"] == hf_greedy(path, p, 4)
    assert_all_free(engine)


def test_eviction_order_end_to_end(tiny_model_dir):
    """12 blocks of 16: A and B (4 cached blocks each) finish, then C needs 6 blocks: the 4 never
    used, then A's last two blocks (A was freed first, tail first). B stays whole."""
    path = tiny_model_dir("llama")
    engine = make_engine(path, num_kv_blocks=12, max_num_batched_tokens=128)
    a, b, c = rand_ids(64, seed=4), rand_ids(64, seed=5), rand_ids(96, seed=6)
    run_one(engine, "a", a, 1)
    run_one(engine, "b", b, 1)
    _, d = run_one(engine, "c", c, 1)
    assert d["evicted"] == 2
    kv = engine.kv_cache_manager
    assert [kv.cached_block(h) is not None for h in hashes_of(a, 16)] == [True, True, False, False]
    assert all(kv.cached_block(h) is not None for h in hashes_of(b, 16))
    # A again: its first 2 blocks hit, the rest (overwritten by C) is recomputed into 3 new blocks
    # taken from the LRU head: B's blocks, tail first
    tokens, d = run_one(engine, "a2", a + [7], 5)
    assert (d["hits"], d["evicted"]) == (32, 3) and tokens == hf_greedy(path, a + [7], 5)
    tokens, d = run_one(engine, "b2", b + [7], 5)
    assert d["hits"] == 16 and tokens == hf_greedy(path, b + [7], 5)
    assert_all_free(engine)


def test_salts_and_opt_out_end_to_end(tiny_model_dir):
    path = tiny_model_dir("qwen3")
    engine = make_engine(path)
    p = rand_ids(50, seed=7)
    expected = hf_greedy(path, p, 8)
    # arriving together: the same salt shares blocks within the first step, another salt does not
    for rid, salt in (("x1", "x"), ("x2", "x"), ("y1", "y")):
        engine.add_request(rid, p, greedy(8), cache_salt=salt)
    tokens: dict[str, list[int]] = {"x1": [], "x2": [], "y1": []}
    for out in engine.step():
        tokens[out.request_id].extend(out.new_token_ids)
    kv = engine.kv_cache_manager
    ids = {r.request_id: kv.get_block_ids(r) for r in engine.scheduler.samples.values()}
    assert ids["x1"][:3] == ids["x2"][:3] and not set(ids["y1"]) & set(ids["x1"])
    assert engine.stats.prefix_cache_hits_total == 48
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    assert all(t == expected for t in tokens.values())
    for rid, kw, hit in (("z", {"cache_salt": "z"}, 0), ("y2", {"cache_salt": "y"}, 48), ("none", {}, 0),
                         ("opt-out", {"cache_salt": "x", "use_prefix_cache": False}, 0)):
        t, d = run_one(engine, rid, p, 8, **kw)
        assert t == expected and d["hits"] == hit, rid
        assert d["computed"] == len(p) - hit
    assert d["queries"] == 0  # opting out is not a lookup
    # "" would hash as no salt (sharing with every unsalted request): refused, as vLLM's server does
    for bad in ("", 7):
        with pytest.raises(InvalidRequest, match="cache_salt") as exc:
            engine.add_request("bad-salt", p, greedy(8), cache_salt=bad)
        assert exc.value.param == "cache_salt" and not engine.has_unfinished_requests()
    # an opt-out request publishes nothing: a cached request after it finds no block of its prompt
    q = rand_ids(40, seed=8)
    run_one(engine, "q-opt-out", q, 4, use_prefix_cache=False)
    t, d = run_one(engine, "q", q + [1], 4)
    assert d["hits"] == 0 and t == hf_greedy(path, q + [1], 4)
    assert_all_free(engine)


# -- engine, shared-prefix workloads vs transformers -----------------------------------------------------
def shared_prefix_workload(seed: int) -> list[list[int]]:
    """Prefixes shorter than a block, exactly k blocks, k blocks + a few, nested and disjoint, and
    s's blocks behind a different first block (same content, other position: must not match)."""
    s, t = rand_ids(60, seed), rand_ids(40, seed + 1)
    prefixes = [s[:5], s[:16], s[:32], s[:35], s[:50], t[:32], t[:16] + s[:32]]
    prompts = []
    for i, pre in enumerate(prefixes):
        for j, n in enumerate((0, 3, 12)):
            prompts.append(pre + rand_ids(n, seed=1000 * seed + 10 * i + j) if n else list(pre))
    return prompts


def run_workload(engine: LLMEngine, prompts, max_tokens: int, arrivals: list[int]) -> dict[str, list[int]]:
    watch = HeldBlockWatch(engine)
    tokens: dict[str, list[int]] = {}
    pending = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            engine.add_request(f"r{i}", prompts[i], greedy(max_tokens))
            tokens[f"r{i}"] = []
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        watch.check()
        step += 1
    return tokens


@pytest.mark.parametrize("family,arrival", [("llama", "together"), ("qwen3", "staggered"), ("mistral", "staggered")])
def test_greedy_identical_with_caching_on_and_off_under_preemption(tiny_model_dir, family, arrival):
    path = tiny_model_dir(family)
    prompts = shared_prefix_workload(seed=11)
    max_tokens = 24
    if arrival == "together":
        arrivals = [0] * len(prompts)
    else:  # one after another, a few steps apart, in shuffled order
        order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(5)).tolist()
        arrivals = [2 * order.index(i) for i in range(len(prompts))]
    runs = {}
    for caching in (True, False):
        engine = make_engine(path, enable_prefix_caching=caching, num_kv_blocks=12, max_num_batched_tokens=64)
        runs[caching] = (run_workload(engine, prompts, max_tokens, arrivals), _counters(engine),
                         engine.stats.num_preemptions_total)
        assert_all_free(engine)
    (on, c_on, pre_on), (off, c_off, pre_off) = runs[True], runs[False]
    assert pre_on > 0 and pre_off > 0, "the scenario must force preemption"
    assert on == off
    for i, prompt in enumerate(prompts):
        assert on[f"r{i}"] == hf_greedy(path, prompt, max_tokens), f"request {i} ({len(prompt)} tokens)"
    assert c_off["queries"] == c_off["hits"] == c_off["evicted"] == 0
    assert c_on["hits"] > 0 and c_on["evicted"] > 0
    assert c_on["computed"] < c_off["computed"]
    # every prompt token is either computed or served from the cache (recompute after preemption
    # counts again, and a preempted request looks its tokens up again)
    assert c_on["computed"] + c_on["hits"] >= sum(map(len, prompts))
