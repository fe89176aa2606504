"""Deterministic pseudo-text output: the stub's sampler and the text each output token adds.

Output token i of every request is the i-th token (cyclically) of a fixed English passage encoded with
the served tokenizer, so the ids are valid for that tokenizer and decode to readable text. Per-token
text deltas are precomputed once over one cycle, so streaming never re-decodes a growing output.
"""

from __future__ import annotations

from typing import Final

from engine_stub.core.request import Request
from tokenization import Tokenizer

__all__ = ["PASSAGE", "PseudoText"]

PASSAGE: Final = (
    "The quick brown fox jumps over the lazy dog while the engine stub pretends to think about "
    "caches, prefixes and blocks, and every word it writes is chosen in advance so that tests can "
    "predict it exactly. "
)


class PseudoText:
    """The sampler (`next_token`) and detokenizer (`text`) of the stub's deterministic output."""

    def __init__(self, tokenizer: Tokenizer, passage: str = PASSAGE) -> None:
        self.ids = tokenizer.encode(passage, add_special_tokens=False)
        if not self.ids:
            raise ValueError("the pseudo-text passage encodes to no tokens")
        prefixes = [tokenizer.decode(self.ids[:i]) for i in range(len(self.ids) + 1)]
        self._deltas = [_delta(prefixes[i], prefixes[i + 1]) for i in range(len(self.ids))]

    def next_token(self, req: Request) -> int:
        """The output token after `req`'s current output (a `Sampler` for the scheduler)."""
        return self.token_at(req.num_output_tokens)

    def token_at(self, index: int) -> int:
        """Output token number `index` (0-based)."""
        return self.ids[index % len(self.ids)]

    def delta_at(self, index: int) -> str:
        """The text output token number `index` appends."""
        return self._deltas[index % len(self._deltas)]

    def text(self, count: int) -> str:
        """The text of the first `count` output tokens."""
        return "".join(self.delta_at(i) for i in range(count))


def _delta(before: str, after: str) -> str:
    # A token that completes a multi-byte character may rewrite the replacement char decoded before it.
    common = len(before)
    while common and not after.startswith(before[:common]):
        common -= 1
    return after[common:]
