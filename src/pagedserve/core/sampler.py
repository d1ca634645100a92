"""Batched sampling over the logits of a whole step.

Order (as vLLM): logit_bias, repetition penalty, presence/frequency penalties, bans (min_tokens'
EOS and stop ids, bad_words); then greedy rows take the argmax (the kernel backend's argmax_rows) and random rows go through temperature, top-k, top-p, min-p and the draw. Every stage
is a tensor op over all rows that need it and is skipped when no row does, so a greedy-only batch
costs one argmax. Python loops run over requests (to read their parameters), never over the vocabulary.

Random draws use the exponential race (argmax of probs / Exp(1) noise is a sample from probs), so
each seeded request draws exactly one noise vector per token from its own generator: the same
tokens whatever else shares the batch and however the prompt was chunked.

Logprobs are of the raw model distribution, log_softmax(logits) before any processing (vLLM's
default), so they can be compared with transformers.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch
from torch import Tensor

from pagedserve.core.outputs import TokenLogprobs
from pagedserve.core.sampling_params import SamplingParams
from pagedserve.kernels.reference.sampling import argmax_rows as reference_argmax_rows

_TOP_P_CANDIDATES = 1024
"""Top-p without top-k first looks for the nucleus among this many most likely tokens."""


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    """One per row; None where the request did not ask for logprobs."""


def token_counts(token_ids: Sequence[Sequence[int]] | Sequence[Tensor], vocab_size: int,
                 device: torch.device) -> Tensor:
    """fp32 [rows, vocab]: how often each token occurs in each row's list. One scatter_add over the
    concatenated lists at row * vocab + token: no padding, no loop over the vocabulary."""
    lengths = torch.tensor([len(t) for t in token_ids], device=device)
    if token_ids and all(isinstance(t, Tensor) for t in token_ids):  # e.g. cached prompts, on the device
        flat = torch.cat([t.to(device) for t in token_ids])
    else:  # Python lists: one numpy buffer and one copy (torch.tensor(list) is slow per element)
        flat = torch.from_numpy(np.fromiter(chain.from_iterable(token_ids), np.int64)).to(device)
    flat = flat + torch.repeat_interleave(torch.arange(len(token_ids), device=device) * vocab_size, lengths)
    counts = torch.zeros(len(token_ids) * vocab_size, device=device)
    counts.scatter_add_(0, flat, torch.ones(flat.shape, device=device))
    return counts.view(len(token_ids), vocab_size)


def apply_penalties(logits: Tensor, params: Sequence[SamplingParams], output_token_ids: Sequence[Sequence[int]],
                    prompt_token_ids: Sequence[Sequence[int]] | Sequence[Tensor]) -> Tensor:
    """Penalised copy of fp32 logits [rows, vocab], one row per params entry.

    Repetition (HF): a token seen in prompt or output has its logit divided by the penalty if
    positive, multiplied if negative. Presence/frequency (OpenAI), output tokens only:
    logit -= presence * (count > 0) + frequency * count.
    """
    device, vocab = logits.device, logits.shape[1]
    out_counts = token_counts(output_token_ids, vocab, device)
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = (token_counts(prompt_token_ids, vocab, device) > 0) | (out_counts > 0)
        rep = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    if any(p.frequency_penalty != 0.0 for p in params):
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
        logits = logits - frequency * out_counts
    if any(p.presence_penalty != 0.0 for p in params):
        presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
        logits = logits - presence * (out_counts > 0)
    return logits


def apply_top_k_top_p(logits: Tensor, top_k: Sequence[int], top_p: Sequence[float]) -> Tensor:
    """Mask (-inf) all but each row's top_k logits (0 = off; ties with the k-th are kept, as in
    transformers), then all but the smallest most-likely set whose probability, renormalised over
    the top-k survivors, reaches top_p (1 = off; the most likely token always stays)."""
    vocab = logits.shape[1]
    device, neg_inf = logits.device, float("-inf")
    k_list = [min(k, vocab) if k > 0 else vocab for k in top_k]
    k = torch.tensor(k_list, device=device)[:, None]
    # p >= 1 -> inf: float rounding of the cumsum must not cut the tail of a disabled row.
    p = torch.tensor([q if q < 1.0 else float("inf") for q in top_p], device=device)[:, None]
    # The kept tokens are the most likely ones, so the `width` best (topk: linear in the vocabulary)
    # usually hold them all and a full sort (slow: seconds per step on CPU) is the fallback. The
    # extra candidate tells: if it is masked, so is everything after it.
    width = min(vocab, 1 + max(kk if kk < vocab else _TOP_P_CANDIDATES for kk in k_list))
    while True:
        values, order = logits.topk(width, dim=-1) if width < vocab else logits.sort(dim=-1, descending=True)
        kth = torch.where(k < vocab, values.gather(1, (k - 1).clamp(max=width - 1)), neg_inf)
        values = values.masked_fill(values < kth, neg_inf)
        # normalised over the whole top-k set, not just over the candidates
        log_norm = logits.masked_fill(logits < kth, neg_inf).logsumexp(dim=-1, keepdim=True)
        probs = (values - log_norm).exp()
        values = values.masked_fill(probs.cumsum(dim=-1) - probs >= p, neg_inf)  # mass above the token >= p
        if width == vocab or bool(torch.isinf(values[:, -1]).all()):
            return torch.full_like(logits, neg_inf).scatter_(1, order, values)
        width = vocab


def apply_min_p(logits: Tensor, min_p: Sequence[float]) -> Tensor:
    """Mask tokens whose probability is below min_p * (the row's highest probability).
    In logit space: logit < max_logit + log(min_p); min_p = 0 gives -inf and masks nothing."""
    threshold = torch.tensor(min_p, device=logits.device).log()[:, None]
    threshold = threshold + logits.max(dim=-1, keepdim=True).values
    return logits.masked_fill(logits < threshold, float("-inf"))


@dataclass(slots=True, eq=False)
class _SampleCache:
    """What the sampler keeps across steps for one sample (only samples that need it have one)."""

    generator: torch.Generator | None = None
    """Its seeded generator (seeded samples): draws continue where the last step stopped."""
    prompt_ids: Tensor | None = None
    """Its prompt ids on the device (repetition penalty): a long prompt is not rebuilt from a Python
    list at every step."""


def bad_word_bans(bad_words_token_ids: Sequence[Sequence[int]], output_token_ids: Sequence[int]) -> list[int]:
    """The last token of every bad word whose other tokens end the output so far (vLLM's rule):
    sampling it would complete the word. A one-token word is always banned."""
    banned = []
    for word in bad_words_token_ids:
        prefix_len = len(word) - 1
        if prefix_len > len(output_token_ids):
            continue
        if prefix_len == 0 or list(output_token_ids[len(output_token_ids) - prefix_len:]) == list(word[:-1]):
            banned.append(word[-1])
    return banned


class Sampler:
    def __init__(self, argmax_rows: Callable[[Tensor], Tensor] | None = None) -> None:
        """argmax_rows: the kernel backend's row-wise argmax (the first of equal maxima, a row's
        first NaN); None: the reference's, torch's max(dim)."""
        self._argmax = argmax_rows or reference_argmax_rows
        self._cache: dict[Hashable, _SampleCache] = {}
        """seq_id -> the sample's cache; dropped by `forget` when the scheduler reports it finished."""

    @property
    def argmax_rows(self) -> Callable[[Tensor], Tensor]:
        """The row-wise argmax greedy rows take (the kernel backend's, or the reference's)."""
        return self._argmax

    @staticmethod
    def greedy_only(params: Sequence[SamplingParams], output_token_ids: Sequence[Sequence[int]],
                    eos_token_ids: Sequence[int | None]) -> bool:
        """Whether __call__ would return argmax_rows(logits) for these rows and nothing else: every
        row greedy, without logit_bias, penalties, logprobs, bad_words, or a min_tokens ban this
        step. The runner then asks the model for the tokens alone (LlamaDecoder.greedy_tokens),
        and an LM head kernel that folds the argmax never stores the logits."""
        for p, output, eos in zip(params, output_token_ids, eos_token_ids):
            if not p.greedy or p.logit_bias or p.uses_penalties or p.logprobs is not None or p.bad_words_token_ids:
                return False
            if len(output) < p.min_tokens and (p.stop_token_ids or (eos is not None and not p.ignore_eos)):
                return False
        return True

    def forget(self, seq_ids: Sequence[Hashable]) -> None:
        for seq_id in seq_ids:
            self._cache.pop(seq_id, None)

    def _entry(self, seq_id: Hashable) -> _SampleCache:
        entry = self._cache.get(seq_id)
        if entry is None:
            entry = self._cache[seq_id] = _SampleCache()
        return entry

    def _generator(self, seq_id: Hashable, seed: int) -> torch.Generator:
        entry = self._entry(seq_id)
        if entry.generator is None:
            entry.generator = torch.Generator().manual_seed(seed)
        return entry.generator

    def _prompt(self, seq_id: Hashable, prompt_token_ids: Sequence[int], device: torch.device) -> Tensor:
        entry = self._entry(seq_id)
        ids = entry.prompt_ids
        if ids is None or ids.numel() != len(prompt_token_ids):
            ids = torch.from_numpy(np.fromiter(prompt_token_ids, np.int64, len(prompt_token_ids)))
            ids = entry.prompt_ids = ids.to(device)
        return ids

    def __call__(self, logits: Tensor, seq_ids: Sequence[Hashable], params: list[SamplingParams],
                 output_token_ids: list[Sequence[int]], prompt_token_ids: list[Sequence[int]],
                 eos_token_ids: list[int | None]) -> SamplerOutput:
        """logits [num_sampled, vocab] (any float dtype) -> one token per row (+ logprobs if asked).

        seq_ids: each row's sample (keys the seeded generators and cached prompts);
        output_token_ids / prompt_token_ids: each row's tokens so far (penalties, min_tokens);
        eos_token_ids: each row's EOS id (None: the model has none)."""
        num_rows, vocab = logits.shape
        lengths = {len(seq_ids), len(params), len(output_token_ids), len(prompt_token_ids), len(eos_token_ids)}
        if lengths != {num_rows}:
            raise ValueError(f"Sampler: {num_rows} logits rows but per-row lists of lengths {sorted(lengths)}")
        device = logits.device
        raw = logits.float()
        logits = raw  # replaced, never modified in place: `raw` stays for the logprobs

        biased = [i for i, p in enumerate(params) if p.logit_bias]
        if biased:
            bias = [(i, t, b) for i in biased for t, b in params[i].logit_bias if t < vocab]
            if bias:
                bias_rows, bias_cols, values = zip(*bias)
                index = (torch.tensor(bias_rows, device=device), torch.tensor(bias_cols, device=device))
                logits = logits.index_put(index, torch.tensor(values, device=device), accumulate=True)

        penalised = [i for i, p in enumerate(params) if p.uses_penalties]
        if penalised:
            rows = torch.tensor(penalised, device=device)
            sub = apply_penalties(
                logits[rows], [params[i] for i in penalised], [output_token_ids[i] for i in penalised],
                [self._prompt(seq_ids[i], prompt_token_ids[i], device) if params[i].repetition_penalty != 1.0
                 else torch.empty(0, dtype=torch.long, device=device) for i in penalised])
            logits = logits.index_put((rows,), sub)

        ban_rows: list[int] = []
        ban_cols: list[int] = []
        for i, p in enumerate(params):
            banned = []
            if len(output_token_ids[i]) < p.min_tokens:
                banned += p.stop_token_ids
                if eos_token_ids[i] is not None and not p.ignore_eos:
                    banned.append(eos_token_ids[i])
            if p.bad_words_token_ids:
                banned += bad_word_bans(p.bad_words_token_ids, output_token_ids[i])
            banned = [t for t in banned if t < vocab]  # ids past the logits can never be sampled
            ban_rows += [i] * len(banned)
            ban_cols += banned
        if ban_rows:
            index = (torch.tensor(ban_rows, device=device), torch.tensor(ban_cols, device=device))
            logits = logits.index_put(index, torch.tensor(float("-inf"), device=device))

        tokens = self._argmax(logits)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=device)
            tokens[rows] = self._sample(logits[rows], [seq_ids[i] for i in random_rows],
                                        [params[i] for i in random_rows])
        token_ids = tokens.tolist()
        return SamplerOutput(token_ids, _logprobs(raw, token_ids, params))

    def _sample(self, logits: Tensor, seq_ids: list[Hashable], params: list[SamplingParams]) -> Tensor:
        """One draw per row from the processed distribution of fp32 logits [rows, vocab]."""
        device = logits.device
        temps = torch.tensor([p.temperature for p in params], device=device)
        logits = logits / temps[:, None]
        masked = [j for j, p in enumerate(params) if p.top_k > 0 or p.top_p < 1.0]
        if masked:
            rows = torch.tensor(masked, device=device)
            logits = logits.index_put((rows,), apply_top_k_top_p(
                logits[rows], [params[j].top_k for j in masked], [params[j].top_p for j in masked]))
        if any(p.min_p > 0.0 for p in params):
            logits = apply_min_p(logits, [p.min_p for p in params])
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs)
        unseeded = []
        for j, p in enumerate(params):
            if p.seed is None:
                unseeded.append(j)
            else:  # CPU generator: the draw does not depend on the device the engine runs on
                noise[j] = torch.empty(probs.shape[1]).exponential_(generator=self._generator(seq_ids[j], p.seed))
        if unseeded:
            idx = torch.tensor(unseeded, device=device)
            noise[idx] = torch.empty(len(unseeded), probs.shape[1], device=device).exponential_()
        return self._argmax(probs / noise)


