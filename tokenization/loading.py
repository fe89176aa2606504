"""The one way a tokenizer is loaded from configuration, shared by the router and the engine stub.

Both ends must tokenize a request identically for the router's predictions to hold, so both call
`load_tokenizer` with the same two settings: a tokenizer source and an optional chat template file.
"""

from __future__ import annotations

from pathlib import Path

from tokenization.base import Tokenizer
from tokenization.builtin import BuiltinTokenizer
from tokenization.chat_template import ChatTemplate, TemplateSet
from tokenization.hf import HfTokenizer

__all__ = ["load_tokenizer"]


def load_tokenizer(source: str | None, chat_template: str | None = None) -> Tokenizer:
    """The built-in tokenizer (`source` None) or an HF tokenizer from a directory or a tokenizer.json
    path (its tokenizer_config.json beside it, when there is one); `chat_template`, a .jinja file,
    overrides the tokenizer's own template in either case. TokenizationError or OSError when a file
    cannot be read."""
    template = Path(chat_template) if chat_template else None
    if source is None:
        tok = BuiltinTokenizer()
        if template is not None:
            tok.templates = TemplateSet(default=ChatTemplate(template.read_text(encoding="utf-8")))
        return tok
    path = Path(source)
    if path.is_dir():
        return HfTokenizer.from_dir(path, template)
    config = path.with_name("tokenizer_config.json")
    return HfTokenizer.from_files(path, config if config.is_file() else None, template)
