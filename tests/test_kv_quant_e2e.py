"""KV-cache quantization end to end: pool sizing, engine wiring, and SmolLM2-135M agreement.

The SmolLM2 test (slow) runs 32 real prompts x 64 greedy tokens with an fp32 cache (the
reference), then scores every quantized cache dtype against that continuation:

* teacher-forced agreement: the reference continuation is fed back, so every step reads the
  quantized cache, and each step's argmax is compared with the reference token (no cascade after
  a divergence). Printed with the mean |logprob difference| of the reference tokens.
* free-running first divergence: each side's token must be in the other's top-5 there, or, in a
  flat distribution, within NEAR_TIE nats of the other side's best token.

Cheap by construction. In this engine attention always reads K/V back from the cache after the
store, so one prefill of prompt + continuation reads every key/value through the quantized cache
exactly as one-token-at-a-time decoding would: all teacher-forced logits of a dtype come from one
forward pass. Quantization is per token and deterministic, so a quantized free run produces the
reference tokens up to the first step whose teacher-forced argmax differs; that step is the free
run's first divergence, and its logits are the teacher-forced ones. Weights are fp32.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.core.config import EngineConfig
from pagedserve.core.engine import LLMEngine
from pagedserve.core.forward_batch import ForwardBatch
from pagedserve.core.kv_cache.cache_tensors import KVCacheSpec, allocate_kv_caches, make_kv_cache_spec
from pagedserve.core.sampling_params import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)

# --- pool sizing ---------------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim,min_vs_bf16,min_vs_fp32", [(64, 1.85, 3.7), (128, 1.9, 3.8)])
@pytest.mark.parametrize("quant", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_pool_holds_more_tokens(quant, head_dim, min_vs_bf16, min_vs_fp32):
    """The same budget holds >= 1.85x the tokens of bf16 (3.7x fp32) at head_dim 64, scales included."""
    budget = 2 * 1024**3
    blocks = {name: make_kv_cache_spec(name, torch.float32, 30, 16, 3, head_dim).num_blocks(budget)
              for name in ("fp32", "bf16", quant)}
    assert blocks[quant] / blocks["bf16"] >= min_vs_bf16, blocks
    assert blocks[quant] / blocks["fp32"] >= min_vs_fp32, blocks
    # Exactly: K and V, per layer, per (token, head): head_dim code bytes + one bf16 scale.
    spec = make_kv_cache_spec(quant, torch.float32, 30, 16, 3, head_dim)
    assert spec.bytes_per_block == 30 * 2 * 16 * 3 * (head_dim + 2)
    assert blocks[quant] == budget // spec.bytes_per_block


def test_static_scales_take_no_block_bytes():
    static = KVCacheSpec(2, 16, 3, 64, torch.float8_e4m3fn, static_scales=((0.1, 0.2), (0.3, 0.4)))
    assert static.bytes_per_block == 2 * 2 * 16 * 3 * 64
    caches = allocate_kv_caches(static, 4, torch.device("cpu"))
    assert caches[1].k_scale.dim() == 0 and caches[1].v_scale.item() == pytest.approx(0.4)


# --- engine wiring on a tiny random model --------------------------------------------------------


def test_engine_runs_every_kv_dtype(tiny_model_dir):
    path = str(tiny_model_dir("llama"))
    prompts = [[5, 9, 33, 2, 71, 8, 100, 12, 7, 3] * 3, [44, 45, 46], list(range(60, 110))]
    params = SamplingParams(max_tokens=12, **GREEDY)
    runs, blocks = {}, {}
    for kv in ("fp32", "bf16", "fp16", "int8", "fp8_e4m3", "fp8_e5m2"):
        engine = LLMEngine(EngineConfig.from_dict({
            "model": path, "dtype": "float32", "kv_cache_dtype": kv, "kv_cache_memory": 1 << 20,
            "block_size": 16, "max_num_batched_tokens": 32}))  # chunked prefill mixes with decodes
        blocks[kv] = engine.num_kv_blocks
        runs[kv] = [r.token_ids for r in engine.generate(prompts, params)]
        layer0 = engine.runner.kv_caches[0]
        assert layer0.key_cache.dtype == engine.kv_cache_spec.dtype
        if engine.kv_cache_spec.quantized:
            assert layer0.k_scale.shape == layer0.key_cache.shape[:3] and (layer0.k_scale > 0).any()
        else:
            assert layer0.k_scale is None
    # tiny model: head_dim 16, so int8 holds 32 / (16 + 2) = 1.78x the bf16 tokens.
    assert blocks["int8"] == blocks["fp8_e4m3"] == int((1 << 20) // (2 * 2 * 16 * 2 * 18))
    assert blocks["bf16"] == 2 * blocks["fp32"]
    # Free-running greedy ids cascade after a near-tie, so only the first sampled token (read from
    # a fully quantized prompt) is held equal; closeness is measured on SmolLM2 below.
    for kv in runs:
        assert all(len(r) == 12 for r in runs[kv])
        assert [r[0] for r in runs[kv]] == [r[0] for r in runs["fp32"]], (kv, runs[kv], runs["fp32"])


def test_checkpoint_static_scales(tiny_model_dir, tmp_path):
    """A checkpoint's per-layer k_scale / v_scale (vLLM fp8 layout) become static scales of an fp8
    cache: 0-dim, no per-block bytes; int8 keeps its dynamic per-token scales."""
    import shutil

    from safetensors.torch import save_file

    path = tmp_path / "tiny-static"
    shutil.copytree(tiny_model_dir("llama"), path)
    save_file({f"model.layers.{i}.self_attn.{n}_scale": torch.tensor(s) for i in range(2)
               for n, s in (("k", 0.02), ("v", 0.01))}, str(path / "kv_scales.safetensors"))
    base = {"model": str(path), "dtype": "float32", "kv_cache_memory": 1 << 20}
    engine = LLMEngine(EngineConfig.from_dict({**base, "kv_cache_dtype": "fp8_e4m3"}))
    spec = engine.kv_cache_spec
    assert [s for layer in spec.static_scales for s in layer] == pytest.approx([0.02, 0.01] * 2)
    assert not spec.dynamic_scales
    assert spec.bytes_per_block == 2 * 2 * 16 * 2 * 16  # layers x K,V x block x heads x head_dim, no scales
    layer = engine.runner.kv_caches[1]
    assert layer.k_scale.dim() == 0 and layer.k_scale.item() == pytest.approx(0.02)
    out = engine.generate([[5, 9, 33, 2, 71, 8]], SamplingParams(max_tokens=4, **GREEDY))
    assert len(out[0].token_ids) == 4
    assert LLMEngine(EngineConfig.from_dict({**base, "kv_cache_dtype": "int8"})).kv_cache_spec.dynamic_scales


# --- SmolLM2-135M ---------------------------------------------------------------------------------

PROMPTS = [
    "What is the capital of France?", "Explain in one sentence why the sky is blue.",
    "Write a short poem about a cat who loves boxes.", "List three uses for a paperclip.",
    "Translate 'good morning' into Spanish and German.", "What does a compiler do?",
    "Give me a recipe for a simple tomato soup.", "Why do leaves change color in autumn?",
    "Summarize the plot of Romeo and Juliet.", "How many legs does a spider have?",
    "What is the difference between weather and climate?", "Name three planets in our solar system.",
    "Describe how a bicycle works.", "What is photosynthesis?", "Tell me a fun fact about octopuses.",
    "How do I boil an egg?", "What causes earthquakes?", "Write a haiku about the ocean.",
    "What is the Pythagorean theorem?", "Suggest a name for a pet goldfish.",
    "Why is exercise good for health?", "What is the tallest mountain on Earth?",
    "Explain what a black hole is to a child.", "How does a refrigerator keep food cold?",
    "What are the primary colors?", "Give two tips for learning a new language.",
    "What is the boiling point of water at sea level?", "Who wrote Pride and Prejudice?",
    "What is machine learning in simple terms?", "How do bees make honey?",
    "Write a friendly birthday message for a coworker.", "What is the purpose of a seatbelt?",
]
MAX_NEW = 64
QUANT_DTYPES = ["int8", "fp8_e4m3", "fp8_e5m2"]
MIN_AGREEMENT = {"int8": 0.95, "fp8_e4m3": 0.95}  # fp8_e5m2 (2 mantissa bits) is reported, not held to 95%
SEQS_PER_PASS = 8  # sequences per teacher-forced forward pass (bounds the [rows, vocab] logits)
TOP_K = 16  # candidates kept per step for the first-divergence cross-check
# A first divergence in a flat distribution may pick a token ranked below 5th whose logprob is
# within a hair of the best (measured: fp8_e4m3 on an AMD host, a step whose top 6 lie within
# 0.25 nats); that is rounding choosing between near-equals, not a quality loss.
NEAR_TIE = 0.3


def make_batch(seqs: list[list[int]], num_new: list[int], starts: list[int], block_table: np.ndarray,
               block_size: int, logits_rows: int) -> ForwardBatch:
    """The last num_new[b] tokens of seqs[b] at positions starts[b].., logits for each sequence's
    last `logits_rows` rows."""
    lens = np.array(num_new)
    positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, num_new)])
    rows = np.repeat(np.arange(len(seqs)), lens)
    slot_mapping = block_table[rows, positions // block_size].astype(np.int64) * block_size + positions % block_size
    qsl = np.concatenate([[0], np.cumsum(lens)])
    seq_lens = np.array(starts) + lens
    return ForwardBatch(
        input_ids=torch.tensor([t for s, n in zip(seqs, num_new) for t in s[len(s) - n:]]),
        positions=torch.from_numpy(positions), query_start_loc=torch.from_numpy(qsl.astype(np.int32)),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)), block_table=torch.from_numpy(block_table),
        slot_mapping=torch.from_numpy(slot_mapping),
        logits_indices=torch.from_numpy(np.concatenate([np.arange(e - logits_rows, e) for e in qsl[1:]])),
        max_query_len=int(lens.max()), max_seq_len=int(seq_lens.max()))


def new_caches(model, kv_cache_dtype: str, lengths: list[int], block_size: int = 16):
    """Caches with room for `lengths` tokens per sequence, and a block table of contiguous blocks."""
    a = model.arch
    spec = make_kv_cache_spec(kv_cache_dtype, model.dtype, a.num_layers, block_size, a.num_kv_heads, a.head_dim)
    nblk = [-(-n // block_size) for n in lengths]
    block_table = np.zeros((len(lengths), max(nblk)), dtype=np.int32)
    for b, first in enumerate(np.cumsum([0] + nblk[:-1])):
        block_table[b, :nblk[b]] = first + np.arange(nblk[b])
    return allocate_kv_caches(spec, sum(nblk), model.device), block_table, block_size


@pytest.fixture(scope="module")
def smollm2():
    """Model, prompts, and the fp32-cache greedy reference: per sequence the continuation, each
    step's top-TOP_K (ids, logprobs) and the chosen token's logprob (decoded one token at a time,
    batched)."""
    engine = LLMEngine(EngineConfig.from_dict({"model": "default", "dtype": "float32", "max_model_len": 512}))
    tok, model = engine.tokenizer, engine.runner.model
    prompts = [engine.tokenize(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                       add_generation_prompt=True)) for p in PROMPTS]
    caches, block_table, bs = new_caches(model, "fp32", [len(p) + MAX_NEW for p in prompts])
    seqs = [list(p) for p in prompts]
    top_ids, top_lp = [], []
    new = [len(p) for p in prompts]
    for _ in range(MAX_NEW):
        batch = make_batch(seqs, new, [len(s) - n for s, n in zip(seqs, new)], block_table, bs, 1)
        logprobs = torch.log_softmax(model.forward(batch, caches), dim=-1)
        lp, idx = logprobs.topk(TOP_K, dim=-1)
        top_ids.append(idx)
        top_lp.append(lp)
        for s, t in zip(seqs, idx[:, 0].tolist()):
            s.append(t)
        new = [1] * len(seqs)
    top = (torch.stack(top_ids, 1), torch.stack(top_lp, 1))
    return model, prompts, [s[len(p):] for s, p in zip(seqs, prompts)], top, top[1][..., 0]


def teacher_forced(model, kv_cache_dtype: str, prompts: list[list[int]], conts: list[list[int]]):
    """(argmax [B, MAX_NEW], top-TOP_K (ids, logprobs) [B, MAX_NEW, TOP_K], logprob of the reference
    token [B, MAX_NEW])."""
    argmax, top_ids, top_lp, ref_lp = [], [], [], []
    for i in range(0, len(prompts), SEQS_PER_PASS):
        # Input: prompt + continuation[:-1]; the last MAX_NEW rows predict the continuation.
        seqs = [p + c[:-1] for p, c in zip(prompts[i:i + SEQS_PER_PASS], conts[i:i + SEQS_PER_PASS])]
        caches, block_table, bs = new_caches(model, kv_cache_dtype, [len(s) for s in seqs])
        batch = make_batch(seqs, [len(s) for s in seqs], [0] * len(seqs), block_table, bs, MAX_NEW)
        logprobs = torch.log_softmax(model.forward(batch, caches), dim=-1).view(len(seqs), MAX_NEW, -1)
        target = torch.tensor(conts[i:i + SEQS_PER_PASS])
        argmax.append(logprobs.argmax(-1))
        lp, idx = logprobs.topk(TOP_K, dim=-1)
        top_ids.append(idx)
        top_lp.append(lp)
        ref_lp.append(logprobs.gather(-1, target[..., None])[..., 0])
    return torch.cat(argmax), (torch.cat(top_ids), torch.cat(top_lp)), torch.cat(ref_lp)


def close_to_top(token: int, ids: torch.Tensor, logprobs: torch.Tensor) -> bool:
    """`token` is in this step's top-5, or among its top-TOP_K within NEAR_TIE nats of the best."""
    rank = (ids == token).nonzero()
    return len(rank) > 0 and (int(rank[0]) < 5 or float(logprobs[0] - logprobs[int(rank[0])]) <= NEAR_TIE)


