"""One `load_tokenizer` for both ends: the stub applies a configured chat template as the router does."""

from __future__ import annotations

from pathlib import Path

from engine_stub.runtime.stub_runtime import Stub
from engine_stub.stub_config import StubConfig, TokenizerChoice
from tests.encoder_helpers import chat_ids
from tokenization import Message
from tokenization.loading import cached_encoder, load_tokenizer

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}:{{ m['content'] }}>{% endfor %}"
CHAT: list[Message] = [{"role": "user", "content": "hi"}]


def test_the_builtin_tokenizer_takes_the_configured_chat_template(tmp_path: Path) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE, encoding="utf-8")
    assert load_tokenizer(None, str(template)).apply_chat_template(CHAT, add_generation_prompt=False) == (
        "<user:hi>"
    )


def test_the_stub_renders_chats_with_the_same_template_as_the_router(tmp_path: Path) -> None:
    """Once the stub ignored `chat_template` for the built-in tokenizer while the router applied it, so
    the two disagreed on every chat prompt's tokens (and the router's predictions with them)."""
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE, encoding="utf-8")
    stub = Stub(StubConfig(tokenizer=TokenizerChoice(chat_template=str(template))))
    router_side = load_tokenizer(None, str(template))
    assert chat_ids(stub.encoder, CHAT) == chat_ids(cached_encoder(router_side), CHAT)
    assert stub.tokenizer.apply_chat_template(CHAT, add_generation_prompt=False) == "<user:hi>"
