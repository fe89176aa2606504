"""Prompts as text that the served tokenizer encodes to the same token ids (`--prompt-format text`).

Some routers accept only text prompts (sglang-router rejects token ids), so to compare them on the
same requests each id prompt is rewritten as text: every token id maps to one of a fixed set of
single-token pieces (the stub's pseudo-text output, `engine_stub.runtime.pseudo_text`, split into tokens
that encode alone to one id), so equal id prefixes give equal text prefixes, block for block. The
text is then encoded as the engine will (`/v1/completions` adds special tokens), and that encoding
becomes the request's ids, so oracles, fit checks and the offered load see what engines see. The
prompt loses as many trailing tokens as the tokenizer adds specials, keeping every length. With
the built-in byte tokenizer the result is exact; a BPE tokenizer may merge pieces, which `mismatched`
counts (lengths changed).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from engine_stub.runtime.pseudo_text import PseudoText
from kvrouter.loadtest.workload import RequestSpec
from tokenization import Tokenizer

__all__ = ["TextPrompts", "ids_text"]


def ids_text(pieces: Sequence[str], ids: Sequence[int]) -> str:
    """The text standing for `ids`: one of `pieces` per id, so equal ids give equal text."""
    return "".join(pieces[i % len(pieces)] for i in ids)


class TextPrompts:
    """Rewrites id prompts as text for `tokenizer`; `mismatched` counts prompts whose length changed."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        deltas = {PseudoText(tokenizer).delta_at(i) for i in range(len(PseudoText(tokenizer).ids))}
        self.pieces = sorted(
            d
            for d in deltas
            if d and "<" not in d and len(tokenizer.encode(d, add_special_tokens=False)) == 1
        )
        if len(self.pieces) < 2:
            raise ValueError("the tokenizer gives fewer than 2 single-token text pieces")
        self.specials = len(tokenizer.encode("", add_special_tokens=True))
        self.mismatched = 0

    def text(self, ids: Sequence[int]) -> str:
        """The text standing for `ids` (one piece per id, the last `specials` ids dropped)."""
        return ids_text(self.pieces, ids[: max(0, len(ids) - self.specials)])

    def rewrite(self, requests: Sequence[RequestSpec]) -> list[RequestSpec]:
        """Every request with its text, and its ids as the engine will encode that text."""
        out = []
        for r in requests:
            text = self.text(r.prompt)
            ids = self.tokenizer.encode(text, add_special_tokens=True)
            self.mismatched += len(ids) != len(r.prompt)
            out.append(msgspec.structs.replace(r, prompt=ids, text=text))
        return out
