"""The one way a tokenizer is loaded from configuration, shared by the router and the engine stub.

Both ends must tokenize a request identically for the router's predictions to hold, so both call
`load_tokenizer` with the same settings: a tokenizer source (a local path or an HF repo id, with its
revision) and an optional chat template file.
"""

from __future__ import annotations

from pathlib import Path

from tokenization.base import Tokenizer
from tokenization.builtin import BuiltinTokenizer
from tokenization.chat_template import ChatTemplate, TemplateSet
from tokenization.hf import HfTokenizer
from tokenization.hub import fetch_tokenizers
from tokenization.hub_names import hub_repo

__all__ = ["HUB_TIMEOUT_S", "load_tokenizer"]

HUB_TIMEOUT_S = 30.0
"""The longest wait for the HF hub to resolve a repo id's tokenizer files (tokenization.hub)."""


def load_tokenizer(
    source: str | None,
    chat_template: str | None = None,
    revision: str | None = None,
    timeout_s: float = HUB_TIMEOUT_S,
) -> Tokenizer:
    """The built-in tokenizer (`source` None) or an HF tokenizer from a directory, a tokenizer.json
    path (its tokenizer_config.json beside it, when there is one) or an HF repo id at `revision`
    (through the hub's cache, within `timeout_s`); `chat_template`, a .jinja file, overrides the
    tokenizer's own template in every case. TokenizationError (`HubUnavailable` for a repo's files)
    or OSError when a file cannot be read."""
    template = Path(chat_template) if chat_template else None
    if source is None:
        tok = BuiltinTokenizer()
        if template is not None:
            tok.templates = TemplateSet(default=ChatTemplate(template.read_text(encoding="utf-8")))
        return tok
    repo = hub_repo(source)
    if repo is not None:
        found = fetch_tokenizers([(repo, revision)], timeout_s)[(repo, revision)]
        if not isinstance(found, Path):
            raise found
        return HfTokenizer.from_dir(found, template)
    path = Path(source).expanduser()
    if path.is_dir():
        return HfTokenizer.from_dir(path, template)
    config = path.with_name("tokenizer_config.json")
    return HfTokenizer.from_files(path, config if config.is_file() else None, template)
