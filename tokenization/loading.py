"""The one way a tokenizer is loaded from configuration, shared by the router and the engine stub.

Both ends must tokenize a request identically for the router's predictions to hold, so both call
`load_tokenizer` with the same settings: a tokenizer source (a local path or an HF repo id, with its
revision) and an optional chat template file.
"""

from __future__ import annotations

from pathlib import Path

from tokenization.builtin import BuiltinTokenizer
from tokenization.cached_encoder import CachedEncoder
from tokenization.chat_template import ChatTemplate, TemplateSet
from tokenization.hf import HfTokenizer
from tokenization.hub import fetch_tokenizers
from tokenization.hub_names import hub_repo
from tokenization.segment_cache import SegmentCache, SegmentedEncoder, Segmenter
from tokenization.tokenizer import Tokenizer

__all__ = ["HUB_TIMEOUT_S", "cached_encoder", "load_encoder", "load_tokenizer"]

HUB_TIMEOUT_S = 30.0
"""The longest wait for the HF hub to resolve a repo id's tokenizer files (tokenization.hub)."""


def load_tokenizer(
    source: str | None,
    chat_template: str | None = None,
    revision: str | None = None,
    timeout_s: float = HUB_TIMEOUT_S,
) -> HfTokenizer | BuiltinTokenizer:
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


def load_encoder(
    source: str | None,
    chat_template: str | None = None,
    revision: str | None = None,
    timeout_s: float = HUB_TIMEOUT_S,
) -> CachedEncoder:
    """`load_tokenizer`'s tokenizer with its caches (`cached_encoder`): what request preparation uses."""
    return load_tokenizer(source, chat_template, revision, timeout_s).cached_encoder()


def cached_encoder(tokenizer: Tokenizer) -> CachedEncoder:
    """A new cached encoder over `tokenizer`: the implementation's own (its caches, when their probes
    hold), or for any other tokenizer one that encodes every text plainly."""
    if isinstance(tokenizer, HfTokenizer | BuiltinTokenizer):
        return tokenizer.cached_encoder()
    plain = Segmenter([], identity_normalizer=False)
    plain.enabled = False

    def encode(pieces: list[str]) -> list[list[int]]:
        return [tokenizer.encode(p, add_special_tokens=False) for p in pieces]

    return CachedEncoder(tokenizer, SegmentedEncoder(plain, encode, SegmentCache(0)), None)
