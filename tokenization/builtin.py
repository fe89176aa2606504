"""The built-in tokenizer: byte-level ids, eight special tokens and a small chat template.

The zero-dependency default (``make run`` with no model files). Deterministic across processes and hash
seeds: an id is a fixed special-token number or ``BYTE_BASE + byte``, nothing depends on ``hash()``.
It follows the same contract as a real model: ``encode`` adds BOS when asked, the chat template emits
BOS itself, so chat prompts are encoded without adding it again.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Final

from tokenization.base import SpecialTokens
from tokenization.cached_encoder import CachedEncoder
from tokenization.chat_template import ChatTemplate, TemplateSet
from tokenization.prefix_reuse import PrefixReuse
from tokenization.safe_cuts import CutFinder
from tokenization.segment_cache import AddedToken, SegmentCache, SegmentedEncoder, Segmenter
from tokenization.templated import TemplatedTokenizer

__all__ = ["BUILTIN_CHAT_TEMPLATE", "BYTE_BASE", "SPECIAL_TOKENS", "BuiltinTokenizer"]

SPECIAL_TOKENS: Final = (
    "<|pad|>",
    "<|bos|>",
    "<|eos|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
    "<|end|>",
)
BYTE_BASE: Final = len(SPECIAL_TOKENS)
VOCAB_SIZE: Final = BYTE_BASE + 256
BOS_ID: Final = SPECIAL_TOKENS.index("<|bos|>")

BUILTIN_CHAT_TEMPLATE: Final = """{{- bos_token -}}
{% if tools %}<|system|>Tools: {{ tools | tojson }}<|end|>
{% endif %}
{% for message in messages %}
{% set role = 'system' if message['role'] == 'developer' else message['role'] %}
{% if role not in ['system', 'user', 'assistant', 'tool'] %}
{{ raise_exception('unsupported role: ' + role) }}
{% endif %}
<|{{ role }}|>{{ message['content'] or '' }}
{%- for call in message.get('tool_calls') or [] %}
<|tool|>{{ call['function']['name'] }}({{ call['function']['arguments'] | tojson }})
{%- endfor %}<|end|>
{% endfor %}
{% if add_generation_prompt %}<|assistant|>{% endif %}"""

_SPECIAL_RE: Final = re.compile("|".join(re.escape(s) for s in SPECIAL_TOKENS))
_IDS: Final = {s: i for i, s in enumerate(SPECIAL_TOKENS)}


def _bytes_to_ids(text: str) -> list[int]:
    return [BYTE_BASE + b for b in text.encode("utf-8")]


class BuiltinTokenizer(TemplatedTokenizer):
    """Byte-level tokenizer with special tokens; implements the Tokenizer protocol."""

    def __init__(self) -> None:
        self._special = SpecialTokens(
            bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>", bos_token_id=BOS_ID, eos_token_id=2
        )
        self._context = self._special.template_context()
        self.templates = TemplateSet(default=ChatTemplate(BUILTIN_CHAT_TEMPLATE))

    def cached_encoder(self, cache: SegmentCache | None = None) -> CachedEncoder:
        """A new cached encoder over this tokenizer: the segment cache ``cache`` (None: a new one, with
        the default bounds), and prefix reuse cutting before any character no special token spans
        (so the chat carry too). Exact: a special token is matched where it occurs and every other
        byte is its own id, so ``encode(a + b) == encode(a) + encode(b)`` when no special token's
        occurrence spans the cut (`CutFinder`'s ``bytes_alone``), and each id's byte length is known.
        (Cutting after special tokens only, a load test's text prompts, which hold none, were encoded
        whole on every request: ~1.5 ms of preparation and decision for a 15k-token agent step.)"""
        tokens = [AddedToken(id=i, content=s, normalized=False) for i, s in enumerate(SPECIAL_TOKENS)]
        segmenter = Segmenter(tokens, identity_normalizer=True)
        lengths = [len(s.encode("utf-8")) for s in SPECIAL_TOKENS] + [1] * 256
        reuse = PrefixReuse(CutFinder(tokens, pretokenizer_rule=False, bytes_alone=True), lengths)
        segments = SegmentedEncoder(
            segmenter, self._encode_pieces, SegmentCache() if cache is None else cache, reuse
        )
        return CachedEncoder(self, segments, ([BOS_ID], []))

    @property
    def name(self) -> str:
        return "builtin"

    def _encode_pieces(self, pieces: list[str]) -> list[list[int]]:
        return [self.encode(p, add_special_tokens=False) for p in pieces]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        out = [BOS_ID] if add_special_tokens else []
        start = 0
        for match in _SPECIAL_RE.finditer(text):
            out += _bytes_to_ids(text[start : match.start()])
            out.append(_IDS[match.group()])
            start = match.end()
        return out + _bytes_to_ids(text[start:])

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        parts: list[str] = []
        run = bytearray()
        for i in ids:
            if BYTE_BASE <= i < VOCAB_SIZE:
                run.append(i - BYTE_BASE)
                continue
            parts.append(run.decode("utf-8", errors="replace"))
            run.clear()
            if not 0 <= i < BYTE_BASE:
                raise ValueError(f"token id {i} is outside the builtin vocabulary (0..{VOCAB_SIZE - 1})")
            parts.append("" if skip_special_tokens else SPECIAL_TOKENS[i])
        parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)
