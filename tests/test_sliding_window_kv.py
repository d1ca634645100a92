"""Layer groups (core/kv_cache/layout.py): sliding-window layers hold only their window.

Oracles: transformers' greedy generate() for the tokens (tiny random Gemma 3 with a 16-token window
under prompts of up to 90 tokens and 40 generated), the engine with the hybrid layout turned off
for prefix caching and preemption, and the manager's own counts against the bound
cdiv(window - 1 + chunk, block_size) + 1 per sliding group.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.core.config import EngineConfig
from pagedserve.core.engine import LLMEngine
from pagedserve.core.kv_cache.layout import cdiv, make_kv_cache_layout
from pagedserve.core.kv_cache.manager import KVCacheManager
from pagedserve.core.request import Sample
from pagedserve.core.sampling_params import SamplingParams

from tests.oracle import hf_greedy
from tests.test_engine_vs_transformers import random_prompts

WINDOW = 16
MAX_NEW = 40


def make_engine(path, **overrides) -> LLMEngine:
    config = {"model": str(path), "dtype": "float32", "block_size": 8, "max_num_batched_tokens": 32,
              "attention_backend": "cpu", **overrides}
    return LLMEngine(EngineConfig.from_dict(config))


def greedy(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def assert_all_returned(engine: LLMEngine) -> None:
    kv = engine.kv_cache_manager
    kv.check_invariants()
    assert not engine.has_unfinished_requests()
    assert kv.num_free_blocks == engine.num_kv_blocks and kv.num_used_blocks == 0


def run_checked(engine: LLMEngine, prompts, params: SamplingParams) -> tuple[dict[str, list[int]], int]:
    """Run prompts together, checking after every step that no sample holds more than the bound in
    a sliding group. Returns tokens per request id and the most sliding blocks one sample held."""
    kv = engine.kv_cache_manager
    bs, chunk = engine.config.cache.block_size, engine.config.scheduler.max_num_batched_tokens
    bound = cdiv(WINDOW - 1 + chunk, bs) + 1
    sliding = [g for g, w in enumerate(kv.windows) if w is not None]
    ids = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    most = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        kv.check_invariants()
        for request in engine.scheduler.running:
            held = kv.num_held_blocks_per_group(request)
            most = max([most] + [held[g] for g in sliding])
            assert all(held[g] <= bound for g in sliding), f"{held} past the bound {bound}"
    return tokens, most


# -- layout ------------------------------------------------------------------------------------------
def test_layout_groups_gemma3_270m_pattern():
    """18 layers, every 6th global (Gemma 3 270M): 6 groups of the 3 global layers' size."""
    windows = tuple(None if i % 6 == 5 else 512 for i in range(18))
    layout = make_kv_cache_layout(windows)
    assert layout.layers_per_block == 3 and layout.num_groups == 6
    assert layout.groups[0].layers == (5, 11, 17) and layout.groups[0].sliding_window is None
    assert [g.layers for g in layout.groups[1:]] == [(0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13), (14, 15, 16)]
    assert all(g.sliding_window == 512 for g in layout.groups[1:])
    # A 4096-token sequence: 256 blocks of 16 for the global group, 33 (+ a 512-token chunk's) per local one.
    assert layout.max_blocks_per_seq(4096, 16, 16) == 256 + 5 * 34
    off = make_kv_cache_layout(windows, hybrid=False)
    assert off.num_groups == 1 and off.layers_per_block == 18 and not off.frees_blocks


def test_layout_single_kind_stays_one_group():
    assert make_kv_cache_layout((None,) * 4).groups[0].layers == (0, 1, 2, 3)
    mistral = make_kv_cache_layout((48,) * 4)
    assert mistral.num_groups == 1 and mistral.frees_blocks and mistral.layers_per_block == 4
    uneven = make_kv_cache_layout((None, 8, 8, None, 8, 8, 8))  # 2 global, 5 local: groups of 2, one of 1
    assert [g.layers for g in uneven.groups] == [(0, 3), (1, 2), (4, 5), (6,)]


# -- the manager -------------------------------------------------------------------------------------
def _req(rid: str, n: int) -> Sample:
    return Sample(request_id=rid, prompt_token_ids=list(range(1, n + 1)), sampling_params=SamplingParams(),
                   eos_token_id=None, max_tokens=64)


def _hybrid_manager(num_blocks: int, prefix: bool = False) -> KVCacheManager:
    layout = make_kv_cache_layout((8, None))  # window 8, block 4: a sliding group keeps 3 blocks at most
    return KVCacheManager(num_blocks, 4, prefix, layout, max_chunk_tokens=1)


