"""Instructions per request of this tree's gateway against another revision's, under callgrind.

Run: ``.venv/bin/python bench/gateway_ir_bench.py --base REV [--cases chat,completions] [--requests 200]
[--reps 2]``. Wall-clock CPU on a shared machine moves +-10% between cells; instruction counts do not.
Each tree (`git archive REV` unpacked, and this one) runs `kvrouter serve` under
``valgrind --tool=callgrind --instr-atstart=no`` behind bench/proxy_bench.py's fake backend, with
gateway_cpu_bench's config (deepseek tokenizer and chat template, policy `--policy`). Once ready:
instrumentation on, `--warmup` requests, counters zeroed, `--requests` requests one after another on
one keep-alive connection (c=1), counters dumped: Ir per request is the dump's total over the requests
(the event loop's share included). The trees take turns per repetition and case. Prints one line per
cell and the new/base ratio per case.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.gateway_cpu_bench import start_gateway, stop_all, unpack
from bench.peer_proxy_bench import Case, chat_case, completions_case
from bench.proxy_bench import gateway_config, start_process

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]


def post_all(url: str, case: Case, first: int, count: int) -> None:
    """`count` requests of `case` on one connection, numbered from `first`; each must answer 200."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=600)
    for n in range(first, first + count):
        body = case.head + str(n).encode() + case.tail
        conn.request("POST", case.path, body, {"Content-Type": "application/json"})
        answer = conn.getresponse()
        answer.read()
        assert answer.status == 200, answer.status
    conn.close()


def control(pid: int, flag: list[str], url: str, case: Case) -> None:
    """`callgrind_control *flag pid`; a request wakes the gateway if it sleeps in the event loop."""
    proc = subprocess.Popen(["callgrind_control", *flag, str(pid)], stdout=subprocess.DEVNULL)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        post_all(url, case, 10**8, 1)
        proc.wait(timeout=600)


def total_ir(out: Path) -> int:
    """The Ir total of the last callgrind dump written beside `out` (`out.N` files)."""
    dumps = sorted(out.parent.glob(out.name + ".*"), key=lambda p: int(p.suffix[1:]))
    text = dumps[-1].read_text()
    match = re.search(r"^(?:summary|totals): (\d+)", text, re.MULTILINE)
    assert match is not None, dumps[-1]
    return int(match.group(1))


async def cell(tree: Path, config: Path, case: Case, out: Path, args: argparse.Namespace) -> float:
    """Ir per request of `tree`'s gateway on `case`."""
    head = [
        "valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
        sys.executable, "-m", "kvrouter",
    ]  # fmt: skip
    proc, url = await start_gateway(tree, config, dict(os.environ), head=head)
    try:
        await asyncio.to_thread(control, proc.pid, ["-i", "on"], url, case)  # instrumentation on
        await asyncio.to_thread(post_all, url, case, 0, args.warmup)
        await asyncio.to_thread(control, proc.pid, ["-z"], url, case)
        await asyncio.to_thread(post_all, url, case, args.warmup, args.requests)
        await asyncio.to_thread(control, proc.pid, ["-d"], url, case)
        return total_ir(out) / float(args.requests)
    finally:
        await stop_all([proc])


async def run(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        (tmp / "base").mkdir()
        base = unpack(args.base, (tmp / "base").resolve())
        cases = [c for c in (chat_case(), completions_case()) if c.name in args.cases.split(",")]
        backend, port = await start_process(
            [sys.executable, str(HERE.parent / "proxy_bench.py"), "--backend"],
            lambda line: line.decode().strip(),
        )
        try:
            config = tmp / "gateway.toml"
            config.write_text(
                gateway_config(f"http://127.0.0.1:{port}") + f'[policy]\nname = "{args.policy}"\n'
            )
            results: dict[tuple[str, str], list[float]] = {}
            for rep in range(args.reps):
                for case in cases:
                    trees = [("base", base), ("new", ROOT)]
                    for name, tree in trees[rep % 2 :] + trees[: rep % 2]:
                        out = tmp / f"cg-{name}-{case.name}-{rep}.out"
                        ir = await cell(tree, config, case, out, args)
                        results.setdefault((case.name, name), []).append(ir)
                        print(f"rep {rep} {case.name} {name}: {ir:,.0f} Ir/request", flush=True)
            for case in cases:
                b, n = results[(case.name, "base")], results[(case.name, "new")]
                print(f"{case.name}: base {min(b):,.0f}-{max(b):,.0f}, new {min(n):,.0f}-{max(n):,.0f}, "
                      f"new/base {min(n) / max(b):.3f}-{max(n) / min(b):.3f}", flush=True)  # fmt: skip
        finally:
            await stop_all([backend])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", required=True, help="the git revision to compare against")
    parser.add_argument("--cases", default="chat,completions", help="of chat,completions")
    parser.add_argument("--policy", default="kv")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--reps", type=int, default=2)
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
