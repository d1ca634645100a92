"""EngineConfig: strict from_dict naming field, value and fix."""

from __future__ import annotations

import pytest

from pagedserve.core.config import EngineConfig
from pagedserve.core.errors import ConfigError


def test_defaults_and_flat_keys():
    cfg = EngineConfig.from_dict({"model": "/m", "block_size": 32, "max_num_seqs": 8, "dtype": "bf16"})
    assert cfg.cache.block_size == 32 and cfg.scheduler.max_num_seqs == 8
    assert cfg.model.dtype == "bfloat16"  # aliases normalised
    assert EngineConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.replace(block_size=16).cache.block_size == 16


@pytest.mark.parametrize(
    "data,needle",
    [
        ({"blocksize": 16}, "unknown key(s) 'blocksize'; known keys:"),
        ({"block_size": "16"}, "block_size: expected an integer, got '16'"),
        ({"block_size": True}, "block_size: expected an integer"),
        ({"block_size": 0}, "block_size=0 is out of range"),
        ({"max_num_seqs": -1}, "max_num_seqs=-1 is out of range"),
        ({"dtype": "int4"}, "dtype='int4' is not supported"),
        ({"kv_cache_dtype": "int4"}, "kv_cache_dtype='int4' is not supported"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization=1.5 is out of range"),
        ({"device": "tpu"}, "device='tpu' is not supported"),
        ({"enable_prefix_caching": "yes"}, "enable_prefix_caching: expected true or false"),
        ({"max_waiting_requests": 0}, "max_waiting_requests=0 is out of range"),
        ({"max_waiting_prompt_tokens": -1}, "max_waiting_prompt_tokens=-1 is out of range"),
        ({"request_timeout": 0}, "request_timeout=0.0 is out of range"),
        ({"request_timeout": float("nan")}, "request_timeout=nan is not a number"),
        ({"max_request_bytes": 10}, "max_request_bytes=10 is out of range"),
        ({"drain_timeout": "5"}, "drain_timeout: expected a number"),
    ],
)
def test_bad_values_name_the_field(data, needle):
    with pytest.raises(ConfigError) as exc:
        EngineConfig.from_dict(data)
    assert needle in str(exc.value)


def test_not_a_dict():
    with pytest.raises(ConfigError, match="expected a JSON object"):
        EngineConfig.from_dict(["block_size", 16])  # type: ignore[arg-type]
