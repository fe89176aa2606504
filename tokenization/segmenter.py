"""Where HF tokenizers cut text at added tokens, reproduced exactly: the split the segment cache runs on.

HF tokenizers cut the input at added tokens before normalization, pre-tokenization and BPE run:
leftmost-longest over the non-normalized tokens first, then (only under an identity normalizer) over
the normalized ones inside each piece. Candidates are found with ``str.find`` on each token's first
character and confirmed with one anchored trie regex, so the cost follows the number of candidate
positions, not the text length. docs/tokenization.md gives the argument. Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import TypeAlias

import msgspec

__all__ = ["AddedToken", "Segment", "Segmenter"]

Segment = str | int
"""A text piece to encode, or the id of an added token matched in place."""


class AddedToken(msgspec.Struct, frozen=True):
    """One entry of tokenizer.json's ``added_tokens`` (the HF file format; unknown fields ignored)."""

    id: int
    content: str
    single_word: bool = False
    lstrip: bool = False
    rstrip: bool = False
    normalized: bool = True
    special: bool = False

    @property
    def plain(self) -> bool:
        """Matches its exact text only, so splitting around it cannot move a neighbouring character."""
        return not (self.single_word or self.lstrip or self.rstrip)


_Trie: TypeAlias = dict[str, "_Trie"]
"""A character trie; the key "" marks the end of a word."""


def _trie_pattern(words: Iterable[str]) -> str:
    """A regex matching the longest of ``words`` at a position: a character trie, deeper branches first."""
    trie: _Trie = {}
    for word in words:
        node = trie
        for ch in word:
            node = node.setdefault(ch, {})
        node[""] = {}
    return _node_pattern(trie)


def _node_pattern(node: _Trie) -> str:
    branches = [re.escape(ch) + _node_pattern(child) for ch, child in node.items() if ch]
    if not branches:
        return ""
    body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
    # A word may end here: try the longer continuations first, then accept the shorter match.
    return f"(?:{body})?" if "" in node else body


class _Finder:
    """Leftmost-longest matches of a word set: `str.find` for the words' first characters, then a trie
    regex anchored there. A scan by `re` tests every position (~1 ns/char) where `str.find` runs at
    memchr speed, and rendered chats are long with few added tokens."""

    def __init__(self, words: Sequence[str]) -> None:
        by_first: dict[str, list[str]] = {}
        for word in words:
            by_first.setdefault(word[0], []).append(word)
        self._patterns = {ch: re.compile(_trie_pattern(ws)) for ch, ws in by_first.items()}

    def occurs(self, text: str, pos: int, end: int) -> bool:
        """Whether a first character of some word occurs in ``text[pos:end]`` (else nothing matches)."""
        for ch in self._patterns:
            if text.find(ch, pos, end) >= 0:
                return True
        return False

    def spans(self, text: str, pos: int, end: int) -> list[tuple[int, int]]:
        """The (start, end) of every match inside ``text[pos:end]``, left to right, none overlapping."""
        if len(self._patterns) == 1:
            return self._spans_one(text, pos, end)
        patterns = self._patterns
        # Every index of each first character, found inline: a generator and a helper per character
        # were 3 calls each on every split of a chat's new tail.
        starts: list[int] = []
        find, append = text.find, starts.append
        for ch in patterns:
            i = find(ch, pos, end)
            while i >= 0:
                append(i)
                i = find(ch, i + 1, end)
        starts.sort()
        out: list[tuple[int, int]] = []
        for i in starts:
            if i < pos:  # inside the previous match
                continue
            match = patterns[text[i]].match(text, i, end)
            if match is not None:
                pos = match.end()
                out.append((i, pos))
        return out

    def _spans_one(self, text: str, pos: int, end: int) -> list[tuple[int, int]]:
        """`spans` when every word starts with one character (the common case: ``<``)."""
        ((ch, pattern),) = self._patterns.items()
        out: list[tuple[int, int]] = []
        find, match = text.find, pattern.match
        i = find(ch, pos, end)
        while i >= 0:
            m = match(text, i, end)
            if m is None:
                i = find(ch, i + 1, end)
            else:
                j = m.end()
                out.append((i, j))
                i = find(ch, j, end)
        return out


def _compile(tokens: Sequence[AddedToken]) -> _Finder | None:
    words = [t.content for t in tokens if t.content]
    return _Finder(words) if words else None


class Segmenter:
    """Cuts text into pieces and added-token ids exactly where HF tokenizers' added vocabulary cuts it."""

    def __init__(self, tokens: Sequence[AddedToken], identity_normalizer: bool) -> None:
        # Any non-plain token makes boundaries depend on neighbours: then we do not split at all.
        self.enabled = all(t.plain for t in tokens)
        raw = [t for t in tokens if not t.normalized]
        normalized = [t for t in tokens if t.normalized] if identity_normalizer else []
        self._ids = {t.content: t.id for t in normalized} | {t.content: t.id for t in raw}
        self._raw = _compile(raw) if self.enabled else None
        self._normalized = _compile(normalized) if self.enabled else None
        self._firsts = tuple(sorted({t.content[0] for t in [*raw, *normalized] if t.content}))

    def holds_none(self, text: str) -> bool:
        """Whether no added token can occur in ``text`` (no token's first character does), so that it is
        one piece; False when the segmenter is off."""
        if not self.enabled:
            return False
        for ch in self._firsts:
            if ch in text:
                return False
        return True

    def split(self, text: str) -> list[Segment]:
        """The pieces of ``text`` in order; concatenating their encodings gives the whole text's encoding."""
        out: list[Segment] = []
        start = 0
        for a, b in self._raw.spans(text, 0, len(text)) if self._raw is not None else ():
            if a > start:
                self._split_piece(out, text, start, a)
            out.append(self._ids[text[a:b]])
            start = b
        if start < len(text):
            self._split_piece(out, text, start, len(text))
        return out

    def _split_piece(self, out: list[Segment], text: str, pos: int, end: int) -> None:
        """Split ``text[pos:end]``, a piece between raw matches, on the normalized tokens."""
        finder = self._normalized
        if finder is None or not finder.occurs(text, pos, end):
            out.append(text[pos:end])
            return
        start = pos
        for a, b in finder.spans(text, pos, end):
            if a > start:
                out.append(text[start:a])
            out.append(self._ids[text[a:b]])
            start = b
        if start < end:
            out.append(text[start:end])
