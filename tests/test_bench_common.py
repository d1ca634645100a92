"""bench/common.py: workload files are validated, the generated workload is seeded and well-formed."""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import pytest

from bench.common import (GENERATED, LICENSE_DIR, LICENSE_TEXTS, W64, RunResult, Workload,
                          WorkloadError, WorkloadRequest, add_workload_args, generate_workload, load_workload, parse_workload, ratio_line,
                          source_text)

ROOT = Path(__file__).resolve().parents[1]


class WordTokenizer:
    """One id per distinct word: enough to test slicing without loading a real tokenizer."""

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}

    def __len__(self) -> int:
        return 1000

    def __call__(self, text: str, add_special_tokens: bool = True, verbose: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [self.vocab.setdefault(w, len(self.vocab) % 1000) for w in text.split()]}


TEXT = " ".join(f"w{i % 997}" for i in range(3000))


def test_generated_workload_is_seeded_and_in_range():
    tok = WordTokenizer()
    stream = tok(TEXT)["input_ids"]
    a = generate_workload(tok, num_requests=40, text=TEXT)
    b = generate_workload(tok, num_requests=40, text=TEXT)
    c = generate_workload(tok, num_requests=40, text=TEXT, seed=7)
    assert a.requests == b.requests and a.requests != c.requests
    assert len(a.requests) == 40
    for r in a.requests:
        assert 16 <= len(r.prompt_ids) <= 512 and 16 <= r.max_new_tokens <= 256
        # a contiguous slice of the tokenized text
        starts = [i for i in range(len(stream)) if stream[i:i + len(r.prompt_ids)] == r.prompt_ids]
        assert starts
    assert a.total_prompt_tokens == sum(len(r.prompt_ids) for r in a.requests)
    assert a.total_new_tokens == sum(r.max_new_tokens for r in a.requests)


def test_short_text_is_repeated():
    w = generate_workload(WordTokenizer(), num_requests=10, text="one two three four five six")
    assert all(16 <= len(r.prompt_ids) <= 512 for r in w.requests)


def test_head_keeps_arrival_order():
    w = Workload("w", "d", [WorkloadRequest([i + 1], 16 + i) for i in range(5)])
    h = w.head(2)
    assert h.requests == w.requests[:2] and h.name == "w[:2]"
    assert w.head(None) is w and w.head(99) is w
    with pytest.raises(ValueError):
        w.head(0)


def test_cap_new_tokens_caps_only_longer_requests():
    w = Workload("w", "d", [WorkloadRequest([i + 1], n) for i, n in enumerate((8, 20, 64))])
    c = w.cap_new_tokens(16)
    assert [r.max_new_tokens for r in c.requests] == [8, 16, 16]
    assert [r.prompt_ids for r in c.requests] == [r.prompt_ids for r in w.requests]
    assert c.name == "w[new<=16]" and w.cap_new_tokens(None) is w


def test_load_workload_file(tmp_path, capsys):
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"description": "tiny", "requests": [
        {"prompt_ids": [1, 2, 3], "max_new_tokens": 4}, {"prompt_ids": [5], "max_new_tokens": 2}]}))
    w = load_workload(str(path), WordTokenizer())
    assert w.requests == [([1, 2, 3], 4), ([5], 2)]
    assert w.name == "w.json" and w.description == "tiny"
    out = capsys.readouterr().out
    assert "w.json" in out and "4 prompt tokens" in out and "6 output tokens" in out


def test_load_without_path_generates_and_says_so(capsys):
    w = load_workload(None, WordTokenizer())
    assert len(w.requests) == 64 and w.name.startswith("generated")
    assert "generated" in capsys.readouterr().out


@pytest.mark.parametrize("data, match", [
    ([], "non-empty list 'requests'"),
    ({"requests": []}, "non-empty list 'requests'"),
    ({"requests": [3]}, r"requests\[0\] is int"),
    ({"requests": [{"prompt_ids": [], "max_new_tokens": 3}]}, r"requests\[0\].prompt_ids must be"),
    ({"requests": [{"prompt_ids": [1, "a"], "max_new_tokens": 3}]}, r"prompt_ids\[1\] = 'a'"),
    ({"requests": [{"prompt_ids": [1, 5000], "max_new_tokens": 3}]}, r"integers in \[0, 1000\)"),
    ({"requests": [{"prompt_ids": [True], "max_new_tokens": 3}]}, r"prompt_ids\[0\] = True"),
    ({"requests": [{"prompt_ids": [1], "max_new_tokens": 0}]}, r"max_new_tokens = 0"),
    ({"requests": [{"prompt_ids": [1]}]}, r"max_new_tokens = None"),
    ({"total_new_tokens": 9, "requests": [{"prompt_ids": [1], "max_new_tokens": 2}]}, "inconsistent"),
])
def test_bad_workload_is_rejected_with_a_clear_error(data, match):
    with pytest.raises(WorkloadError, match=match) as e:
        parse_workload(data, "bad.json", vocab_size=1000)
    assert str(e.value).startswith("bad.json: ")


def test_unreadable_files(tmp_path):
    with pytest.raises(WorkloadError, match="cannot read"):
        load_workload(tmp_path / "missing.json", WordTokenizer())
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(WorkloadError, match="not valid JSON"):
        load_workload(tmp_path / "x.json", WordTokenizer())


def test_ratio_line_format():
    ours = RunResult("pagedserve", 2.0, 10, 100)
    peer = RunResult("transformers_static", 4.0, 10, 60)
    assert ratio_line(ours, peer) == "ratio pagedserve/transformers_static: 3.33x"


def test_reference_workload_and_its_source_texts_are_in_the_checkout():
    """The benchmarks' default workload and the texts it was cut from travel with the repository."""
    assert W64.is_relative_to(ROOT) and LICENSE_DIR.is_relative_to(ROOT)
    data = json.loads(W64.read_text())
    requests = parse_workload(data, str(W64))  # validated, header totals included
    w = Workload("w64", "", requests)
    assert (len(w.requests), w.total_prompt_tokens, w.total_new_tokens) == (64, 17296, 9351)
    text, label = source_text()
    assert hashlib.sha256(text.encode()).hexdigest() == data["source_text_sha256"]
    assert "+".join(LICENSE_TEXTS) in label


def test_workload_argument_defaults_to_the_reference_file(capsys):
    ap = argparse.ArgumentParser()
    add_workload_args(ap)
    assert Path(ap.parse_args([]).workload) == W64
    w = load_workload(ap.parse_args(["--workload", GENERATED]).workload, WordTokenizer())
    assert w.name.startswith("generated") and "generated" in capsys.readouterr().out


@pytest.mark.slow
def test_generator_reproduces_the_reference_workload():
    """Same recipe as tests/data/workloads/w64.json: with the SmolLM2 tokenizer it matches token for token."""
    from transformers import AutoTokenizer

    from pagedserve.core.models.default_model import resolve_model_path

    tok = AutoTokenizer.from_pretrained(resolve_model_path("default"), local_files_only=True)
    reference = load_workload(W64, tok, verbose=False)
    assert generate_workload(tok).requests == reference.requests