def test_sliding_group_returns_blocks_behind_its_window():
    kv = _hybrid_manager(40)
    r = _req("a", 1)
    assert kv.allocate_slots(r, 1) is not None
    r.num_computed_tokens = 1
    for pos in range(1, 40):  # decode one token at a time
        kv.allocate_slots(r, 1)
        r.num_computed_tokens += 1
        full, sliding = kv.num_held_blocks_per_group(r)
        assert full == cdiv(pos + 1, 4)
        # positions (pos - 8, pos] span at most 3 blocks of 4
        assert sliding == len({p // 4 for p in range(max(0, pos - 7), pos + 1)}) <= cdiv(8, 4) + 1
        kv.check_invariants()
    ids = kv.get_group_block_ids(r)
    assert len(ids[0]) == len(ids[1]) == 10  # tables stay positional
    assert ids[1][:8] == [kv.null_block.block_id] * 8 and kv.null_block.block_id not in ids[0]
    assert kv.num_used_blocks == 10 + 2
    kv.free(r)
    kv.check_invariants()
    assert kv.num_free_blocks == 40


def test_can_fit_counts_a_sliding_group_by_its_window():
    kv = _hybrid_manager(20)
    assert kv.max_blocks_per_seq(64) == 16 + 3  # full group 16 blocks, sliding cdiv(8 - 1 + 1, 4) + 1
    assert kv.can_fit(68) and not kv.can_fit(69) and kv.max_fitting_tokens(100) == 68
    plain = KVCacheManager(20, 4, False)
    assert plain.can_fit(80) and not plain.can_fit(81) and plain.max_fitting_tokens(100) == 80


def test_prefix_hit_needs_the_window_before_the_hit():
    """A hit is cut back to where the sliding group still has the blocks of the window before it."""
    kv = _hybrid_manager(40, prefix=True)
    a = _req("a", 30)
    kv.allocate_slots(a, 30)  # one chunk: every block full, all registered
    a.num_computed_tokens = 30
    kv.allocate_slots(a, 1)  # the next step returns the sliding blocks behind the window
    kv.free(a)
    b = _req("b", 30)
    hits, n = kv.get_computed_blocks(b)
    assert n == 28  # 7 full blocks (the last token always runs)
    full, sliding = hits[:7], hits[7:]
    assert all(x is not kv.null_block for x in full)
    # token 28 reads positions 21..28: blocks 5 and 6 (and 7, computed); blocks 0..4 are placeholders
    assert sliding[:5] == [kv.null_block] * 5 and kv.null_block not in sliding[5:]
    assert kv.allocate_slots(b, 2, hits) is not None
    kv.check_invariants()
    kv.free(b)
    # Evict the sliding group's block 5: a hit past it would read a block nobody has any more.
    lost = hits[7 + 5]  # free now, still cached: drop its hash as an eviction would
    assert lost.ref_cnt == 0
    del kv._pool._cached[lost.block_hash]
    lost.block_hash = None
    hits, n = kv.get_computed_blocks(b)
    # 5 blocks: token 20 reads 13..20, blocks 3 and 4, which the sliding group still has cached
    assert n == 20 and len(hits) == 10
    kv.check_invariants()


# -- end to end against transformers -------------------------------------------------------------------
@pytest.mark.parametrize("family", ["gemma3", "gemma3-groups"])
def test_greedy_matches_transformers_with_windows_freed(tiny_model_dir, family):
    path = tiny_model_dir(family)
    engine = make_engine(path)
    assert engine.kv_cache_manager.null_block is not None, "the hybrid layout is on by default"
    prompts = random_prompts(5, 20, 90, seed=3)
    tokens, most = run_checked(engine, prompts, greedy())
    for i, prompt in enumerate(prompts):
        assert tokens[f"r{i}"] == hf_greedy(path, prompt, MAX_NEW), f"prompt of {len(prompt)} tokens"
    assert most >= 3, "no sample came near the bound: the windows were not exercised"
    assert_all_returned(engine)


def test_hybrid_layout_holds_fewer_blocks_than_full_allocation(tiny_model_dir):
    """The same requests: the hybrid layout's pool peak is a fraction of the full layout's (in
    blocks of the same bytes the ratio is what capacity gains)."""
    path = tiny_model_dir("gemma3-groups")
    prompt = random_prompts(1, 90, 90, seed=4)[0]
    peaks = {}
    for off in (False, True):
        engine = make_engine(path, disable_hybrid_kv_cache_manager=off, num_kv_blocks=512)
        engine.add_request("a", prompt, greedy())
        bytes_per_block, peak = engine.kv_cache_spec.bytes_per_block, 0
        while engine.has_unfinished_requests():
            engine.step()
            peak = max(peak, engine.kv_cache_manager.num_used_blocks)
        peaks[off] = peak * bytes_per_block
        assert_all_returned(engine)
    # Full: 16 blocks x 6 layers (the step that writes block 17 finishes the request and frees it
    # before it is looked at); hybrid: 16 x 2 global layers + at most 7 blocks x 2 local pairs.
    assert peaks[True] == 16 * 6 * (2 * 8 * 2 * 256 * 4)  # layers x K,V x tokens x heads x dim x fp32
    assert peaks[False] <= peaks[True] * 0.55


def test_prefix_hits_on_a_hybrid_model_give_the_tokens_of_no_caching(tiny_model_dir):
    path = tiny_model_dir("gemma3-groups")
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(3, 384, (50,), generator=g).tolist()
    prompts = [prefix + torch.randint(3, 384, (n,), generator=g).tolist() for n in (0, 20, 7, 33)]
    results = {}
    for caching in (True, False):
        engine = make_engine(path, enable_prefix_caching=caching)
        out = []
        for prompt in prompts:  # one after another: later prompts hit what earlier ones left
            out.append(list(engine.generate([prompt], greedy(24))[0].token_ids))
        results[caching] = out
        if caching:
            assert engine.stats.prefix_cache_hits_total >= 3 * 48, "the shared prefix did not hit"
        assert_all_returned(engine)
    assert results[True] == results[False]
    assert results[True][1] == hf_greedy(path, prompts[1], 24)


def test_preemption_recompute_stays_exact(tiny_model_dir):
    path = tiny_model_dir("gemma3-groups")
    prompts = random_prompts(6, 30, 80, seed=9)
    # 60 blocks of 8 tokens: one sample needs up to cdiv(120, 8) + 2 x 7 = 29, so six preempt each other.
    engine = make_engine(path, num_kv_blocks=60, enable_prefix_caching=False)
    tokens, _ = run_checked(engine, prompts, greedy())
    assert engine.stats.num_preemptions_total > 0, "nothing was preempted: the test would not test it"
    for i, prompt in enumerate(prompts):
        assert tokens[f"r{i}"] == hf_greedy(path, prompt, MAX_NEW), f"prompt of {len(prompt)} tokens"
    assert_all_returned(engine)


def test_abort_and_finish_return_every_block(tiny_model_dir):
    engine = make_engine(tiny_model_dir("gemma3-groups"))
    for i, prompt in enumerate(random_prompts(4, 40, 90, seed=12)):
        engine.add_request(f"r{i}", prompt, greedy())
    for _ in range(8):  # prefills done, some decoding: sliding groups hold placeholders by now
        engine.step()
        engine.kv_cache_manager.check_invariants()
    kv = engine.kv_cache_manager
    assert any(kv.null_block.block_id in ids for r in engine.scheduler.running
               for ids in kv.get_group_block_ids(r)[1:])
    engine.abort_request("r1")
    engine.abort_request("r2")
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_returned(engine)


def test_samples_of_one_request_share_what_the_windows_kept(tiny_model_dir):
    """n = 2 greedy samples equal each other and transformers, with or without prefix caching."""
    path = tiny_model_dir("gemma3-groups")
    prompt = random_prompts(1, 70, 70, seed=15)[0]
    want = hf_greedy(path, prompt, 20)
    for caching in (True, False):
        engine = make_engine(path, enable_prefix_caching=caching)
        res = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, n=2))
        assert [list(c.token_ids) for c in res] == [want, want]
        assert_all_returned(engine)


def test_int8_cache_gives_the_tokens_of_full_allocation(tiny_model_dir):
    """Dynamic int8 scales live in the shared tensors too, indexed by the group's blocks: the same
    per-token quantization in both layouts, so the same greedy tokens."""
    path = tiny_model_dir("gemma3-groups")
    prompts = random_prompts(3, 40, 80, seed=21)
    outs = []
    for off in (False, True):
        engine = make_engine(path, kv_cache_dtype="int8", disable_hybrid_kv_cache_manager=off)
        outs.append([list(r.token_ids) for r in engine.generate(prompts, greedy())])
        assert_all_returned(engine)
    assert outs[0] == outs[1]
