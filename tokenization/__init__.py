"""Tokenization shared by the router and the engine stub: one contract, two implementations.

``HfTokenizer`` (a real tokenizer.json + Jinja chat template from local files) and ``BuiltinTokenizer``
(byte-level, zero dependencies on model files) implement ``Tokenizer``; ``CachedEncoder`` is the one
cache layer over either. See docs/tokenization.md.
"""

from __future__ import annotations

from tokenization.base import Message, SpecialTokens, TokenizationError
from tokenization.builtin import BuiltinTokenizer
from tokenization.cached_encoder import CachedEncoder, ChatPrompt, Encoded
from tokenization.chat_template import ChatOptions, ChatTemplate, ContentFormat, TemplateSet
from tokenization.hf import HfTokenizer
from tokenization.segment_cache import AddedToken, SegmentCache, SegmentedEncoder, Segmenter
from tokenization.tokenizer import Tokenizer

__all__ = [
    "AddedToken",
    "BuiltinTokenizer",
    "CachedEncoder",
    "ChatOptions",
    "ChatPrompt",
    "ChatTemplate",
    "ContentFormat",
    "Encoded",
    "HfTokenizer",
    "Message",
    "SegmentCache",
    "SegmentedEncoder",
    "Segmenter",
    "SpecialTokens",
    "TemplateSet",
    "TokenizationError",
    "Tokenizer",
]
