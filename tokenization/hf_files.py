"""The parts of HuggingFace tokenizer files we read, as msgspec Structs (unknown fields ignored).

``tokenizer.json`` gives the added tokens and the normalizer (both decide where text may be split);
``tokenizer_config.json`` gives the special-token strings and the chat template(s). Finding a tokenizer
shipped inside an installed package is done by path, without importing the package.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from tokenization.base import TokenizationError
from tokenization.segment_cache import AddedToken

__all__ = [
    "TokenizerConfig",
    "TokenizerJsonHeader",
    "package_dir",
    "read_struct",
    "token_text",
]

T = TypeVar("T")


class NormalizerSpec(msgspec.Struct):
    """A normalizer's type; for a ``Sequence``, its members (kept raw: we only need to know if empty)."""

    type: str
    normalizers: list[msgspec.Raw] = msgspec.field(default_factory=list)


class _BpeModel(msgspec.Struct):
    type: str
    vocab: dict[str, int] = msgspec.field(default_factory=dict)


class TokenizerJsonHeader(msgspec.Struct):
    """tokenizer.json without the model: the added vocabulary, the normalizer, and the pre-tokenizer and
    decoder (which decide where text may be cut and how long each token is in bytes)."""

    added_tokens: list[AddedToken] = msgspec.field(default_factory=list)
    normalizer: NormalizerSpec | None = None
    pre_tokenizer: msgspec.Raw = msgspec.Raw(b"null")
    decoder: dict[str, Any] | None = None
    model: msgspec.Raw = msgspec.Raw(b"null")

    def bpe_vocab(self) -> dict[str, int] | None:
        """The model's vocabulary (token text -> id) when the model is BPE, else None."""
        try:
            model = msgspec.json.decode(self.model, type=_BpeModel)
        except msgspec.DecodeError:
            return None
        return model.vocab if model.type == "BPE" else None

    @property
    def identity_normalizer(self) -> bool:
        """No normalizer, or an empty Sequence: normalized added tokens match the raw text."""
        n = self.normalizer
        return n is None or (n.type == "Sequence" and not n.normalizers)


class TokenSpec(msgspec.Struct):
    """An AddedToken as tokenizer_config.json spells it (``{"__type": "AddedToken", "content": ...}``)."""

    content: str


TokenField = str | TokenSpec | None


def token_text(field: TokenField) -> str | None:
    """The token string of a config field, whichever form it takes."""
    return field.content if isinstance(field, TokenSpec) else field


class NamedTemplate(msgspec.Struct):
    """One entry of a list-valued ``chat_template`` (e.g. ``default``, ``tool_use``)."""

    name: str
    template: str


class TokenizerConfig(msgspec.Struct):
    """tokenizer_config.json: special tokens and the chat template(s)."""

    bos_token: TokenField = None
    eos_token: TokenField = None
    pad_token: TokenField = None
    unk_token: TokenField = None
    chat_template: str | list[NamedTemplate] | None = None

    def templates(self) -> dict[str, str]:
        """Named template sources; a single string template is named ``default``."""
        if isinstance(self.chat_template, str):
            return {"default": self.chat_template}
        return {t.name: t.template for t in self.chat_template or []}


def read_struct(path: Path, kind: type[T]) -> T:
    """Decode a JSON file into ``kind``; a missing file or wrong type raises TokenizationError naming both."""
    try:
        return msgspec.json.decode(path.read_bytes(), type=kind)
    except (OSError, msgspec.DecodeError) as exc:
        raise TokenizationError(f"cannot read {path}: {exc}") from exc


def package_dir(package: str) -> Path:
    """The directory of an installed package, found without importing it (imports may be slow)."""
    spec = importlib.util.find_spec(package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise TokenizationError(f"package {package!r} is not installed")
    return Path(locations[0])
