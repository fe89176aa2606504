"""Model-specific fast paths, behind one registry keyed by a tokenizer's pre-tokenizer.

The general path (tokenization.hf, tokenization.safe_cuts, tokenization.word_encoder) is exact for
any tokenizer.json; two of its speed-ups need a fact proven for one pre-tokenizer at a time:

- prefix reuse's letter|non-letter cut (`FastPath.letter_cuts`, tokenization.safe_cuts): the
  pre-tokenizer's regex pieces always end between an ASCII letter and an ASCII non-letter;
- word-by-word encoding of ASCII text (`FastPath.ascii_words`, tokenization.word_encoder): one `re`
  pattern whose `findall` gives the pre-tokenizer's words on ASCII text.

`fast_path` finds the entry whose `matches` accepts a tokenizer.json's ``pre_tokenizer``; a tokenizer
no entry matches gets neither speed-up and the same ids. Adding a model needs nothing here; to give
one these speed-ups, add a `FastPath` to `FAST_PATHS` with its proof (a test against the library's
own pre-tokenizer, as tests/tokenization/test_word_encoder.py and test_prefix_reuse.py do). The
encoder checks each speed-up against the plain encode when it is built, whatever the entry claims.
Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Final, NamedTuple

import msgspec

__all__ = ["DEEPSEEK_WORDS", "FAST_PATHS", "FastPath", "deepseek_splits", "fast_path", "pretokenizer_cuts"]

# DeepSeek-V3/V4's pre-tokenizer (the letter cut and `DEEPSEEK_WORDS` are proven for it):
# digits in runs of 1-3, CJK runs, then the word/punctuation/whitespace regex, then ByteLevel bytes.
_DEEPSEEK_SPLITS: Final = (
    "\\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
    " ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
)


class _Split(msgspec.Struct):
    type: str
    pattern: dict[str, str] = {}
    behavior: str = ""
    invert: bool = False
    add_prefix_space: bool = False
    use_regex: bool = True


class _PreTokenizer(msgspec.Struct):
    type: str
    pretokenizers: list[_Split] = []
    add_prefix_space: bool = False
    use_regex: bool = True


def _is_byte_level_tail(step: _Split) -> bool:
    return step.type == "ByteLevel" and not step.add_prefix_space and not step.use_regex


def _decoded(pre_tokenizer: msgspec.Raw) -> _PreTokenizer | None:
    try:
        return msgspec.json.decode(pre_tokenizer, type=_PreTokenizer)
    except msgspec.DecodeError:
        return None


def deepseek_splits(pre_tokenizer: msgspec.Raw) -> bool:
    """Whether this tokenizer.json ``pre_tokenizer`` is DeepSeek's Split sequence (`_DEEPSEEK_SPLITS`,
    isolated, then ByteLevel without regex or prefix space), the one `DEEPSEEK_WORDS` reproduces."""
    spec = _decoded(pre_tokenizer)
    if spec is None or spec.type != "Sequence" or not spec.pretokenizers:
        return False
    *splits, last = spec.pretokenizers
    patterns = tuple(s.pattern.get("Regex") for s in splits)
    isolated = all(s.type == "Split" and s.behavior == "Isolated" and not s.invert for s in splits)
    return isolated and patterns == _DEEPSEEK_SPLITS and _is_byte_level_tail(last)


def gpt2_byte_level(pre_tokenizer: msgspec.Raw) -> bool:
    """Whether this ``pre_tokenizer`` is GPT-2's ByteLevel regex (``use_regex``), no prefix space."""
    spec = _decoded(pre_tokenizer)
    return spec is not None and spec.type == "ByteLevel" and spec.use_regex and not spec.add_prefix_space


_SPACE: Final = r"\t\n\x0b\x0c\r "
"""Oniguruma's ``\\s`` in ASCII (Unicode White_Space: not \\x1c-\\x1f, which Python's ``\\s`` has)."""
_PUNCT: Final = r"!-/:-@\[-`{-~"
"""``[\\p{P}\\p{S}]`` in ASCII: every printable non-alphanumeric character (also the first class)."""
_LETTER: Final = "A-Za-z"
"""``\\p{L}`` (and ``[\\p{L}\\p{M}]``: no ASCII mark) in ASCII."""
_OTHER: Final = r"\x00-\x09\x0b\x0c\x0e-\x1f \x7f"
"""``[^\\r\\n\\p{L}\\p{P}\\p{S}]`` in ASCII without the digits, which the first split took apart."""
_CONTROL: Final = r"\x00-\x08\x0e-\x1f\x7f"
"""The characters where no alternative of the third split starts a match unless a letter follows."""

DEEPSEEK_WORDS: Final = re.compile(
    "|".join(
        (
            "[0-9]{1,3}",  # \p{N}{1,3}, isolated first: digits are pieces of their own
            f"[{_PUNCT}][{_LETTER}]+",
            f"[{_OTHER}]?[{_LETTER}]+",
            f" ?[{_PUNCT}]+[\r\n]*",
            f"[{_SPACE}]*[\r\n]+",
            f"[{_SPACE}]+(?![^{_SPACE}0-9])",  # \s+(?!\S): a digit ends the piece, as its end would
            f"[{_SPACE}]+",
            f"(?:[{_CONTROL}](?![{_LETTER}]))+",  # what no alternative matches: a gap, a piece itself
        )
    )
)
"""DeepSeek-V3's pre-tokenizer on ASCII text: `findall` gives its words, which join to the text:
digits in runs of 1-3 first, and the third split's alternatives with its Unicode classes written out
for ASCII and its end-of-piece lookahead made to see a digit as the end of the piece it is in (the
first split cut there)."""


class FastPath(NamedTuple):
    """The speed-ups proven for the tokenizers whose ``pre_tokenizer`` `matches` (see the module)."""

    name: str
    matches: Callable[[msgspec.Raw], bool]
    letter_cuts: bool
    """Prefix reuse may cut between an ASCII letter and an ASCII non-letter (tokenization.safe_cuts)."""
    ascii_words: re.Pattern[str] | None
    """The pre-tokenizer's words on ASCII text (tokenization.word_encoder); None: not reproduced."""


FAST_PATHS: Final[list[FastPath]] = [
    FastPath("deepseek-v3", deepseek_splits, letter_cuts=True, ascii_words=DEEPSEEK_WORDS),
    FastPath("gpt2-byte-level", gpt2_byte_level, letter_cuts=True, ascii_words=None),
]
"""Every pre-tokenizer with a proven speed-up, the first match winning."""


def fast_path(pre_tokenizer: msgspec.Raw) -> FastPath | None:
    """The registered fast path of a tokenizer.json ``pre_tokenizer``, None when none matches."""
    return next((path for path in FAST_PATHS if path.matches(pre_tokenizer)), None)


def pretokenizer_cuts(pre_tokenizer: msgspec.Raw) -> bool:
    """Whether the letter|non-letter cut is proven for this ``pre_tokenizer`` (`FastPath.letter_cuts`)."""
    path = fast_path(pre_tokenizer)
    return path is not None and path.letter_cuts
