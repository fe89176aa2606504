"""Architecture rules, enforced: the pure core imports no I/O, and imports flow one way.

events/ imports nothing from router/ or engine_stub/; router/ and engine_stub/ never import each other.
The pure modules (listed by name, and any module that exists among them) import no asyncio, sockets,
HTTP or clock-reading helpers: time is passed in.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IO_MODULES = {"asyncio", "zmq", "httpx", "fastapi", "aiohttp", "uvicorn", "socket", "starlette", "time"}
PURE = [
    "events/wire.py",
    "events/decode.py",
    "events/block_hash.py",
    "events/frames.py",
    "events/sequence.py",
    "events/faults.py",
    "events/sources.py",
    "events/recording.py",
    "events/tokenization/segmenter.py",
    "events/tokenization/segment_cache.py",
    "engine_stub/block_pool.py",
    "engine_stub/kv_groups.py",
    "engine_stub/group_manager.py",
    "engine_stub/mamba_group.py",
    "engine_stub/coordinator.py",
    "engine_stub/kv_manager.py",
    "engine_stub/scheduler.py",
    "engine_stub/faults.py",
    "engine_stub/dp_balance.py",
    "engine_stub/openai_io.py",
    "engine_stub/pseudo_text.py",
    "engine_stub/cost_model.py",
    "router/keys.py",
    "router/key_cache.py",
    "router/request_keys.py",
    "router/pending.py",
    "router/mirror.py",
    "router/lookup.py",
    "router/trust.py",
    "router/scoring.py",
    "router/load.py",
    "router/breaker.py",
    "router/retry.py",
    "router/admission.py",
    "router/refusal.py",
    "router/headers.py",
    "router/ids.py",
    "router/errors.py",
    "router/model_spec.py",
    "router/mirror_state.py",
    "router/finders.py",
    "router/group_kinds.py",
    "router/event_keys.py",
    "router/sparse_keys.py",
    "router/store_keys.py",
    "router/fleet.py",
    "router/replica.py",
    "router/prepared.py",
    "router/routing.py",
    "kvrouter/loadtest/workload.py",
    "kvrouter/loadtest/results.py",
]
FORBIDDEN_PACKAGES = {
    "events": {"router", "engine_stub", "kvrouter"},
    "router": {"engine_stub"},
    "engine_stub": {"router"},
}


def imported_roots(path: Path) -> set[str]:
    """Top-level names of every module `path` imports."""
    tree = ast.parse(path.read_text(), filename=str(path))
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("relpath", [p for p in PURE if (ROOT / p).exists()])
def test_pure_module_imports_no_io(relpath: str) -> None:
    assert not imported_roots(ROOT / relpath) & IO_MODULES


@pytest.mark.parametrize("package", sorted(FORBIDDEN_PACKAGES))
def test_imports_flow_one_way(package: str) -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(imported_roots(path) & FORBIDDEN_PACKAGES[package])
        for path in (ROOT / package).rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_pure_list_names_the_core_that_exists() -> None:
    assert sum((ROOT / p).exists() for p in PURE) >= 3


# -- transitive: the fleet's pure state and the routing core ----------------------------------

TRANSITIVE_IO = {"asyncio", "zmq", "aiohttp", "starlette", "uvicorn", "socket"}
REPO_PACKAGES = {"events", "router", "engine_stub", "kvrouter"}
PURE_ROOTS = ["router.fleet", "router.replica", "router.routing", "router.prepared"]


def module_path(module: str) -> Path | None:
    """The file of a repository module (`a.b` -> a/b.py or a/b/__init__.py), None if outside the repo."""
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_modules(path: Path) -> set[str]:
    """Full names of every module `path` imports (`from a import b` counts `a` and `a.b`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def transitive_roots(module: str) -> dict[str, str]:
    """Every top-level module `module` reaches through the repository's own modules, mapped to the
    repository module that imports it first (for the failure message)."""
    seen: set[str] = set()
    reached: dict[str, str] = {}
    todo = [module]
    while todo:
        name = todo.pop()
        path = module_path(name)
        if name in seen or path is None:
            continue
        seen.add(name)
        for imported in imported_modules(path):
            root = imported.split(".")[0]
            reached.setdefault(root, name)
            if root in REPO_PACKAGES:
                parts = imported.split(".")
                todo.extend(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return reached


@pytest.mark.parametrize("module", PURE_ROOTS)
def test_fleet_state_and_routing_reach_no_io_transitively(module: str) -> None:
    assert module_path(module) is not None, f"{module} does not exist"
    reached = transitive_roots(module)
    assert {root: reached[root] for root in reached.keys() & TRANSITIVE_IO} == {}
