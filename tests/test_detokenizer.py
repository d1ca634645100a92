"""IncrementalDetokenizer: deltas concatenate to the full decode; stop strings never leak."""

from __future__ import annotations

import functools
import itertools
import json
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.core.detokenizer import IncrementalDetokenizer
from pagedserve.core.errors import InvalidRequest

FFFD = "\ufffd"
# DETOK_EXAMPLES raises the example count for a longer local bug hunt.
PROPERTY = settings(max_examples=int(os.environ.get("DETOK_EXAMPLES", "200")), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


@functools.cache
def smollm2():
    from transformers import AutoTokenizer

    from pagedserve.core.models.default_model import resolve_model_path
    return AutoTokenizer.from_pretrained(resolve_model_path("default"))


@functools.cache
def sp_tokenizer(decoder: str):
    """A tiny SentencePiece-style tokenizer built offline: BPE over Metaspace pieces with byte
    fallback (all 256 <0xNN> pieces), and either the Metaspace decoder (drops the leading space of
    the first piece) or Llama 2's Replace/ByteFallback/Fuse/Strip chain."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = ["Hello world, this is a small corpus for a sentencepiece style tokenizer.",
              "The quick brown fox jumps over the lazy dog. Numbers 12345 and punctuation!?"] * 5
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(corpus, trainer)
    spec = json.loads(tok.to_str())
    for b in range(256):  # byte pieces are ordinary vocab entries, not special tokens
        spec["model"]["vocab"].setdefault(f"<0x{b:02X}>", len(spec["model"]["vocab"]))
    spec["model"]["byte_fallback"] = True
    if decoder == "metaspace":
        dec = decoders.Sequence([decoders.ByteFallback(),
                                 decoders.Metaspace(replacement="▁", prepend_scheme="first")])
    else:
        dec = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                 decoders.Strip(" ", 1, 0)])
    spec["decoder"] = json.loads(dec.__getstate__())
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                   unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def tokenizer(name: str):
    return smollm2() if name == "smollm2" else sp_tokenizer(name)


TOKENIZERS = ["smollm2", "metaspace", "strip"]


def longest_stop_prefix_suffix(text: str, stops) -> int:
    return max((k for s in stops for k in range(1, min(len(s) - 1, len(text)) + 1)
                if text.endswith(s[:k])), default=0)


def stream(tok, ids, chunks=None, *, prompt=(), **kwargs):
    """Feed `ids` in `chunks` like the engine does; check the hold-back after every delta.
    Returns (deltas, detokenizer, stop returned by update or None)."""
    detok = IncrementalDetokenizer(tok, list(prompt), **kwargs)
    stops = kwargs.get("stop", ())
    deltas, pos, stop = [], 0, None
    for n in itertools.cycle(chunks or [1]):  # chunk sizes repeat until every id is fed
        if pos >= len(ids):
            break
        stop = detok.update(ids[pos:pos + n])
        pos += n
        if stop is not None:
            break
        deltas.append(detok.get_delta(False))
        released = "".join(deltas)
        held = detok.output_text[len(released):]
        assert detok.output_text.startswith(released)
        # exactly the longest suffix that could still start a stop string is held back
        assert len(held) == longest_stop_prefix_suffix(detok.output_text, stops)
        for s in stops:
            assert s not in released
    deltas.append(detok.get_delta(True))
    assert detok.get_delta(True) == ""
    return deltas, detok, stop


def check_full_decode(tok, ids, chunks, skip):
    deltas, detok, _ = stream(tok, ids, chunks, prompt=[5, 6], skip_special_tokens=skip)
    full = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == full
    assert detok.output_text == full
    if FFFD not in full:
        assert all(FFFD not in d for d in deltas[:-1])


TEXT = st.text(st.one_of(
    st.characters(codec="utf-8", exclude_categories=("Cs",)),
    st.sampled_from("abc 中文字😀🎉é\n"),
    st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF),  # CJK
    st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF),  # emoji
), max_size=24)
CHUNKS = st.lists(st.integers(1, 4), min_size=1, max_size=60)


def ids_strategy(tok):
    vocab = len(tok)
    special = sorted(tok.added_tokens_decoder)
    random_ids = st.lists(st.one_of(st.integers(0, vocab - 1), st.sampled_from(special)), max_size=40)
    text_ids = st.tuples(TEXT, st.lists(st.sampled_from(special), max_size=2)).map(
        lambda ts: tok.encode(ts[0], add_special_tokens=False) + ts[1])
    return st.one_of(random_ids, text_ids)


@pytest.mark.parametrize("name", TOKENIZERS)
def test_deltas_concatenate_to_full_decode(name):
    tok = tokenizer(name)

    @PROPERTY
    @given(ids=ids_strategy(tok), chunks=CHUNKS, skip=st.booleans())
    def prop(ids, chunks, skip):
        check_full_decode(tok, ids, chunks, skip)

    prop()


@pytest.mark.parametrize("name", TOKENIZERS)
def test_multibyte_text_one_token_at_a_time(name):
    tok = tokenizer(name)
    text = "Hello 中文 😀 world 🎉é"
    ids = tok.encode(text, add_special_tokens=False)
    deltas, _, _ = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert all(FFFD not in d for d in deltas)


def test_sentencepiece_leading_space_of_first_token():
    tok = sp_tokenizer("metaspace")
    ids = tok.encode("Hello world", add_special_tokens=False)
    assert tok.convert_ids_to_tokens(ids)[0].startswith("▁")
    assert tok.decode(ids[1:]) == "world"  # decoded alone, the second word loses its space
    deltas, _, _ = stream(tok, ids)
    assert "".join(deltas) == "Hello world"


def test_byte_fallback_run_is_held_until_it_cannot_change():
    # <E4><B8><AD> is complete, but a following invalid byte piece would turn the whole run into
    # U+FFFD; emitting 中 early would then contradict the full decode.
    tok = sp_tokenizer("metaspace")
    b = lambda x: tok.convert_tokens_to_ids(f"<0x{x:02X}>")  # noqa: E731
    ids = [b(0xE4), b(0xB8), b(0xAD), b(0xFF)]
    deltas, _, _ = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == FFFD * 4
    assert deltas == ["", "", "", "", FFFD * 4]
    ids = [b(0xE4), b(0xB8), b(0xAD), tok.convert_tokens_to_ids("▁Hello")]
    deltas, _, _ = stream(tok, ids)
    assert deltas == ["", "", "", "中 Hello", ""]


def test_invalid_bytes_that_never_complete_are_emitted_at_finish():
    tok = smollm2()
    emoji_ids = tok.encode("😀", add_special_tokens=False)
    assert len(emoji_ids) > 1
    ids = tok.encode("ok", add_special_tokens=False) + emoji_ids[:1]
    deltas, _, _ = stream(tok, ids)
    assert deltas[-1].endswith(FFFD) and "".join(deltas) == tok.decode(ids)
    assert all(FFFD not in d for d in deltas[:-1])


@pytest.mark.parametrize("name", TOKENIZERS)
@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_in_stream(name, skip):
    tok = tokenizer(name)
    eos, bos = tok.eos_token_id, tok.bos_token_id
    enc = functools.partial(tok.encode, add_special_tokens=False)
    ids = [bos] + enc("Hi 中") + [eos, eos] + enc(" there") + [eos]
    deltas, _, _ = stream(tok, ids, skip_special_tokens=skip)
    full = tok.decode(ids, skip_special_tokens=skip)
    assert "".join(deltas) == full
    assert (tok.eos_token in full) is not skip


def test_window_stays_small():
    """Per update, decode() sees the new tokens plus a small window, never the whole output."""
    tok = smollm2()
    sizes = []

    class Counting:
        def __getattr__(self, name):
            return getattr(tok, name)

        def decode(self, ids, **kw):
            sizes.append(len(ids))
            return tok.decode(ids, **kw)

    ids = tok.encode("中文 text and emoji 😀🎉 " * 60, add_special_tokens=False)
    deltas, _, _ = stream(Counting(), ids, stop=["never-matches-this"])
    assert "".join(deltas) == tok.decode(ids)
    assert len(ids) > 500 and max(sizes) <= 8


# ---------------------------------------------------------------------------------- stop strings

def run_stop(text, stop, include=False, prompt_text="", tok=None):
    tok = tok or smollm2()
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode(prompt_text, add_special_tokens=False)
    deltas, detok, matched = stream(tok, ids, prompt=prompt, stop=stop, include_stop_str_in_output=include)
    assert "".join(deltas) == detok.output_text
    return deltas, detok, matched


def test_stop_spanning_tokens():
    tok = smollm2()
    stop = "world, stop"
    assert len(tok.encode(stop, add_special_tokens=False)) > 1
    deltas, detok, matched = run_stop("Hello world, stop here", [stop])
    assert matched == stop and detok.output_text == "Hello "
    assert detok.matched_stop == stop


def test_stop_in_the_middle_of_a_token_drops_the_rest_of_the_token():
    tok = smollm2()
    assert tok.encode(" Hello", add_special_tokens=False) == [tok.convert_tokens_to_ids("ĠHello")]
    _, detok, matched = run_stop("Say Hello there", ["ell"])
    assert matched == "ell" and detok.output_text == "Say H"
    _, detok, _ = run_stop("Say Hello there", ["ell"], include=True)
    assert detok.output_text == "Say Hell"


def test_stop_at_the_very_start():
    deltas, detok, matched = run_stop("Hello world", ["Hello"])
    assert matched == "Hello" and deltas == [""] and detok.output_text == ""


def test_several_candidates_earliest_wins():
    _, detok, matched = run_stop("Hello world and more", ["and", "world", "lo w"])
    assert matched == "lo w" and detok.output_text == "Hel"
    # one stop contains another: the one a token-by-token stream completes first wins
    _, detok, matched = run_stop("xx abcd yy", ["abcd", "bc"])
    assert matched == "bc" and detok.output_text == "xx a"


def test_include_stop_str_in_output():
    deltas, detok, matched = run_stop("Hello world, more text", ["world"], include=True)
    assert matched == "world" and detok.output_text == "Hello world"
    assert "world" not in "".join(deltas[:-1]) and deltas[-1].endswith("world")


def test_partial_prefix_that_does_not_match_is_released():
    deltas, detok, matched = run_stop("Hello there friend", ["Hello world", "the end"])
    assert matched is None and detok.output_text == "Hello there friend"
    assert deltas[0] == ""  # "Hello" could start "Hello world": held
    assert "Hello there" in "".join(deltas[:-1])  # released once " there" ruled it out


def test_partial_prefix_at_end_is_released_at_finish():
    deltas, detok, matched = run_stop("Hello wor", ["world"])
    assert matched is None and "".join(deltas[:-1]) == "Hello " and deltas[-1] == "wor"


def test_multibyte_stop_string():
    _, detok, matched = run_stop("a中b😀c", ["😀"])
    assert matched == "😀" and detok.output_text == "a中b"


def test_stop_never_matched_against_prompt():
    _, detok, matched = run_stop("lo there", ["Hello"], prompt_text="Hel")
    assert matched is None and detok.output_text == "lo there"
    _, detok, matched = run_stop(" there", ["Hello"], prompt_text="Hello")
    assert matched is None


def test_tokens_after_a_match_are_ignored_and_empty_stop_rejected():
    tok = smollm2()
    detok = IncrementalDetokenizer(tok, [], stop=["b"])
    assert detok.update(tok.encode("a b", add_special_tokens=False)) == "b"
    assert detok.update(tok.encode(" more", add_special_tokens=False)) is None
    assert detok.get_delta(False) == "a " and detok.get_delta(True) == ""
    with pytest.raises(InvalidRequest):
        IncrementalDetokenizer(tok, [], stop=[""])


STOP_ALPHABET = "ab c中😀\n"


@pytest.mark.parametrize("name", ["smollm2", "metaspace"])
def test_stop_strings_property(name):
    """Against a reference on the full decode: the output ends before the stop string that ends
    first (earliest end, then earliest start); no stop leaks; chunking does not matter."""
    tok = tokenizer(name)

    @PROPERTY
    @given(text=st.text(st.sampled_from(STOP_ALPHABET), max_size=30),
           stops=st.lists(st.text(st.sampled_from(STOP_ALPHABET), min_size=1, max_size=4), max_size=3),
           chunks=CHUNKS, include=st.booleans())
    def prop(text, stops, chunks, include):
        ids = tok.encode(text, add_special_tokens=False)
        full = tok.decode(ids)
        deltas, detok, matched = stream(tok, ids, chunks, stop=stops, include_stop_str_in_output=include)
        hits = [(full.find(s) + len(s), full.find(s), s) for s in stops if s in full]
        if hits:
            end, start, s = min(hits)
            assert detok.matched_stop == s and matched in (None, s)
            expected = full[:end] if include else full[:start]
        else:
            assert detok.matched_stop is None and matched is None
            expected = full
        assert "".join(deltas) == expected == detok.output_text
        for d in deltas if not include else deltas[:-1]:
            assert not any(s in d for s in stops)

    prop()
