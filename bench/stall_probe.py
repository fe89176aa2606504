"""Run `python -m kvrouter ARGS` with the garbage collector's pauses recorded; a summary when it stops.

Run: ``.venv/bin/python bench/stall_probe.py serve --config FILE`` (bench/first_chunk_bench.py
``--gc-trace`` does). Every collection after start-up (once `gc.freeze` ran) is timed through
`gc.callbacks`; when the process stops, one JSON line goes to stderr: per generation the count, total,
p50 and max pause in ms, and the pauses above 1 ms in order. The first such collection keeps what it
found unreachable (`gc.DEBUG_SAVEALL`) and the line counts it by type, and the frames and tasks among
it: what the request path left to the collector instead of freeing by reference counting.
"""

from __future__ import annotations

import atexit
import collections
import gc
import json
import os
import runpy
import sys
import time
import types

_pauses: list[tuple[int, float]] = []
_started = [0.0]
_garbage: dict[str, object] = {}


def _on_gc(phase: str, info: dict[str, int]) -> None:
    if not gc.get_freeze_count():
        return  # still starting up
    if phase == "start":
        if not _garbage:
            gc.set_debug(gc.DEBUG_SAVEALL)
        _started[0] = time.perf_counter()
        return
    _pauses.append((info["generation"], (time.perf_counter() - _started[0]) * 1e3))
    if not _garbage:
        gc.set_debug(0)
        _garbage.update(_census(gc.garbage))
        gc.garbage.clear()


def _census(found: list[object]) -> dict[str, object]:
    kinds = collections.Counter(type(o).__qualname__ for o in found)
    frames = collections.Counter(o.f_code.co_qualname for o in found if isinstance(o, types.FrameType))
    return {"unreachable": len(found), "types": kinds.most_common(20), "frames": frames.most_common(10)}


def _summary() -> None:
    out: dict[str, object] = {"pid": os.getpid()}
    for gen in (0, 1, 2):
        ms = sorted(p for g, p in _pauses if g == gen)
        if ms:
            total, p50, top = round(sum(ms), 1), round(ms[len(ms) // 2], 3), round(ms[-1], 2)
            out[f"gen{gen}"] = {"n": len(ms), "total_ms": total, "p50_ms": p50, "max_ms": top}
    out["over_1ms"] = [(g, round(p, 1)) for g, p in _pauses if p > 1.0][-60:]
    out["first_collection"] = _garbage
    print(json.dumps(out), file=sys.stderr, flush=True)


if __name__ == "__main__":
    gc.callbacks.append(_on_gc)
    atexit.register(_summary)
    sys.argv = ["kvrouter", *sys.argv[1:]]
    runpy.run_module("kvrouter", run_name="__main__", alter_sys=True)
