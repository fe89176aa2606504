"""The segment split's find-based scan equals a plain leftmost-longest regex scan, on random vocabularies."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenization import AddedToken, Segmenter
from tokenization.segmenter import Segment, _Finder


def _reference_scan(words: list[str], ids: dict[str, int], text: str) -> list[Segment]:
    """Leftmost match at each position, longest word there; then continue after it (the HF rule)."""
    if not words:
        return [text] if text else []
    # Longest alternatives first: Python's re takes the first alternative that matches.
    pattern = re.compile("|".join(re.escape(w) for w in sorted(words, key=len, reverse=True)))
    out: list[Segment] = []
    start = 0
    for m in pattern.finditer(text):
        if m.start() > start:
            out.append(text[start : m.start()])
        out.append(ids[m.group()])
        start = m.end()
    if start < len(text):
        out.append(text[start:])
    return out


def _reference_split(tokens: list[AddedToken], text: str) -> list[Segment]:
    raw = [t.content for t in tokens if not t.normalized]
    norm = [t.content for t in tokens if t.normalized]
    ids = {t.content: t.id for t in tokens if t.normalized} | {
        t.content: t.id for t in tokens if not t.normalized
    }
    out: list[Segment] = []
    for seg in _reference_scan(raw, ids, text):
        out.extend(_reference_scan(norm, ids, seg) if isinstance(seg, str) else [seg])
    return out


BAR = "\uff5c"  # the fullwidth vertical line of DeepSeek's role markers
ALPHABET = "<>|ab " + BAR
WORDS = st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), min_size=1, max_size=8, unique=True)


@settings(max_examples=300, deadline=None)
@given(
    words=WORDS, flags=st.lists(st.booleans(), min_size=8, max_size=8), text=st.text(ALPHABET, max_size=60)
)
def test_split_equals_the_reference_scan(words: list[str], flags: list[bool], text: str) -> None:
    tokens = [AddedToken(i + 1, w, normalized=flags[i]) for i, w in enumerate(words)]
    assert Segmenter(tokens, identity_normalizer=True).split(text) == _reference_split(tokens, text)


def test_many_first_characters_and_a_rare_one() -> None:
    tokens = [AddedToken(1, "<a>", normalized=False), AddedToken(2, "|b", normalized=False)]
    tokens.append(AddedToken(3, BAR, normalized=False))
    text = "x<a" * 200 + "<a>|b" + BAR + "y" * 50
    assert Segmenter(tokens, identity_normalizer=True).split(text) == ["x<a" * 200, 1, 2, 3, "y" * 50]


def _old_spans(finder: _Finder, text: str, pos: int, end: int) -> list[tuple[int, int]]:
    """The multi-character scan as it was: positions by a generator over a helper, then sorted."""
    patterns = finder._patterns
    starts = sorted(i for ch in patterns for i in range(pos, end) if text[i] == ch)
    out: list[tuple[int, int]] = []
    for i in starts:
        if i < pos:
            continue
        match = patterns[text[i]].match(text, i, end)
        if match is not None:
            pos = match.end()
            out.append((i, pos))
    return out


@settings(max_examples=300, deadline=None)
@given(
    words=WORDS, text=st.text(ALPHABET, max_size=60), bounds=st.tuples(st.integers(0, 60), st.integers(0, 60))
)
def test_spans_find_every_start_inline_as_the_sorted_positions_did(
    words: list[str], text: str, bounds: tuple[int, int]
) -> None:
    pos, end = min(bounds[0], len(text)), min(bounds[1], len(text))
    finder = _Finder(words)
    assert finder.spans(text, pos, end) == _old_spans(finder, text, pos, end)
