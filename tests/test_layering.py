"""Architecture rules, enforced by the tree: the pure core reaches no I/O, and imports flow one way.

Every module's imports are followed transitively (within the repository's packages, read with `ast`;
imports under `if TYPE_CHECKING:` do not run and are not followed). From anything under a pure package
(router/core/, engine_stub/core/) or a listed pure module, no module reached may import asyncio, sockets,
ZeroMQ, an HTTP library or server, or call a clock: time is passed in. events/ and tokenization/ import
neither router/ nor engine_stub/, and those two never import each other. Inside router/, a package
imports only from lower layers (`ROUTER_LAYERS`), and no two modules anywhere import each other. A
listed path that does not exist fails, and so does a module the module map (docs/architecture.md)
does not name.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("router", "events", "engine_stub", "tokenization", "serving", "kvrouter")
IO_MODULES = {"asyncio", "socket", "zmq", "aiohttp", "starlette", "fastapi", "uvicorn", "httpx"}
# Calls that read a clock: `time.time()`, `loop.time()`, `datetime.now()`, ... (module or object, attribute).
CLOCK_ATTRS = {
    "time": {"time", "time_ns", "monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns"},
    "datetime": {"now", "utcnow", "today"},
    "loop": {"time"},
}
PURE_PACKAGES = ["router/core", "engine_stub/core"]
PURE_MODULES = [
    "events/wire.py",
    "events/validate.py",
    "events/decode.py",
    "events/block_hash.py",
    "events/frames.py",
    "events/sequence.py",
    "events/faults.py",
    "events/sources.py",
    "events/recording.py",
    "tokenization/segmenter.py",
    "tokenization/segment_cache.py",
    "tokenization/prefix_reuse.py",
    "tokenization/safe_cuts.py",
    "tokenization/skeletons.py",
    "tokenization/chat_carry.py",
    "tokenization/cached_encoder.py",
    "tokenization/fast_paths.py",
    "tokenization/chat_decoder.py",
    "tokenization/template_message.py",
    "engine_stub/runtime/faults.py",
    "engine_stub/runtime/dp_balance.py",
    "engine_stub/runtime/pseudo_text.py",
    "engine_stub/runtime/cost_model.py",
    "engine_stub/runtime/script_driver.py",
    "engine_stub/server/openai_io.py",
    "router/edge/headers.py",
    "router/links/endpoint_slices.py",
    "router/links/engine_metrics.py",
    "router/core/prepared.py",
    "kvrouter/loadtest/workload.py",
    "kvrouter/loadtest/results.py",
    "kvrouter/loadtest/busy_model.py",
    "kvrouter/loadtest/virtual_fleet.py",
    "kvrouter/loadtest/plan.py",
    "engine_stub/runtime/forecast.py",
]
# Violations being fixed elsewhere, expected to fail (strictly: delete the line once it passes).
KNOWN_VIOLATIONS: dict[str, str] = {}
FORBIDDEN_PACKAGES = {
    "events": {"router", "engine_stub", "kvrouter"},
    "tokenization": {"router", "engine_stub", "kvrouter"},
    "serving": {"router", "engine_stub", "kvrouter"},
    "router": {"engine_stub"},
    "engine_stub": {"router"},
}

# router/'s packages in layers, lowest first: a module imports from its own package or a lower layer only
# (lifecycle.py, the composition root, is the top). Packages sharing a layer do not import each other.
ROUTER_LAYERS: list[set[str]] = [
    {"settings"},
    {"core"},
    {"prepare"},
    {"links", "ops"},
    {"edge"},
    {"epp"},
    {"lifecycle"},
]
# Upward arrows still in the tree, each with why (strictly: the test fails once one is gone, so delete it).
KNOWN_UPWARD: dict[str, str] = {}


def module_path(name: str) -> Path | None:
    """The file of repository module `name` (a package's `__init__.py`), or None if it is not ours."""
    if name.split(".")[0] not in PACKAGES:
        return None
    base = ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node, except what sits under `if TYPE_CHECKING:` (never executed)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                stack.extend(child.orelse)
            else:
                stack.append(child)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


@cache
def parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


@cache
def imports_of(path: Path) -> frozenset[str]:
    """Absolute names of every module `path` imports at run time, parents included (they run first)."""
    is_package = path.name == "__init__.py"
    here = module_name(path).split(".")
    package = here if is_package else here[:-1]
    names: set[str] = set()
    for node in _runtime_nodes(parsed(path)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                prefix = package[: len(package) - (node.level - 1)]
                base = ".".join([*prefix, *([base] if base else [])])
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import module`
    with_parents = {".".join(n.split(".")[: i + 1]) for n in names if n for i in range(n.count(".") + 1)}
    return frozenset(with_parents)


def internal_imports(path: Path) -> list[Path]:
    found = {module_path(name) for name in imports_of(path)}
    return sorted(p for p in found if p is not None and p != path)


def clock_calls(path: Path) -> list[str]:
    """`module.attr` of every clock-reading call in `path` (`from time import monotonic` included)."""
    imported: dict[str, str] = {}  # local name -> "time.monotonic"
    calls: list[str] = []
    nodes = list(_runtime_nodes(parsed(path)))
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module in CLOCK_ATTRS and not node.level:
            for alias in node.names:
                if alias.name in CLOCK_ATTRS[node.module]:
                    imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in nodes:
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in imported:
            calls.append(f"{imported[func.id]} (line {node.lineno})")
        elif isinstance(func, ast.Attribute):
            owner = func.value
            owner_name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", None)
            if isinstance(owner, ast.Call):  # asyncio.get_running_loop().time()
                owner_name = "loop" if "loop" in ast.unparse(owner.func) else None
            if owner_name in CLOCK_ATTRS and func.attr in CLOCK_ATTRS[owner_name]:
                calls.append(f"{owner_name}.{func.attr} (line {node.lineno})")
    return calls


def reach(start: Path) -> dict[Path, Path | None]:
    """Every repository module `start` imports, directly or not, each with the module that imported it."""
    parent: dict[Path, Path | None] = {start: None}
    todo = [start]
    while todo:
        current = todo.pop()
        for nxt in internal_imports(current):
            if nxt not in parent:
                parent[nxt] = current
                todo.append(nxt)
    return parent


def chain(parent: dict[Path, Path | None], end: Path) -> str:
    links: list[str] = []
    node: Path | None = end
    while node is not None:
        links.append(str(node.relative_to(ROOT)))
        node = parent[node]
    return " <- ".join(links)


def pure_files() -> list[str]:
    files = [str(p.relative_to(ROOT)) for pkg in PURE_PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    return files + PURE_MODULES


def io_reached(relpath: str) -> list[str]:
    parent = reach(ROOT / relpath)
    problems = []
    for path in parent:
        io = sorted(name for name in imports_of(path) if name.split(".")[0] in IO_MODULES)
        clocks = clock_calls(path)
        if io or clocks:
            problems.append(f"{chain(parent, path)}: imports {io}, reads clock {clocks}")
    return problems


def test_every_listed_path_exists() -> None:
    listed = [*PURE_PACKAGES, *PURE_MODULES, *FORBIDDEN_PACKAGES]
    assert [p for p in listed if not (ROOT / p).exists()] == []
    assert all(list((ROOT / pkg).rglob("*.py")) for pkg in PURE_PACKAGES)


@pytest.mark.parametrize(
    "relpath",
    [
        pytest.param(p, marks=pytest.mark.xfail(reason=KNOWN_VIOLATIONS[p], strict=True))
        if p in KNOWN_VIOLATIONS
        else p
        for p in pure_files()
    ],
)
def test_pure_module_reaches_no_io_and_no_clock(relpath: str) -> None:
    assert io_reached(relpath) == []


@pytest.mark.parametrize("package", sorted(FORBIDDEN_PACKAGES))
def test_imports_flow_one_way(package: str) -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(
            name for name in imports_of(path) if name.split(".")[0] in FORBIDDEN_PACKAGES[package]
        )
        for path in sorted((ROOT / package).rglob("*.py"))
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_walk_sees_through_imports() -> None:
    """The rules above would miss nothing: a module's reach includes what its imports import."""
    root = ROOT / "router/lifecycle.py"  # the composition root
    reached = {str(p.relative_to(ROOT)) for p in reach(root)}
    assert "events/wire.py" in reached  # through the subscribers, never imported directly
    assert any(name.split(".")[0] == "zmq" for p in reach(root) for name in imports_of(p))


MODULE_MAP = ROOT / "docs" / "architecture.md"


def test_every_module_is_in_the_module_map() -> None:
    """Each module has a line in the module map, and every module or test the map's page names exists."""
    named = set(re.findall(r"`([\w/]+\.py)`", MODULE_MAP.read_text()))
    modules = [
        str(p.relative_to(ROOT))
        for pkg in PACKAGES
        if pkg != "kvrouter"
        for p in sorted((ROOT / pkg).rglob("*.py"))
        if p.name != "__init__.py"
    ]
    assert [m for m in modules if m not in named] == []
    stale = [p for p in sorted(named) if p.split("/")[0] in (*PACKAGES, "tests") and not (ROOT / p).is_file()]
    assert stale == []


def _is_parent(package_init: Path, path: Path) -> bool:
    """Whether `package_init` is the `__init__.py` of a package holding `path` (it runs first: no arrow)."""
    return package_init.name == "__init__.py" and path.is_relative_to(package_init.parent)


def arrows(path: Path) -> list[Path]:
    """The repository modules `path` imports, its own parent packages left out."""
    return [p for p in internal_imports(path) if not _is_parent(p, path)]


def all_modules() -> list[Path]:
    return [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]


def test_no_two_modules_import_each_other() -> None:
    """A two-module loop means neither can be read (or imported) without the other: one of them holds
    something that belongs to the other or to a third module below both."""
    loops = {
        " <-> ".join(sorted((str(a.relative_to(ROOT)), str(b.relative_to(ROOT)))))
        for a in all_modules()
        for b in arrows(a)
        if a in arrows(b)
    }
    assert sorted(loops) == []


def router_layer(path: Path) -> int | None:
    """The layer (index in `ROUTER_LAYERS`) of a router module, None for `router/__init__.py` and others."""
    parts = path.relative_to(ROOT).parts
    if parts[0] != "router" or parts[1] == "__init__.py":
        return None
    name = parts[1].removesuffix(".py")
    return next(i for i, layer in enumerate(ROUTER_LAYERS) if name in layer)


def test_router_imports_run_down_its_layers() -> None:
    """No router module imports one of a higher layer, or of another package in its own layer."""
    upward = set()
    for a in sorted((ROOT / "router").rglob("*.py")):
        for b in arrows(a):
            la, lb = router_layer(a), router_layer(b)
            same_package = a.relative_to(ROOT).parts[1] == b.relative_to(ROOT).parts[1]
            if (
                la is not None
                and lb is not None
                and lb >= la
                and not same_package
                and b.name != "__init__.py"
            ):
                upward.add(f"{a.relative_to(ROOT)} -> {b.relative_to(ROOT)}")
    assert sorted(upward - set(KNOWN_UPWARD)) == []
    assert sorted(set(KNOWN_UPWARD) - upward) == []  # a known arrow that is gone: delete its line


def test_every_router_package_has_a_layer() -> None:
    packages = {p.name.removesuffix(".py") for p in (ROOT / "router").iterdir() if not p.name.startswith("_")}
    packages -= {"py.typed"}
    assert packages == set().union(*ROUTER_LAYERS)
