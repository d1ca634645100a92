"""Incremental detokenization and stop strings for one request.

Contract: the concatenation of every delta equals
`tokenizer.decode(output_token_ids, skip_special_tokens=...)` unless a stop string matched, in which
case the text ends just before the stop string (or just after it with include_stop_str_in_output).

Decoding is windowed, as in vLLM/TGI: the window holds the tokens from `prefix_offset` on; the first
`_read` of them were already turned into text ("prefix"), the rest are pending. Each update decodes
the window and the prefix alone and takes the difference, so per-token cost is O(window), and a
decoder's first-token treatment (SentencePiece drops the leading space of the first piece) hits the
prefix in both decodes alike and cancels out.

Two things make a window boundary unsafe, and we wait (hold the pending tokens) while either holds:
  * the window text ends in U+FFFD: byte-level BPE split a UTF-8 character and a later token may
    complete it (byte-level UTF-8 decoding is local once a boundary ends in a complete character);
  * the last rendered token is a byte-fallback piece (`<0xNN>`): the ByteFallback decoder decodes a
    whole run of byte pieces at once and turns the *entire* run into U+FFFD if any byte is invalid,
    so one more byte piece can change text we would already have emitted.
Waiting only delays text; at finish everything pending is decoded as the full decode would.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from pagedserve.core.errors import InvalidRequest

__all__ = ["IncrementalDetokenizer"]

_REPLACEMENT_CHAR = "\ufffd"
# SentencePiece byte-fallback pieces, as HF tokenizers name them.
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>\Z")


def _backend_decode(tokenizer):
    """The Rust decode behind `tokenizer.decode`, when calling it directly is provably the same:
    a plain fast tokenizer with no clean-up step. The Python wrapper costs about twice the decode
    itself, and we decode twice per token on the engine thread."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    try:
        from transformers import PreTrainedTokenizerFast  # already imported: it made `tokenizer`
    except ImportError:
        return None
    cls = type(tokenizer)
    overridden = any(getattr(cls, name) is not getattr(PreTrainedTokenizerFast, name)
                     for name in ("decode", "_decode"))
    if not isinstance(tokenizer, PreTrainedTokenizerFast) or overridden:
        return None
    return backend.decode


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text deltas and watches for stop strings.

    `prompt_token_ids` is accepted for the engine's call site but is deliberately not used as decoding
    context: the output text is defined as decode(output ids) alone, and decoding after the prompt
    would, e.g., keep a SentencePiece leading space that decode(output ids) drops. Stop strings are
    therefore never matched against the prompt either.
    """

    __slots__ = (
        "_tokenizer", "_backend_decode", "_skip_special_tokens", "_skipped_ids", "_stop",
        "_max_stop_len", "_stop_prefixes", "_include_stop", "_ids", "_read", "_prefix_text",
        "_released", "_unsent", "_tail", "_matched_stop", "_flushed", "_min_tokens", "_num_tokens",
    )

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        """min_tokens: no stop string can end the output before this many tokens (vLLM: the
        strings are first looked for once the output is longer than min_tokens)."""
        del prompt_token_ids  # see the class docstring: context only, never part of the output
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        for i, s in enumerate(stop):
            if not s:
                raise InvalidRequest(f"stop[{i}]={s!r}: stop strings must be non-empty")
        self._tokenizer = tokenizer
        self._backend_decode = _backend_decode(tokenizer)
        self._skip_special_tokens = skip_special_tokens
        # Ids that decode() may drop. `all_special_ids` misses some (SmolLM2's <repo_name> etc. are
        # special added tokens outside it), so take every added token: over-approximating only makes
        # us wait one token longer after a byte piece, under-approximating would break the contract.
        self._skipped_ids: frozenset[int] = (
            frozenset(getattr(tokenizer, "added_tokens_decoder", ()))
            | frozenset(getattr(tokenizer, "all_special_ids", ()))
            if skip_special_tokens else frozenset()
        )
        self._stop = stop
        self._max_stop_len = max(map(len, stop), default=0)
        # Proper prefixes of the stop strings by last char, longest first: the hold-back check
        # after each token is then one dict lookup for text that cannot start a stop string.
        prefixes = sorted({s[:k] for s in stop for k in range(1, len(s))}, key=len, reverse=True)
        self._stop_prefixes: dict[str, list[str]] = {}
        for prefix in prefixes:
            self._stop_prefixes.setdefault(prefix[-1], []).append(prefix)
        self._include_stop = include_stop_str_in_output
        self._ids: list[int] = []  # window: output ids from prefix_offset on
        self._read = 0  # window index of the first pending token
        self._prefix_text: str | None = ""  # decode(self._ids[:self._read]); None = recompute
        self._released: list[str] = []  # text already returned by get_delta
        self._unsent: list[str] = []  # settled text not yet returned (may end in a stop prefix)
        # Last (max_stop_len - 1) settled chars: a new stop match must end in the new text, so it
        # starts no earlier than this; also where a held-back stop prefix can be.
        self._tail = ""
        self._matched_stop: str | None = None
        self._flushed = False
        self._min_tokens = min_tokens
        self._num_tokens = 0  # output tokens fed so far

    # ------------------------------------------------------------------ public API

    @property
    def output_text(self) -> str:
        """Settled output text so far (all of it after get_delta(True)), stop-truncated."""
        return "".join(self._released) + "".join(self._unsent)

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the output, if any."""
        return self._matched_stop

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Feed newly generated tokens; returns the stop string if one just matched (then the
        request must finish), else None. Tokens fed after a match or after the final flush are
        ignored: the output is already complete."""
        if self._matched_stop is not None or self._flushed or not new_token_ids:
            return None
        self._ids.extend(new_token_ids)
        self._num_tokens += len(new_token_ids)
        text = self._decode(self._ids)
        if text.endswith(_REPLACEMENT_CHAR) or self._ends_in_byte_piece():
            return None  # a later token may still change the tail of `text`; wait for it
        return self._settle(text)

    def get_delta(self, finished: bool) -> str:
        """Text not yet returned. While not finished (and no stop matched), holds back pending
        tokens (incomplete UTF-8) and any suffix that could start a stop string. When finished,
        decodes what is still pending and releases everything that belongs to the output."""
        if finished and not self._flushed and self._matched_stop is None:
            self._flushed = True
            if self._read < len(self._ids):
                # Whatever the pending bytes decode to now is what the full decode gives too
                # (possibly U+FFFD for a sequence that never completed).
                self._settle(self._decode(self._ids))
        unsent = "".join(self._unsent)
        hold = 0
        if not finished and self._matched_stop is None:
            hold = min(self._stop_prefix_len(), len(unsent))
        delta = unsent[: len(unsent) - hold]
        self._unsent = [unsent[len(delta):]] if hold else []
        if delta:
            self._released.append(delta)
        return delta

    # ------------------------------------------------------------------ internals

    def _decode(self, ids: list[int]) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=self._skip_special_tokens)
        # Otherwise tokenizer.decode itself, so any post-processing it applies
        # (clean_up_tokenization_spaces, a subclass's own _decode) matches the reference decode.
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _ends_in_byte_piece(self) -> bool:
        """Whether the last token decode() renders is a byte-fallback piece. Only pending tokens are
        scanned: the last rendered token before `_read` is never a byte piece (we never settle
        there)."""
        id_to_token = self._tokenizer.convert_ids_to_tokens
        for tid in reversed(self._ids[self._read:]):
            piece = id_to_token(tid)
            if isinstance(piece, str) and _BYTE_PIECE.match(piece):
                return True
            if tid not in self._skipped_ids:
                return False
        return False

    def _settle(self, text: str) -> str | None:
        """The window decodes to `text` and its end is a safe boundary: turn the pending tokens
        into settled text and slide the window."""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[: self._read])
        new_text = text[len(self._prefix_text):]
        if new_text:
            # The pending tokens become the next prefix. Only move the window start when they
            # rendered something: a prefix of only dropped tokens would decode to "" and let the
            # decoder's first-token treatment (leading-space strip) hit the next tokens instead.
            del self._ids[: self._read]
            self._prefix_text = None
        else:
            self._prefix_text = text  # window start unchanged; the whole window is now prefix
        self._read = len(self._ids)
        return self._append(new_text) if new_text else None

    def _append(self, new_text: str) -> str | None:
        """Add settled text; on a stop match truncate the output and return the stop string."""
        if not self._stop:
            self._unsent.append(new_text)
            return None
        region = self._tail + new_text
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for s in self._stop if self._num_tokens > self._min_tokens else ():
            start = region.find(s, max(0, len(self._tail) - len(s) + 1))
            if start >= 0 and (best is None or (start + len(s), start) < best[:2]):
                best = (start + len(s), start, s)
        if best is None:
            self._unsent.append(new_text)
            keep = self._max_stop_len - 1
            self._tail = region[-keep:] if keep else ""
            return None
        # Earliest *end* wins, then earliest start: this is the stop a token-by-token stream sees
        # first, so the result does not depend on how text is split across updates. It equals
        # "earliest start" unless one stop string contains another.
        end, start, s = best
        cut = end if self._include_stop else start
        # A match never starts in released text: get_delta held back every suffix that could start
        # a stop string. So the cut falls inside unsent + new_text (cut_back >= 0).
        cut_back = len(region) - cut  # chars to drop from the end of the settled text
        unsent = "".join(self._unsent) + new_text
        self._unsent = [unsent[: len(unsent) - cut_back]]
        self._matched_stop = s
        return s

    def _stop_prefix_len(self) -> int:
        """Length of the longest suffix of the settled text that is a proper prefix of a stop."""
        candidates = self._stop_prefixes.get(self._tail[-1:])
        if candidates:
            for prefix in candidates:
                if self._tail.endswith(prefix):
                    return len(prefix)
        return 0
