"""Tokenizers named by HF repo id, resolved offline from a hub cache built in the test's directory.

huggingface_hub reads `HF_HUB_CACHE`/`HF_HOME` and `HF_HUB_OFFLINE` into its `constants` module when
it is first imported; these in-process tests set those constants (the library's own seam). The
gateway's end-to-end test (tests/router/test_hub_tokenizer_e2e.py) sets the real variables instead.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from huggingface_hub import constants

from tests.hub_helpers import cache_revision, template_config, tiny_tokenizer_json
from tokenization import TokenizationError
from tokenization.hub import HubUnavailable, fetch_tokenizers
from tokenization.hub_names import hub_repo
from tokenization.loading import load_tokenizer

REPO = "deepseek-ai/DeepSeek-V4"
MAIN = "a" * 40
PINNED = "b" * 40
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An offline hub cache holding REPO at MAIN (refs main) and at PINNED (tag v2), their templates
    telling them apart."""
    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    for commit, ref in ((MAIN, "main"), (PINNED, "v2")):
        files: dict[str, str | Path] = {
            "tokenizer.json": tiny_tokenizer_json(tmp_path),
            "tokenizer_config.json": template_config(f"{ref}:{{{{ messages[0].content }}}}"),
        }
        cache_revision(cache, REPO, commit, files, refs=(ref,))
    return cache


def test_a_repo_id_loads_from_the_cache_offline_with_its_own_template(hub: Path, tmp_path: Path) -> None:
    tok = load_tokenizer(REPO)
    assert tok.apply_chat_template(CHAT, add_generation_prompt=False) == "main:hi"
    assert tok.encode("hello world", add_special_tokens=False) == [1, 2]  # the cached tokenizer.json's
    assert load_tokenizer(str(tiny_tokenizer_json(tmp_path))).encode("hello world", False) == [1, 2]


def test_a_revision_pin_chooses_its_snapshot(hub: Path) -> None:
    for revision in ("v2", PINNED):
        assert (
            load_tokenizer(REPO, revision=revision).apply_chat_template(CHAT, add_generation_prompt=False)
            == "v2:hi"
        )


def test_a_named_template_overrides_the_repos_own(hub: Path, tmp_path: Path) -> None:
    named = tmp_path / "chat.jinja"
    named.write_text("named:{{ messages[0].content }}", encoding="utf-8")
    assert (
        load_tokenizer(REPO, str(named)).apply_chat_template(CHAT, add_generation_prompt=False) == "named:hi"
    )


def test_a_chat_template_jinja_in_the_repo_is_read(hub: Path, tmp_path: Path) -> None:
    commit = "c" * 40
    files: dict[str, str | Path] = {
        "tokenizer.json": tiny_tokenizer_json(tmp_path),
        "tokenizer_config.json": template_config("config:{{ messages[0].content }}"),
        "chat_template.jinja": "jinja:{{ messages[0].content }}",
    }
    cache_revision(hub, "org/with-jinja", commit, files)
    assert (
        load_tokenizer("org/with-jinja").apply_chat_template(CHAT, add_generation_prompt=False) == "jinja:hi"
    )


def test_what_cannot_be_had_says_why(hub: Path) -> None:
    cache_revision(hub, "org/no-tokenizer-json", "d" * 40, {"tokenizer_config.json": template_config("x")})
    refs = [("org/not-cached", None), (REPO, "no-such-tag"), ("org/no-tokenizer-json", None)]
    found = fetch_tokenizers(refs, timeout_s=30.0)
    reasons = {ref: r.reason for ref, r in found.items() if isinstance(r, HubUnavailable)}
    assert reasons == {refs[0]: "offline", refs[1]: "offline", refs[2]: "no_tokenizer"}
    with pytest.raises(HubUnavailable, match="tokenizer org/not-cached from the HF hub: offline: "):
        load_tokenizer("org/not-cached")


@pytest.mark.parametrize(
    ("source", "repo"),
    [("Qwen/Qwen3-8B", "Qwen/Qwen3-8B"), ("meta-llama/Llama-3.1-8B", "meta-llama/Llama-3.1-8B"),
     ("/models/qwen3/tokenizer.json", None), ("./tok", None), ("../tok", None), ("~/tok", None),
     ("models/qwen3/tokenizer.json", None)],
)  # fmt: skip
def test_a_source_is_a_path_or_a_repo_id(source: str, repo: str | None) -> None:
    assert hub_repo(source) == repo


def test_an_existing_relative_directory_is_a_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "Org" / "Name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert hub_repo("Org/Name") is None


@pytest.mark.parametrize(
    "source",
    [
        "Qwen3-8B",
        "Qwen/Qwen3 8B",
        "Qwen//Qwen3",
        "Qwen/",
        "a/b/c",
        "Qwen/Qwen--3",
        "Qwen/..x",
        "-a/b",
        "Qwen/" + "x" * 97,
    ],
)
def test_a_malformed_repo_id_is_an_error(source: str) -> None:
    with pytest.raises(
        TokenizationError, match="neither an existing file or directory nor a HuggingFace repo id"
    ):
        hub_repo(source)
