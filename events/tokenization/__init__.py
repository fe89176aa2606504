"""Tokenization shared by the router and the engine stub: one contract, two implementations.

``HfTokenizer`` (a real tokenizer.json + Jinja chat template from local files) and ``BuiltinTokenizer``
(byte-level, zero dependencies on model files). See docs/tokenization.md.
"""

from __future__ import annotations

from events.tokenization.base import Message, SpecialTokens, TokenizationError, Tokenizer
from events.tokenization.builtin import BuiltinTokenizer
from events.tokenization.chat_template import ChatOptions, ChatTemplate, ContentFormat, TemplateSet
from events.tokenization.hf import HfTokenizer
from events.tokenization.segment_cache import AddedToken, SegmentCache, SegmentedEncoder, Segmenter

__all__ = [
    "AddedToken",
    "BuiltinTokenizer",
    "ChatOptions",
    "ChatTemplate",
    "ContentFormat",
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