def _logprobs(raw: Tensor, token_ids: list[int], params: list[SamplingParams]) -> list[TokenLogprobs | None]:
    """Raw-distribution logprobs of the sampled tokens, for the rows that asked."""
    out: list[TokenLogprobs | None] = [None] * len(params)
    asking = [i for i, p in enumerate(params) if p.logprobs is not None]
    if asking:
        rows = torch.tensor(asking, device=raw.device)
        found = compute_logprobs(raw[rows], [token_ids[i] for i in asking], [params[i].logprobs for i in asking])
        for i, lp in zip(asking, found):
            out[i] = lp
    return out


def compute_logprobs(raw: Tensor, token_ids: list[int], num_top: list[int]) -> list[TokenLogprobs]:
    """Raw-distribution logprobs of token_ids[i] under row i, with the row's num_top[i] best tokens.
    Used for sampled tokens and for prompt logprobs (where each row scores the next prompt token)."""
    logprobs = torch.log_softmax(raw.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(token_ids, dtype=torch.long, device=raw.device)[:, None])
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    k = min(max(num_top, default=0), logprobs.shape[1])
    top_values, top_ids = logprobs.topk(k, dim=-1)  # sorted, most likely first
    top_values, top_ids, chosen = top_values.tolist(), top_ids.tolist(), chosen[:, 0].tolist()
    return [TokenLogprobs(t, chosen[j], ranks[j], tuple(zip(top_ids[j][: num_top[j]], top_values[j][: num_top[j]])))
            for j, t in enumerate(token_ids)]
