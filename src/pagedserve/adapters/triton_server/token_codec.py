"""Triton tensors <-> engine, for the token-level contract of TensorRT-LLM's `tensorrt_llm` model
(requests with `input_ids` to model_repository/pagedserve, contracts.py): token ids in, token ids
out, no tokenizer on the wire.

    input_ids INT32 [-1], request_output_len INT32 [1]
    optional: end_id, pad_id, runtime_top_k INT32 [1]; temperature, runtime_top_p FP32 [1];
              random_seed UINT64 [1]; streaming, stop, exclude_input_in_output BOOL [1]
              guided_decoding_guide_type, guided_decoding_guide STRING [1] (structured output)
              cache_salt STRING [1] (prefix-cache isolation: only requests with the same salt
              share cached prompt blocks; pagedserve's, shared with the text contract)
              lora_name STRING [1] (the LoRA adapter to run; absent: the base model; shared
              with the text contract, where vllm_backend's clients send it in sampling_parameters)
    -> output_ids INT32 [-1, -1] (beam x tokens, beam width 1), sequence_length INT32 [-1]

Semantics follow TensorRT-LLM where it has them: decoding is greedy unless runtime_top_k > 1 or
runtime_top_p > 0 asks for sampling; `end_id` replaces the model's EOS as the token that ends a
sequence (it is not part of the output); non-streaming output_ids hold prompt + generated tokens
unless exclude_input_in_output, and sequence_length counts what output_ids holds; streaming
responses carry only the new tokens. `stop` = true ends the request before it generates anything.
`pad_id` only pads beams of unequal length in TensorRT-LLM; with one beam it changes nothing.
Structured output as TensorRT-LLM spells it: guided_decoding_guide_type "json" (any JSON object),
"json_schema", "regex" or "ebnf_grammar", with the schema / pattern / grammar in guided_decoding_guide.

The shipped model does not declare `stop` (see its config.pbtxt); a model restricted to this
contract may.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from pagedserve.core.errors import InvalidRequest
from pagedserve.core.outputs import RequestOutput
from pagedserve.core.sampling_params import SamplingParams
from pagedserve.adapters.triton_server.codec import (CACHE_SALT, LORA_NAME, cache_salt_input, decode_utf8,
                                                     lora_name_input, parse_bool, scalar)
from pagedserve.core.structured_output.params import StructuredOutputParams, build_constraint

TOKEN_INPUTS = ("input_ids", "request_output_len", "end_id", "pad_id", "temperature", "runtime_top_k",
                "runtime_top_p", "random_seed", "streaming", "stop", "exclude_input_in_output",
                "guided_decoding_guide_type", "guided_decoding_guide", CACHE_SALT, LORA_NAME)
_GUIDE_TYPES = {"json": "json_object", "json_schema": "json", "regex": "regex", "ebnf_grammar": "grammar"}
"""TensorRT-LLM's guide types -> the structured_outputs field that means the same."""


@dataclass(frozen=True)
class TokenRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool = False
    stop_now: bool = False
    """TensorRT-LLM's `stop` input: end the request before it generates anything."""
    exclude_input_in_output: bool = False
    cache_salt: str | None = None
    lora_name: str | None = None
    """The LoRA adapter to run (None: the base model)."""

    @property
    def prompt(self) -> list[int]:
        return self.prompt_ids

    @property
    def generates(self) -> bool:
        """False for `stop`: the one final response is sent without running the engine."""
        return not self.stop_now


