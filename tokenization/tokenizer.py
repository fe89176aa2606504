"""The tokenizer contract shared by the router and the engine stub: encoding and rendering.

Both sides must turn a request into the same token ids (the router predicts the engine's cache hits from
them), so every implementation follows vLLM 0.33.0: completions encode the prompt with
``add_special_tokens=True``, chat renders the template and encodes the text with
``add_special_tokens=False`` (the template already emits BOS). What makes encoding cheap on repeated
text is not part of the contract: tokenization.cached_encoder wraps a tokenizer. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from tokenization.base import Message, SpecialTokens
from tokenization.chat_template import TemplateSet

__all__ = ["Tokenizer"]


class Tokenizer(Protocol):
    """What the router and the stub need from a tokenizer: text <-> ids and chat rendering."""

    @property
    def name(self) -> str:
        """A short description for logs and /debug (source path or ``builtin``)."""
        ...

    @property
    def special_tokens(self) -> SpecialTokens:
        """BOS/EOS/PAD/UNK strings and ids."""
        ...

    @property
    def templates(self) -> TemplateSet:
        """The chat templates (request preparation reads their content format and developer-role support)."""
        ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Plain encoding (HF ``Tokenizer.encode``): the reference every cached encoding must equal."""
        ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Ids back to text."""
        ...

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation as HF transformers' ``apply_chat_template(tokenize=False)`` does."""
        ...
