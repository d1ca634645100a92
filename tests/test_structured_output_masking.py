"""The vectorized bitmask apply (core/structured_output/masking.py) against xgrammar's own kernel as
the oracle, and the promise that unconstrained rows are left bit for bit as they were."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from pagedserve.core.structured_output.manager import GrammarBitmask, StructuredOutputStats
from pagedserve.core.structured_output.masking import apply_bitmask_rows


def random_bitmask(rows: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    words = (vocab + 31) // 32
    mask = torch.randint(-2**31, 2**31 - 1, (rows, words), dtype=torch.int32, generator=generator)
    mask[0] = 0  # nothing allowed
    mask[1] = -1  # everything allowed
    mask[2, :] = 0
    mask[2, -1] = -2**31 if vocab % 32 == 0 else 1  # one token: bit 31 (the sign bit) or bit 0
    return mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [49152, 1000])  # SmolLM2's, and one not a multiple of 32
def test_masked_rows_match_xgrammar_and_other_rows_are_untouched(dtype, vocab):
    gen = torch.Generator().manual_seed(vocab)
    batch, positions = 9, [1, 2, 4, 7, 8]
    bitmask = random_bitmask(len(positions), vocab, gen)
    logits = torch.randn(batch, vocab, generator=gen).to(dtype)
    got = logits.clone()
    threads = torch.get_num_threads()
    apply_bitmask_rows(got, positions, bitmask)
    assert torch.get_num_threads() == threads  # masking runs on one thread, then gives the rest back

    want = logits.clone()
    full = torch.full((batch, bitmask.shape[1]), -1, dtype=torch.int32)
    full[positions] = bitmask
    xgr.apply_token_bitmask_inplace(want, full, vocab_size=vocab, indices=positions)
    assert torch.equal(got, want)
    others = [i for i in range(batch) if i not in positions]
    assert torch.equal(got[others], logits[others])  # bit for bit, not just close
    assert torch.isinf(got[positions[0]]).all() and torch.equal(got[positions[1]], logits[positions[1]])
    assert torch.isfinite(got[positions[2]]).sum() == 1


def test_grammar_bitmask_maps_samples_to_their_rows():
    """The runner hands logits in batch order; the bitmask rows come in prepare()'s order, which
    may skip samples (unsatisfiable ones): each sample (seq_id) gets its own row's mask."""
    vocab = 64
    bitmask = torch.zeros(3, 2, dtype=torch.int32)
    for row, token in enumerate((3, 40, 17)):  # row r allows only this token
        bitmask[row, token // 32] = 1 << (token % 32)
    stats = StructuredOutputStats()
    a, b, c, free = 10, 11, 12, 99  # seq_ids
    grammar = GrammarBitmask(bitmask, {a: 0, c: 2}, stats)  # b's row 1 was dropped
    logits = torch.randn(4, vocab)
    masked = logits.clone()
    grammar.apply(masked, [free, c, b, a])
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])
    assert masked[1].argmax() == 17 and torch.isfinite(masked[1]).sum() == 1
    assert masked[3].argmax() == 3 and torch.isfinite(masked[3]).sum() == 1
    assert stats.apply_s > 0
