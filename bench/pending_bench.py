"""Pending prefixes per request: this tree's `PendingPrefixes` against another revision's, interleaved.

Run: ``.venv/bin/python bench/pending_bench.py [--base REV] [--reps 5]``. Each routed request does
what the gateway does with the overlay: one `leading_run` probe, one `add`, and the answer of the
request `--in-flight` before it (expired after the grace). Prompts are the long chat's shape: 528
shared keys and 3 of its own (531 blocks of 16 tokens, ~8.5k tokens); "shared objects" reuses the
same int objects across requests (as the prefix-key cache hands them out), "fresh objects" does not.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODULE = "router/core/mirror/pending.py"


def load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def prompts(n: int, fresh: bool, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.getrandbits(63) for _ in range(528)]
    return [
        ([int(str(k)) for k in shared] if fresh else shared) + [rng.getrandbits(63) for _ in range(3)]
        for _ in range(n)
    ]


def per_request_us(cls: Any, requests: list[list[int]], in_flight: int) -> float:
    p = cls(ttl_s=5.0)
    now = 0.0
    start = time.perf_counter()
    for i, keys in enumerate(requests):
        now += 0.001
        p.leading_run("a", keys, len(keys), now)
        p.add(f"r{i}", "a", keys, now)
        if i >= in_flight:
            p.answered(f"r{i - in_flight}", now - 0.2)
    return (time.perf_counter() - start) / len(requests) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", default="2ddbf87", help="the git revision to compare against")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--in-flight", type=int, default=32)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    old_source = subprocess.run(["git", "-C", str(ROOT), "show", f"{args.base}:{MODULE}"],
                                check=True, capture_output=True).stdout  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "pending_base.py").write_bytes(old_source)
        classes = {"base": load(Path(tmp) / "pending_base.py", "pending_base").PendingPrefixes,
                   "new": load(ROOT / MODULE, "pending_new").PendingPrefixes}  # fmt: skip
    print("| prompts | base us/request | new us/request | new/base |\n|---|---|---|---|")
    for fresh in (False, True):
        requests = prompts(args.requests, fresh)
        runs: dict[str, list[float]] = {"base": [], "new": []}
        for rep in range(args.reps):
            for name in ("base", "new") if rep % 2 == 0 else ("new", "base"):
                runs[name].append(per_request_us(classes[name], requests, args.in_flight))
        ratio = statistics.median(runs["new"]) / statistics.median(runs["base"])
        label = "fresh objects" if fresh else "shared objects"
        print(f"| {label} | {min(runs['base']):.1f}-{max(runs['base']):.1f} | "
              f"{min(runs['new']):.1f}-{max(runs['new']):.1f} | {ratio:.3f} |")  # fmt: skip


if __name__ == "__main__":
    main()
