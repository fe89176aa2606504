"""Where the gateway's CPU goes under load: one gateway behind the fast fake backend, sampled or counted.

Run: ``.venv/bin/python bench/gateway_profile.py [--case chat|completions] [--policy kv] MODE``.
One gateway of this tree (`--policy`, deepseek tokenizer and chat template, one worker) gets a
warm-up, then ``wrk -t1`` at `--conc` connections. Modes:

- ``--spy F.raw`` (py-spy must be on PATH or in the virtualenv; root or ptrace allowed): py-spy
  records the gateway for `--seconds`; the raw samples (collapsed stacks) go to F.raw and the summary
  printed is each function's self and inclusive share of the samples. ``--summary F.raw`` only
  summarises an earlier recording.
- ``--calls``: the gateway runs under cProfile twice, once for `--seconds` / 4 and once for
  `--seconds`; the difference of the two profiles over the difference of their request counts (the
  gateway's own, from its `_relay` calls) is each function's calls and own time per request,
  start-up and warm-up cancelled out (whole seconds: wrk's). The times are cProfile's (inflated,
  and C methods of extension types are folded into their callers); the call counts are exact, and
  comparable between trees on any machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pstats
import re
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Final

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.gateway_cpu_bench import KVROUTER, start_gateway, stop_all
from bench.peer_proxy_bench import Case, Row, Target, chat_case, completions_case, measure
from bench.proxy_bench import gateway_config, start_process

HERE = Path(__file__).resolve()
FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def py_spy() -> str:
    """The py-spy executable: beside this interpreter, else on PATH."""
    local = Path(sys.executable).with_name("py-spy")
    found = str(local) if local.exists() else shutil.which("py-spy")
    if found is None:
        raise SystemExit("py-spy not found: .venv/bin/python -m pip install py-spy")
    return found


async def loaded(
    args: argparse.Namespace, tmp: Path, head: Sequence[str], seconds: float, spy_out: str | None = None
) -> Row:
    """Start backend and gateway (run by `head`), warm up, load for `seconds` (py-spy recording into
    `spy_out` if given), stop both; the load's row."""
    case: Case = chat_case() if args.case == "chat" else completions_case()
    files = (tmp / "head", tmp / "tail")
    files[0].write_bytes(case.head)
    files[1].write_bytes(case.tail)
    procs: list[asyncio.subprocess.Process] = []
    try:
        argv = [sys.executable, str(HERE.parent / "proxy_bench.py"), "--backend"]
        backend, port = await start_process(argv, lambda line: line.decode().strip())
        procs.append(backend)
        config = tmp / "gateway.toml"
        policy = f'[policy]\nname = "{args.policy}"\n'
        config.write_text(gateway_config(f"http://127.0.0.1:{port}") + policy)
        proc, url = await start_gateway(HERE.parents[1], config, dict(os.environ), head, args.log_level)
        procs.append(proc)
        target = Target("gateway", url, proc.pid)
        await measure(target, case, files, 8, 2, -1)
        sampler = None
        if spy_out is not None:
            spy = [py_spy(), "record", "--pid", str(proc.pid), "--rate", str(args.rate), "--format", "raw"]
            spy += ["--duration", str(int(seconds)), "-o", spy_out]
            # py-spy reads C stacks only from a stopped process; Python-only sampling need not stop it
            spy += ["--native"] if args.native else ["--nonblocking"]
            sampler = await asyncio.create_subprocess_exec(*spy, stdout=asyncio.subprocess.DEVNULL)
        row = await measure(target, case, files, args.conc, seconds + (sampler is not None), 0)
        if sampler is not None:
            await sampler.wait()
        return row
    finally:
        await stop_all(procs)  # a clean stop: cProfile writes its file on the way out


