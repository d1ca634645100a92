"""SamplingParams: how one request is decoded. Frozen; `from_dict` is the one strict parser
every adapter uses, so the same bad input gets the same error everywhere."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.core.errors import InvalidRequest
from pagedserve.core.validation import build_strict, check_range

_GREEDY_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    """0 means greedy (argmax)."""
    max_tokens: int | None = 16
    """Most tokens to generate; None means up to max_model_len."""
    min_tokens: int = 0
    ignore_eos: bool = False
    seed: int | None = None
    """Per-request seed: the same tokens whatever else shares the batch."""
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_range(InvalidRequest, "temperature", self.temperature, 0.0, 100.0)
        check_range(InvalidRequest, "max_tokens", self.max_tokens, 1, hint="ask for at least one token")
        check_range(InvalidRequest, "min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequest(f"min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}")
        check_range(InvalidRequest, "seed", self.seed, -(2**63), 2**63 - 1)
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        for tok in self.stop_token_ids:
            check_range(InvalidRequest, "stop_token_ids", tok, 0)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "SamplingParams":
        return build_strict(cls, data, InvalidRequest, "sampling parameters")
