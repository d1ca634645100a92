"""The shipped Triton model repository and the adapter agree on what a request may carry.

One model serves both contracts, so its config.pbtxt must declare every input the codecs read
(an input Triton does not know is refused before it reaches the model) and nothing the codecs do
not read (it would arrive and be ignored). When a codec learns a new input (e.g. structured-output
guides), this test fails until the shipped model declares it too.
"""

from __future__ import annotations

import re

from pagedserve.adapters.triton_server.contracts import ALL_INPUTS
from pagedserve.adapters.triton_server.launcher import DEFAULT_REPOSITORY

NOT_DECLARED = {"stop"}
"""TensorRT-LLM's BOOL `stop`: left out on purpose, since Triton's /generate would turn a
vllm_backend client's "stop": "<string>" parameter into that input (docs/triton.md)."""


def declared(section: str) -> dict[str, str]:
    """name -> the text of its entry, for the entries of config.pbtxt's `input [...]` or `output [...]`."""
    text = re.sub(r"#[^\n]*", "", (DEFAULT_REPOSITORY / "pagedserve" / "config.pbtxt").read_text())
    body = re.search(rf"\b{section}\s*\[(.*?)\n\]", text, re.S)
    assert body, f"no {section} section in config.pbtxt"
    entries = re.findall(r"\{([^{}]*)\}", body.group(1))
    return {re.search(r'name:\s*"([^"]+)"', e).group(1): e for e in entries}


def test_the_default_repository_holds_one_model():
    models = sorted(p.parent.name for p in DEFAULT_REPOSITORY.glob("*/config.pbtxt"))
    assert models == ["pagedserve"]  # one stub process, one engine, by default


def test_shipped_model_declares_what_the_codecs_read_all_optional():
    inputs = declared("input")
    assert set(inputs) == set(ALL_INPUTS) - NOT_DECLARED, (
        f"declared but never read: {sorted(set(inputs) - set(ALL_INPUTS))}; "
        f"read but not declared: {sorted(set(ALL_INPUTS) - NOT_DECLARED - set(inputs))}")
    required = [name for name, entry in inputs.items() if not re.search(r"optional:\s*true", entry)]
    assert required == [], "every input is optional: each request carries only its own contract's"
    outputs = declared("output")
    assert {"text_output", "finish_reason", "output_ids", "sequence_length"} <= set(outputs)