async def spy(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp_name:
        row = await loaded(args, Path(tmp_name), KVROUTER, args.seconds, args.spy)
    print(f"{row.requests} requests, {row.rps:.0f} req/s, {row.cpu_ms_per_req:.3f} ms CPU/request")


async def calls(args: argparse.Namespace) -> None:
    """Two cProfile runs, short and long; print the per-request difference."""
    runs: list[tuple[pstats.Stats, int]] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for n, seconds in enumerate((max(1, round(args.seconds / 4)), round(args.seconds))):
            out = tmp / f"run{n}.prof"
            head = (sys.executable, "-m", "cProfile", "-o", str(out), "-m", "kvrouter")
            row = await loaded(args, tmp, head, seconds)
            runs.append((pstats.Stats(str(out)), row.requests))
    (short, n_short), (long, n_long) = runs
    relayed = _calls(long, RELAYED) - _calls(short, RELAYED)
    per_request(short, long, relayed if relayed > 0 else n_long - n_short, args.top)


RELAYED: Final = ("gateway.py", "_relay")
"""A plain function the gateway calls once per relayed answer: its calls count the requests served
(wrk's counts miss what was in flight at its end or still queued, up to 20% under load)."""


def _calls(stats: pstats.Stats, where: tuple[str, str]) -> int:
    """The calls of the function named `where` (file name, function) in `stats`; 0 if none."""
    file, func = where
    items = stats.stats.items()  # type: ignore[attr-defined]
    return sum(v[1] for (path, _, name), v in items if name == func and Path(path).name == file)


def per_request(short: pstats.Stats, long: pstats.Stats, requests: int, top: int) -> None:
    """Print each function's calls and own time per request: (long - short) / `requests`."""
    before = short.stats  # type: ignore[attr-defined]
    rows = []
    for key, (_, ncalls, own_s, cum_s, _) in long.stats.items():  # type: ignore[attr-defined]
        _, ncalls0, own0, cum0, _ = before.get(key, (0, 0, 0.0, 0.0, {}))
        if ncalls > ncalls0:
            rows.append((
                (own_s - own0) / requests * 1e6, (ncalls - ncalls0) / requests,
                (cum_s - cum0) / requests * 1e6, key,
            ))  # fmt: skip
    print(f"{requests} requests: {sum(r[1] for r in rows):.0f} calls and {sum(r[0] for r in rows):.0f} us")
    print("own us/request  calls/request  cumulative us  function")
    for own_us, n, cum_us, (file, line, func) in sorted(rows, reverse=True)[:top]:
        print(f"{own_us:9.2f} {n:9.1f} {cum_us:9.1f}  {Path(file).name}:{line}({func})")


def summarise(raw: Path, top: int) -> None:
    """Print the `top` functions by self share and by inclusive share of the samples in `raw`."""
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_text)
        # A coroutine resumed by the loop's C code starts its own stack: no frame is skipped.
        frames = [_name(f) for f in stack.split(";")]
        total += count
        own[frames[-1]] += count
        for name in set(frames):
            incl[name] += count
    print(f"{total} samples")
    for title, counter in (("self", own), ("inclusive", incl)):
        print(f"\n{title} %")
        for name, n in counter.most_common(top):
            print(f"{100 * n / total:6.2f}  {name}")


def _name(frame: str) -> str:
    match = FRAME.match(frame)
    if match is None:
        return frame
    return f"{match['func']} ({Path(match['file']).name})"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--case", choices=("chat", "completions"), default="chat")
    parser.add_argument("--policy", default="kv")
    parser.add_argument("--conc", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--top", type=int, default=60)
    parser.add_argument("--log-level", default="ERROR", help="the gateway's (INFO: with access lines)")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--spy", metavar="F.raw", help="record with py-spy into F.raw, then summarise")
    mode.add_argument("--summary", metavar="F.raw", help="only summarise an earlier py-spy recording")
    mode.add_argument("--calls", action="store_true", help="cProfile: calls and own time per request")
    parser.add_argument("--rate", type=int, default=500, help="py-spy samples per second")
    parser.add_argument("--native", action="store_true", help="py-spy samples C frames too")
    args = parser.parse_args()
    if args.calls:
        asyncio.run(calls(args))
        return
    if args.spy is not None:
        asyncio.run(spy(args))
    summarise(Path(args.summary or args.spy), args.top)


if __name__ == "__main__":
    main()
