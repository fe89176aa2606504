"""The fenced code blocks of docs/vllm.md, by language and order, for the tests that run or compare them."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

__all__ = ["DOC", "code_blocks", "shell_words"]

DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"
_FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def code_blocks(language: str) -> list[str]:
    """Every ```language block of docs/vllm.md, in order."""
    return [body for lang, body in _FENCE.findall(DOC.read_text()) if lang == language]


def shell_words(block: str) -> list[list[str]]:
    """A shell block as commands (backslash continuations joined), each split into words."""
    joined = block.replace("\\\n", " ")
    return [shlex.split(line) for line in joined.splitlines() if line.strip() and not line.startswith("#")]
