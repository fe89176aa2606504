"""Every relative link in the repository's Markdown files resolves: the file exists, and a `#fragment`
into a Markdown file names one of its headings (GitHub's anchors). Links to other sites are not
followed (the tests use no network)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIPPED_DIRS = {"out", "build", "dist", "node_modules"}  # and every hidden directory (.venv, .git, ...)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def markdown_files() -> list[Path]:
    return sorted(
        p
        for p in ROOT.rglob("*.md")
        if not any(part.startswith(".") or part in SKIPPED_DIRS for part in p.relative_to(ROOT).parts[:-1])
    )


def prose(text: str) -> str:
    """The text outside code: fenced blocks and inline code hold examples, not links."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens kept), spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # a link's text only
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor in `path`, repeats numbered as GitHub numbers them (-1, -2, ...)."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading is None:
            continue
        slug = anchor(heading.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def broken_links(path: Path) -> list[str]:
    broken: list[str] = []
    for target in LINK.findall(prose(path.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        file_part, _, fragment = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            broken.append(f"{target}: no heading with anchor #{fragment}")
    return broken


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    assert broken_links(path) == []


def test_the_checker_sees_a_broken_link_and_an_anchor(tmp_path: Path) -> None:
    """The rule can fail: a missing file and a missing heading are both reported, a good link is not."""
    (tmp_path / "other.md").write_text("# Title\n\n## The load model\n\n## Notes `x`\n\n## Notes x\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#the-load-model) [ok2](other.md#notes-x-1) [gone](missing.md) [bad](other.md#nope)\n"
        "`[code](missing.md)` [web](https://example.com/x.md) [self](#here)\n\n## Here\n"
    )
    assert broken_links(page) == ["missing.md: no such file", "other.md#nope: no heading with anchor #nope"]
    assert "notes-x" in anchors(tmp_path / "other.md")