@pytest.mark.slow
def test_quantized_kv_agrees_with_unquantized(smollm2):
    model, prompts, conts, (ref_ids, ref_top_lp), ref_lp = smollm2
    target = torch.tensor(conts)
    total = target.numel()
    for kv in QUANT_DTYPES:
        argmax, (ids, top_lp), lp = teacher_forced(model, kv, prompts, conts)
        agree = (argmax == target).float().mean().item()
        dlp = (lp - ref_lp).abs().mean().item()
        first_div, near_ok = [], 0
        for b in range(len(prompts)):
            diff = (argmax[b] != target[b]).nonzero()
            if len(diff) == 0:
                near_ok += 1
                continue
            d = int(diff[0])
            first_div.append(d)
            # Free run (see the module docstring): quantized token argmax[b, d] vs reference target[b, d].
            ok = (close_to_top(int(target[b, d]), ids[b, d], top_lp[b, d])
                  and close_to_top(int(argmax[b, d]), ref_ids[b, d], ref_top_lp[b, d]))
            near_ok += int(ok)
            if not ok:
                print(f"  prompt {b} step {d}: reference top {ref_ids[b, d, :8].tolist()} "
                      f"{[round(x, 3) for x in ref_top_lp[b, d, :8].tolist()]}; {kv} top {ids[b, d, :8].tolist()} "
                      f"{[round(x, 3) for x in top_lp[b, d, :8].tolist()]}")
        print(f"\n[kv quant] {kv}: teacher-forced agreement {agree:.2%} of {total} steps, mean |logprob diff| "
              f"{dlp:.4f}; free run: {len(first_div)}/{len(prompts)} diverge (first at {sorted(first_div)[:6]}), "
              f"near-top cross-check {near_ok}/{len(prompts)}")
        # fp8_e5m2 keeps 2 mantissa bits and reorders flat distributions beyond a near-tie (measured:
        # a step whose reference top 7 lie within 0.4 nats, the reference's best 0.8 nats below
        # e5m2's), so it gets one prompt of slack; int8 and fp8_e4m3 get none.
        need = len(prompts) - (1 if kv == "fp8_e5m2" else 0)
        assert near_ok >= need, f"{kv}: {len(prompts) - near_ok} first divergences far from the other side's best"
        if kv in MIN_AGREEMENT:
            assert agree >= MIN_AGREEMENT[kv], f"{kv}: teacher-forced agreement {agree:.2%}"
