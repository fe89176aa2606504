"""What every Tokenizer implementation shares: its special tokens and its chat templates' rendering.

Subclasses set `_special`, `_context` (the template's special-token variables) and `templates`, and
implement `encode`, `decode` and `name`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenization.base import Message, SpecialTokens
from tokenization.chat_template import TemplateSet

__all__ = ["TemplatedTokenizer"]


class TemplatedTokenizer:
    """Chat rendering for a subclass's templates and special tokens."""

    _special: SpecialTokens
    _context: dict[str, str]
    templates: TemplateSet

    @property
    def special_tokens(self) -> SpecialTokens:
        return self._special

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        return self.templates.render_chat(messages, add_generation_prompt, tools, self._context, kwargs)
