"""The endpoint picker decides through the `Decider`'s public API (router.edge.decider), never through
another object's private names: the seam between the picker and the gateway stays one definition."""

from __future__ import annotations

import ast
from pathlib import Path

EPP = Path(__file__).resolve().parents[3] / "router" / "epp"


def _private_uses(tree: ast.AST) -> list[str]:
    """`x._name` where `x` is not `self`/`cls`, and `from router.edge... import _name`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.append(f"line {node.lineno}: .{node.attr}")
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("router.edge"):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if a.name.startswith("_")]
    return found


def test_the_picker_uses_no_private_name_of_another_object() -> None:
    uses = {p.name: _private_uses(ast.parse(p.read_text())) for p in sorted(EPP.glob("*.py"))}
    assert uses and {name: found for name, found in uses.items() if found} == {}
