"""Engine-stub memory under a churn: RSS of a `kvrouter engine-stub` process over N distinct prompts.

Run: ``.venv/bin/python bench/stub_memory_bench.py [--requests N] [--root DIR]``. The stub runs as a
child process (`python -m kvrouter engine-stub`, KV events on ephemeral ports, no subscriber) from
`--root` (default: this checkout; point it at an older checkout to measure before a change). The
client sends completions with distinct prompts (`--prompt-words` random words) and short outputs
(`--max-tokens`), `--concurrency` at a time, and reads the child's VmRSS from /proc every
`--every` requests. Every request is new, so nothing but fixed-size state should remain: RSS should
plateau once the bounded caches are full, however many requests follow.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from pathlib import Path

import aiohttp
import msgspec

ROOT = Path(__file__).resolve().parents[1]
EVENTS = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}'
WORDS = (
    "the a cache block router engine prefix token stub churn prompt memory bound replay buffer segment "
    "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega 42 1999 , . ! ?"
).split()


def rss_mib(pid: int) -> float:
    """The resident set size of `pid` in MiB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def start_stub(root: Path, speed_factor: float) -> tuple[asyncio.subprocess.Process, str]:
    env = {**os.environ, "VLLM_HOST_IP": "127.0.0.1", "PYTHONPATH": str(root)}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvrouter", "--log-level", "WARNING", "engine-stub", "--port", "0",
        "--kv-events-config", EVENTS, "--speed-factor", str(speed_factor),
        stdout=asyncio.subprocess.PIPE, cwd=root, env=env,
    )  # fmt: skip
    assert process.stdout is not None
    line = await asyncio.wait_for(process.stdout.readline(), 60.0)
    url: str = msgspec.json.decode(line)["url"]
    return process, url


async def churn(args: argparse.Namespace, pid: int, url: str) -> list[tuple[int, float]]:
    """Send every request; returns (requests done, RSS MiB) samples, printing each as it is taken."""
    rng = random.Random(args.seed)
    samples = [(0, rss_mib(pid))]
    print(f"{0:>8} requests  {samples[0][1]:7.1f} MiB", flush=True)
    done = 0
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(args.requests):
        queue.put_nowait(i)
    start = time.perf_counter()

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal done
        while not queue.empty():
            i = queue.get_nowait()
            words = " ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
            body = {"prompt": f"request {i}: {words}", "max_tokens": args.max_tokens}
            async with session.post(url + "/v1/completions", json=body) as reply:
                assert reply.status == 200, await reply.text()
                await reply.read()
            done += 1
            if done % args.every == 0:
                samples.append((done, rss_mib(pid)))
                rate = done / (time.perf_counter() - start)
                print(f"{done:>8} requests  {samples[-1][1]:7.1f} MiB  ({rate:.0f} req/s)", flush=True)

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(worker(session) for _ in range(args.concurrency)))
    return samples


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--every", type=int, default=2_000, help="requests between RSS samples")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-words", type=int, default=150, help="random words per prompt")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--speed-factor", type=float, default=1000.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout whose stub to run")
    args = parser.parse_args()
    process, url = await start_stub(args.root.resolve(), args.speed_factor)
    try:
        samples = await churn(args, process.pid, url)
    finally:
        process.terminate()
        await process.wait()
    first, last = samples[1][1], samples[-1][1]
    half = samples[len(samples) // 2][1]
    print(
        f"RSS {samples[0][1]:.0f} MiB at start, {first:.0f} after {samples[1][0]} requests, "
        f"{half:.0f} at half-way, {last:.0f} after {samples[-1][0]} "
        f"(second half: {last - half:+.0f} MiB)"
    )


if __name__ == "__main__":
    asyncio.run(main())