def _int(tensors: Mapping[str, np.ndarray | None], name: str) -> int | None:
    value = scalar(tensors.get(name), name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{name}: expected an integer, got {value!r}")
    return value


def _float(tensors: Mapping[str, np.ndarray | None], name: str) -> float | None:
    value = scalar(tensors.get(name), name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(f"{name}: expected a number, got {value!r}")
    return float(value)


def _flag(tensors: Mapping[str, np.ndarray | None], name: str) -> bool:
    value = scalar(tensors.get(name), name)
    return False if value is None else parse_bool(value, name)


def _guide(tensors: Mapping[str, np.ndarray | None]) -> StructuredOutputParams | None:
    raw_type = scalar(tensors.get("guided_decoding_guide_type"), "guided_decoding_guide_type")
    raw_guide = scalar(tensors.get("guided_decoding_guide"), "guided_decoding_guide")
    guide = None if raw_guide is None else decode_utf8(raw_guide, "guided_decoding_guide")
    if raw_type is None:
        if guide is not None:
            raise InvalidRequest("guided_decoding_guide needs guided_decoding_guide_type (json_schema, regex, "
                                 "ebnf_grammar)", param="guided_decoding_guide_type")
        return None
    guide_type = decode_utf8(raw_type, "guided_decoding_guide_type")
    kind = _GUIDE_TYPES.get(guide_type)
    if kind is None:
        raise InvalidRequest(f"guided_decoding_guide_type={guide_type!r} is not supported; use one of "
                             f"{', '.join(_GUIDE_TYPES)}", param="guided_decoding_guide_type")
    if kind == "json_object":
        return build_constraint(kind, True, "guided_decoding_guide_type")
    if guide is None:
        raise InvalidRequest(f"guided_decoding_guide_type={guide_type!r} needs guided_decoding_guide (the "
                             "schema, pattern or grammar)", param="guided_decoding_guide")
    return build_constraint(kind, guide, "guided_decoding_guide")


def parse_token_request(tensors: Mapping[str, np.ndarray | None]) -> TokenRequest:
    ids = tensors.get("input_ids")
    if ids is None or np.asarray(ids).size == 0:
        raise InvalidRequest("input_ids is missing or empty: send the prompt's token ids as INT32 input 'input_ids'")
    prompt_ids = [int(t) for t in np.asarray(ids).reshape(-1)]  # range-checked by the engine
    max_tokens = _int(tensors, "request_output_len")
    if max_tokens is None:
        raise InvalidRequest("request_output_len is missing: send the number of tokens to generate (INT32 [1])")
    top_k = _int(tensors, "runtime_top_k") or 0
    top_p = _float(tensors, "runtime_top_p") or 0.0
    temperature = _float(tensors, "temperature")
    sampling = top_k > 1 or top_p > 0.0
    fields: dict = {"max_tokens": max_tokens, "top_k": top_k if sampling else 0,
                    "top_p": top_p if top_p > 0.0 else 1.0,
                    "temperature": (1.0 if temperature is None else temperature) if sampling else 0.0}
    end_id = _int(tensors, "end_id")
    if end_id is not None:  # end_id is THE end token: the model's own EOS no longer ends a sequence
        fields.update(stop_token_ids=[end_id], ignore_eos=True)
    seed = _int(tensors, "random_seed")
    if seed is not None:
        fields["seed"] = seed
    _int(tensors, "pad_id")  # type-checked only: one beam never needs padding
    params = dataclasses.replace(SamplingParams.from_dict(fields), structured_output=_guide(tensors))
    return TokenRequest(prompt_ids, params, _flag(tensors, "streaming"),
                        _flag(tensors, "stop"), _flag(tensors, "exclude_input_in_output"), cache_salt_input(tensors),
                        lora_name_input(tensors))


class TokenResponseBuilder:
    """RequestOutput deltas -> output_ids / sequence_length (streaming: one response per delta)."""

    def __init__(self, request: TokenRequest) -> None:
        self.request = request
        self.generated: list[int] = []

    def _ids(self, request_output_ids: list[int], out: RequestOutput | None) -> list[int]:
        end = self.request.params.stop_token_ids
        # The end token closes the sequence; TensorRT-LLM leaves it out of output_ids.
        if out is not None and out.finished and end and request_output_ids and request_output_ids[-1] in end \
                and out.stop_reason in end:
            return request_output_ids[:-1]
        return request_output_ids

    def add(self, out: RequestOutput) -> dict[str, np.ndarray] | None:
        self.generated.extend(out.new_token_ids)
        self.last = out
        if not self.request.stream:
            return None
        return self._outputs(self._ids(list(out.new_token_ids), out))

    def final(self) -> dict[str, np.ndarray]:
        ids = self._ids(self.generated, getattr(self, "last", None))
        prefix = [] if self.request.exclude_input_in_output else self.request.prompt_ids
        return self._outputs(prefix + ids)

    @staticmethod
    def _outputs(ids: list[int]) -> dict[str, np.ndarray]:
        return {"output_ids": np.array([ids], dtype=np.int32).reshape(1, len(ids)),
                "sequence_length": np.array([len(ids)], dtype=np.int32)}
