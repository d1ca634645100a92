"""Constraint -> compiled grammar (xgrammar), cached per constraint and built off the engine thread.

Compiling a JSON schema takes tens of milliseconds for a typical one and can take seconds for a
large one (bench/grammar_backends.py). That work runs on a small pool of worker threads (xgrammar
releases the GIL while it compiles), and `submit` hands back a Future: AsyncLLMEngine awaits it
before the request reaches the engine thread, so a slow schema delays only its own request. Equal
constraints share one Future, so a schema is compiled once however many requests send it at once,
and stays cached (least recently used dropped first) for the next ones.

xgrammar itself is imported on the first compile, not when the engine starts: an engine that never
sees a constraint never pays for it.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from pagedserve.core.errors import InvalidRequest
from pagedserve.core.structured_output.params import ConstraintKind, StructuredOutputParams

logger = logging.getLogger(__name__)

CACHE_SIZE = 256
"""Compiled grammars kept (a compiled JSON schema is tens to hundreds of KB)."""
COMPILE_WORKERS = 2
JSON_SEPARATORS = (", ", ": ")
"""The layout generated JSON takes: `{"a": 1, "b": [2, 3]}`. Fixed whitespace (xgrammar's
any_whitespace=False): with free whitespace a small model can spend its tokens on blank lines."""

# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:123: " and may carry a failed-check prefix.
_XGRAMMAR_NOISE = re.compile(r"^\[[\d:]+\] \S+:\d+: |Check failed: \(.*?\) is false: ")
_WHAT = {ConstraintKind.JSON_SCHEMA: "JSON schema", ConstraintKind.REGEX: "regular expression",
         ConstraintKind.GRAMMAR: "EBNF grammar", ConstraintKind.CHOICE: "choice list",
         ConstraintKind.JSON_OBJECT: "JSON object constraint"}


def choice_grammar(choices: tuple[str, ...]) -> str:
    """EBNF for "exactly one of these strings". JSON string escapes are valid EBNF string escapes."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 cache_size: int = CACHE_SIZE, workers: int = COMPILE_WORKERS) -> None:
        """tokenizer: the engine's Hugging Face tokenizer; vocab_size: the model's logits width
        (may exceed the tokenizer's); stop_token_ids: the tokens that end a completed grammar."""
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._cache_size = cache_size
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._xgr_compiler = None
        self._xgr_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pagedserve-grammar")

    def submit(self, params: StructuredOutputParams) -> Future:
        """The compiled grammar of `params` as a Future (done at once on a cache hit). Thread-safe.
        A constraint that does not compile fails the Future with InvalidRequest naming its field."""
        key = params.cache_key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, params)
            self._cache[key] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda f: self._drop_if_broken(key, f))
        return future

    def compile(self, params: StructuredOutputParams):
        """Blocking compile (offline generate; the async engine awaits `submit` instead)."""
        return self.submit(params).result()

    def _drop_if_broken(self, key: tuple, future: Future) -> None:
        """Keep a bad constraint's InvalidRequest cached (same input, same answer); forget any other
        failure so that the next request retries."""
        exc = future.exception()
        if exc is not None and not isinstance(exc, InvalidRequest):
            with self._lock:
                if self._cache.get(key) is future:
                    del self._cache[key]

    def _compiler(self):
        with self._xgr_lock:
            if self._xgr_compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self._stop_token_ids)
                # Our own cache above keys by constraint; xgrammar's would hold a second copy.
                self._xgr_compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._xgr_compiler

    def _compile(self, params: StructuredOutputParams):
        compiler = self._compiler()
        kind, value = params.kind, params.value
        try:
            if kind is ConstraintKind.JSON_SCHEMA:
                return compiler.compile_json_schema(value, any_whitespace=False, separators=JSON_SEPARATORS)
            if kind is ConstraintKind.JSON_OBJECT:
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                    separators=JSON_SEPARATORS)
            if kind is ConstraintKind.REGEX:
                return compiler.compile_regex(value)
            if kind is ConstraintKind.CHOICE:
                return compiler.compile_grammar(choice_grammar(value))
            return compiler.compile_grammar(value)
        except (RuntimeError, ValueError, TypeError) as exc:
            message = _XGRAMMAR_NOISE.sub("", str(exc).strip()).strip()
            raise InvalidRequest(f"{params.param}: invalid {_WHAT[kind]}: {message}", param=params.param) from None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
