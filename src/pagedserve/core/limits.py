"""What one request, or a crowd of them, may ask of the engine (LimitsConfig in core/config.py).

* A character bound on text prompts, checked before tokenizing: a prompt with more characters than
  max_model_len tokens can possibly cover is refused at once, so a 16 MB prompt costs nothing.
* Bounds on the waiting queue (requests and their prompt tokens): past them a request is refused
  at once (EngineOverloaded) instead of queueing without limit.
* Deadlines: a request past its deadline ends with finish_reason "timeout" and frees its blocks.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Iterable

from pagedserve.core.config import LimitsConfig
from pagedserve.core.errors import EngineOverloaded
from pagedserve.core.metrics import EngineMetrics
from pagedserve.core.request import Sample

NORMALIZER_SLACK = 4
"""A tokenizer normalizer (NFKC and the like) can compose several characters into one (e.g. a
letter and a combining accent, or Hangul jamo) before any token is matched; a factor of 4 covers
every such composition, so the bound stays a sufficient condition for "cannot fit"."""


def max_prompt_chars(tokenizer, max_model_len: int) -> int:
    """Characters above which a text prompt cannot fit in max_model_len tokens.

    No token covers more characters than its own string in the vocabulary (byte-level BPE spells
    each byte as one character, SentencePiece spells a piece as itself or as `<0xNN>`), so a text
    of C characters has at least C / longest tokens. Computed once per engine.
    """
    vocab: Iterable[str] = tokenizer.get_vocab()
    longest = max((len(token) for token in vocab), default=1)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    slack = 1 if backend is not None and backend.normalizer is None else NORMALIZER_SLACK
    return max_model_len * max(longest, 1) * slack


class WaitingQueueGuard:
    """Refuses a request when the waiting queue is at its bounds; counts the refusals by reason
    ("waiting_requests" or "waiting_prompt_tokens") in the engine metrics."""

    def __init__(self, limits: LimitsConfig, metrics: EngineMetrics) -> None:
        self.limits = limits
        self.metrics = metrics

    def check(self, num_waiting: int, num_waiting_tokens: int, num_prompt_tokens: int) -> None:
        """Raise EngineOverloaded if a new request of num_prompt_tokens may not join the queue."""
        limit = self.limits.max_waiting_requests
        if limit is not None and num_waiting >= limit:
            self._refuse("waiting_requests",
                         f"the server is overloaded: {num_waiting} requests are already waiting "
                         f"(max_waiting_requests={limit}); retry later")
        limit = self.limits.max_waiting_prompt_tokens
        # A request alone in the queue is always admitted, however long (it fits max_model_len).
        if limit is not None and num_waiting_tokens > 0 and num_waiting_tokens + num_prompt_tokens > limit:
            self._refuse("waiting_prompt_tokens",
                         f"the server is overloaded: {num_waiting_tokens} prompt tokens are already waiting "
                         f"and this request adds {num_prompt_tokens} (max_waiting_prompt_tokens={limit}); "
                         "retry later")

    def _refuse(self, reason: str, message: str) -> None:
        self.metrics.observe_refused(reason)
        raise EngineOverloaded(message)


COMPACT_EVERY = 1024


class Deadlines:
    """Deadlines of live samples in a heap, so each step looks only at the ones that are due."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Sample]] = []
        self._order = 0  # ties broken by insertion order, never by comparing requests

    def add(self, request: Sample) -> None:
        if request.deadline is None:
            return
        self._order += 1
        heapq.heappush(self._heap, (request.deadline, self._order, request))
        if self._order % COMPACT_EVERY == 0:  # drop finished requests held only by their entry
            self._heap = [e for e in self._heap if not e[2].status.finished]
            heapq.heapify(self._heap)

    def pop_expired(self, now: float | None = None) -> list[Sample]:
        """Unfinished requests whose deadline has passed (finished ones are dropped here)."""
        now = time.monotonic() if now is None else now
        expired = []
        while self._heap and self._heap[0][0] <= now:
            request = heapq.heappop(self._heap)[2]
            if not request.status.finished:
                expired.append(request)
        return expired

    def clear(self) -> None:
        self._heap.clear()
