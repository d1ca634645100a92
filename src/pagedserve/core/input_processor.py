"""InputProcessor: a request's prompt and parameters checked and turned into what the scheduler
takes (token ids, prepared SamplingParams, a resolved max_tokens), before anything is queued.

Thread-safe except for `check_lengths`, which asks the scheduler: AsyncLLMEngine tokenizes, renders
chat templates and prepares parameters on its tokenizer pool, off the engine thread, so a long
prompt never holds up a step (vLLM's v1 engine splits its input processor off the same way)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from pagedserve.core.errors import InvalidRequest, RequestTooLong
from pagedserve.core.limits import max_prompt_chars
from pagedserve.core.models.arch import ModelArch
from pagedserve.core.sampling_params import SamplingParams


class InputProcessor:
    def __init__(self, tokenizer, arch: ModelArch, max_model_len: int, model_path: str) -> None:
        self.tokenizer, self.arch, self.max_model_len, self.model_path = tokenizer, arch, max_model_len, model_path
        self.max_prompt_chars = max_prompt_chars(tokenizer, max_model_len)
        """Text prompts longer than this cannot fit max_model_len: refused before tokenizing."""

    def check_prompt_chars(self, num_chars: int) -> None:
        """Refuse a text of num_chars characters that cannot fit max_model_len, before tokenizing."""
        if num_chars > self.max_prompt_chars:
            raise RequestTooLong(
                f"prompt has {num_chars} characters, more than max_model_len={self.max_model_len} tokens "
                f"can hold (at most {self.max_prompt_chars} characters); shorten the prompt")

    def check_prompt_size(self, prompt: str | Sequence[int]) -> None:
        """Refuse, without tokenizing, a prompt that cannot fit max_model_len (cheap: a length)."""
        if isinstance(prompt, str):
            self.check_prompt_chars(len(prompt))
        if isinstance(prompt, (list, tuple)) and len(prompt) >= self.max_model_len:
            raise RequestTooLong(f"prompt has {len(prompt)} tokens but max_model_len is {self.max_model_len}; "
                                 "shorten the prompt")

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt (text is encoded, ids are validated)."""
        self.check_prompt_size(prompt)
        if isinstance(prompt, str):
            return self._refuse_image_tokens(self.tokenizer.encode(prompt, add_special_tokens=True))
        if not isinstance(prompt, Sequence) or isinstance(prompt, (bytes, bytearray)):
            raise InvalidRequest(f"prompt: expected a string or a list of token ids, got {type(prompt).__name__}")
        ids = list(prompt)
        vocab = self.arch.vocab_size
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
                raise InvalidRequest(f"prompt token ids: item {i} is {t!r}; token ids must be integers in [0, {vocab})")
        return self._refuse_image_tokens(ids)

    def _refuse_image_tokens(self, ids: list[int]) -> list[int]:
        """A multimodal checkpoint served as its text decoder (Gemma3ForConditionalGeneration): its
        image placeholder token would be embedded as a word, where the model expects image features."""
        image = self.arch.image_token_id
        if image is not None and image in ids:
            raise InvalidRequest(
                f"prompt holds token id {image}, this model's image placeholder "
                f"({self.tokenizer.convert_ids_to_tokens(image)!r}): pagedserve serves the text decoder of "
                f"{self.arch.architecture} and takes no images; send text only")
        return ids

    def prepare_params(self, params: SamplingParams) -> SamplingParams:
        """What only the engine can check or fill in a request's SamplingParams: logit_bias ids
        inside the vocabulary, bad_words tokenized into bad_words_token_ids (vLLM's two spellings
        of each word: as sent, and after a space). A no-op on params that need nothing or were
        prepared already."""
        vocab = self.arch.vocab_size
        for token, _bias in params.logit_bias:
            if token >= vocab:
                raise InvalidRequest(f"logit_bias: token id {token} is outside the vocabulary [0, {vocab}); "
                                     "bias ids the model's tokenizer produces", param="logit_bias")
        if not params.bad_words or params.bad_words_token_ids:
            return params
        words: list[tuple[int, ...]] = []
        for word in params.bad_words:
            plain = tuple(self.tokenizer.encode(word.lstrip(), add_special_tokens=False))
            spaced = tuple(self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
            words += [w for w in dict.fromkeys((plain, spaced)) if w]
        return dataclasses.replace(params, bad_words_token_ids=tuple(words))

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: Sequence[dict[str, Any]] | None = None) -> str:
        """Render chat messages ([{"role": ..., "content": ...}, ...]) with the model's template.
        A message may carry more keys the template reads (an assistant's `tool_calls`, a tool
        message's `tool_call_id`); `tools` (function definitions) reach the template as `tools`,
        and templates that ignore them render as without."""
        if not self.tokenizer.chat_template:
            raise InvalidRequest(f"the model at {self.model_path} has no chat template; send a plain prompt")
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
            raise InvalidRequest("messages: expected a non-empty list of {role, content} objects")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise InvalidRequest(f"messages[{i}]: expected {{\"role\": str, \"content\": str}}, got {m!r}")
        if tools is not None and (isinstance(tools, (str, dict)) or not all(isinstance(t, dict) for t in tools)):
            raise InvalidRequest(f"tools: expected a list of function definitions, got {tools!r}", param="tools")
        return self.tokenizer.apply_chat_template(list(messages), tools=list(tools) if tools else None,
                                                  tokenize=False, add_generation_prompt=add_generation_prompt)

    def check_lengths(self, n: int, params: SamplingParams,
                      max_fitting_tokens: Callable[[int], int | None]) -> int:
        """Validate a prompt of n tokens against max_model_len and the KV pool (max_fitting_tokens:
        the scheduler's, None when the total fits); return the resolved max_tokens."""
        limit = self.max_model_len
        if n >= limit:
            raise RequestTooLong(f"prompt has {n} tokens but max_model_len is {limit}; shorten the prompt")
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - n
        if n + max_tokens > limit:
            raise RequestTooLong(
                f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds max_model_len={limit}; "
                f"lower max_tokens to at most {limit - n}"
            )
        cap = max_fitting_tokens(n + max_tokens)
        if cap is not None:
            raise RequestTooLong(
                f"prompt + max_tokens = {n + max_tokens} tokens exceeds the whole KV cache ({cap} tokens); "
                "lower max_tokens or raise kv_cache_memory"
            )
        return max_tokens
