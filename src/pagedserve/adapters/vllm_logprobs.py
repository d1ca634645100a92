"""vLLM's JSON shape of logprobs, shared by the adapters that return it (Triton's text contract,
KServe's `prompt_logprobs`): per position {"<token id>": {"logprob", "rank", "decoded_token"}}, the
scored token first, then its position's top-N (each ranked by its place, 1 = most likely).

A logprob of -inf (a token a structured-output constraint forbids) is reported as MIN_LOGPROB:
JSON has no infinity (vLLM does the same).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from pagedserve.core.outputs import TokenLogprobs

MIN_LOGPROB = -9999.0
Position = dict[str, dict[str, Any]]


def position_json(entry: TokenLogprobs, decode_token: Callable[[int], str]) -> Position:
    pos = {str(entry.token_id): {"logprob": max(entry.logprob, MIN_LOGPROB), "rank": entry.rank,
                                 "decoded_token": decode_token(entry.token_id)}}
    for rank, (tid, lp) in enumerate(entry.top, start=1):
        pos.setdefault(str(tid), {"logprob": max(lp, MIN_LOGPROB), "rank": rank, "decoded_token": decode_token(tid)})
    return pos


def logprobs_json(entries: Sequence[TokenLogprobs | None], decode_token: Callable[[int], str]) -> list[Position | None]:
    """One position per entry; None stays None (the first prompt token: nothing precedes it)."""
    return [None if e is None else position_json(e, decode_token) for e in entries]
