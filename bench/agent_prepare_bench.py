"""Where kv's per-request preparation goes on the load test's agent workload, stage by stage, per API.

Run: ``.venv/bin/python bench/agent_prepare_bench.py [--apis chat,completions] [--reps 3]``.

The requests are `kvrouter loadtest --workload agents --sessions 12 --block-tokens 64
--max-output-tokens 16 --seed 3`'s (229 agent steps: prompts of 750-2,500+ tokens that grow by an
answer and a tool result per step, a session's later steps resending almost all of the previous
prompt), as each `--api` sends them, through the built-in tokenizer the harness's gateway uses, in
arrival order, on two engines. Each request goes through what the gateway does for kv before the
upstream write: `Models.prepare` (decode, render, tokenize, block keys, session key) and
`RoutingCore.decide` (lookup, scoring); then the send's bookkeeping (`request_sent`, answered,
finished) so the pending overlay holds what the engines would.

Three measurements. With ``--passes 0`` and ``--passes 1`` under ``valgrind --tool=callgrind``, the
difference in Ir over the request count is the instructions per request (no timer, no profiler). Else, in
one process: the plain wall time per request of prepare and decide (no
profiler; the best of `--reps` passes over fresh gateway state, the first pass warming nothing:
every pass starts with new caches), and cProfile's inclusive time per stage function (profiler
overhead included, so read its shares, not its absolute figures), with the biggest functions listed.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvrouter.loadtest.agents import AgentWorkload, agent_requests
from kvrouter.loadtest.api_bodies import APIS, ApiShape, as_conversations, request_body
from router.core.fleet_state import FleetState
from router.core.ids import EngineId, RequestId
from router.core.policy.scoring import RouteRequest, Scorer, ScorerSettings
from router.core.routing import RoutingCore
from router.prepare.served_models import Models
from router.settings.config import EngineConfig, ModelConfig, RouterConfig
from tokenization.builtin import BuiltinTokenizer
from tokenization.openai_request import Endpoint

MODEL = "stub-model"
STAGES: dict[str, tuple[str, str]] = {
    "prepare (all)": ("served_models.py", "prepare"),
    "  decode body": ("request_tokens.py", "decode_request"),
    "  as_chat (messages/responses)": ("request_tokens.py", "as_chat"),
    "  tokens_of (render + encode)": ("request_tokens.py", "tokens_of"),
    "    render": ("chat_template.py", "render"),
    "    encode_chat": ("cached_encoder.py", "encode_chat"),
    "    encode": ("cached_encoder.py", "encode"),
    "  spec_keys": ("request.py", "spec_keys"),
    "  session_key": ("request.py", "session_key"),
    "decide (lookup + scoring)": ("routing.py", "decide"),
    "sent + answered + finished": ("fleet_state.py", "request_sent"),
}


def workload_bodies(api: str) -> list[bytes]:
    """The harness's 229 agent steps as `api` sends them, in arrival order."""
    spec = AgentWorkload(sessions=12, block_tokens=64, max_output_tokens=16, seed=3)
    shape = ApiShape(api=api)  # type: ignore[arg-type]
    requests = as_conversations(agent_requests(spec), shape, MODEL, BuiltinTokenizer())
    return [request_body(r, MODEL, shape) for r in requests]


def config() -> RouterConfig:
    return RouterConfig(
        engines=[
            EngineConfig(name=f"e{i}", url=f"http://127.0.0.1:{9000 + i}", model=MODEL) for i in range(2)
        ],
        models=[ModelConfig(name=MODEL, block_size=16)],
    )


class Gateway:
    """Fresh preparation and routing state: what one gateway process holds."""

    def __init__(self) -> None:
        cfg = config()
        self.models = Models(cfg)
        self.fleet = FleetState(cfg, self.models.hasher, time.monotonic)
        self.core = RoutingCore(self.fleet, Scorer(ScorerSettings()), time.perf_counter)
        self.n = 0

    def prepare_decide(self, body: bytes, endpoint: Endpoint) -> tuple[object, EngineId]:
        p = self.models.prepare(body, endpoint)
        at = self.fleet.clock() + self.n * 0.05
        d = self.core.decide(p, RouteRequest(p.session_key), at)
        return p, EngineId(d.engine or "e0")

    def send(self, body: bytes, endpoint: Endpoint) -> None:
        p, engine = self.prepare_decide(body, endpoint)
        rid, at = RequestId(f"r{self.n}"), self.fleet.clock() + self.n * 0.05
        self.fleet.request_sent(engine, rid, p, at)  # type: ignore[arg-type]
        self.fleet.request_answered(rid, at)
        self.fleet.request_finished(engine, rid, at)
        self.n += 1


def timed(bodies: list[bytes], endpoint: Endpoint, reps: int) -> tuple[float, float]:
    """Best-of-`reps` mean wall time (us) per request of prepare + decide, and of prepare alone."""
    best_all = best_prep = float("inf")
    for _ in range(reps):
        gw = Gateway()
        prep = total = 0.0
        for body in bodies:
            t0 = time.perf_counter()
            p = gw.models.prepare(body, endpoint)
            t1 = time.perf_counter()
            at = gw.fleet.clock() + gw.n * 0.05
            d = gw.core.decide(p, RouteRequest(p.session_key), at)
            t2 = time.perf_counter()
            prep, total = prep + (t1 - t0), total + (t2 - t0)
            rid, engine = RequestId(f"r{gw.n}"), EngineId(d.engine or "e0")
            gw.fleet.request_sent(engine, rid, p, at)
            gw.fleet.request_answered(rid, at)
            gw.fleet.request_finished(engine, rid, at)
            gw.n += 1
        best_all, best_prep = min(best_all, total / len(bodies)), min(best_prep, prep / len(bodies))
    return best_all * 1e6, best_prep * 1e6


def profiled(bodies: list[bytes], endpoint: Endpoint, top: int) -> None:
    gw = Gateway()
    prof = cProfile.Profile()
    prof.enable()
    for body in bodies:
        gw.send(body, endpoint)
    prof.disable()
    stats = pstats.Stats(prof)
    raw: dict[tuple[str, int, str], tuple[int, int, float, float, object]] = stats.stats  # type: ignore[attr-defined]
    n = len(bodies)
    total = sum(v[2] for v in raw.values())

    def inclusive(file: str, name: str) -> tuple[float, int]:
        hits = [(v[3], v[1]) for (f, _, fn), v in raw.items() if f.endswith("/" + file) and fn == name]
        return max(hits, default=(0.0, 0))

    print(f"  cProfile, inclusive us per request (profiled total {total / n * 1e6:.0f} us):")
    for label, (file, name) in STAGES.items():
        t, calls = inclusive(file, name)
        if calls:
            print(f"    {label:36s} {t / n * 1e6:8.1f}   ({calls / n:.2f} calls/request)")
    rows = sorted(raw.items(), key=lambda kv: -kv[1][2])[:top]
    print(f"  top {top} by own time (us per request, calls per request):")
    for (f, line, fn), v in rows:
        where = f"{Path(f).parent.name}/{Path(f).name}:{line}" if line else f
        print(f"    {v[2] / n * 1e6:8.1f}  {v[1] / n:7.2f}  {fn}  {where}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--apis", default="completions,chat,messages,responses")
    parser.add_argument("--reps", type=int, default=3, help="timed passes (best kept)")
    parser.add_argument("--top", type=int, default=20, help="functions listed by own time")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument(
        "--passes",
        type=int,
        help="only build the bodies and a gateway, then send the bodies through it this many times,"
        " untimed: run under callgrind with 0 and 1, the difference over the request count is Ir per request",
    )
    args = parser.parse_args()
    for api in args.apis.split(","):
        bodies = workload_bodies(api)
        endpoint = APIS[api]
        if args.passes is not None:
            gw = Gateway()  # built in both runs, so the difference is the requests alone
            for body in bodies * args.passes:
                gw.send(body, endpoint)
            continue
        size = sum(len(b) for b in bodies) / len(bodies)
        tokens = [Gateway().models.prepare(b, endpoint).prompt_tokens for b in bodies[:1]]
        all_us, prep_us = timed(bodies, endpoint, args.reps)
        print(
            f"\n{api}: {len(bodies)} requests, mean body {size / 1e3:.1f} KB, first prompt {tokens[0]} tokens"
        )
        print(f"  wall, best of {args.reps}: prepare {prep_us:7.1f} us, prepare + decide {all_us:7.1f} us")
        gw = Gateway()
        for body in bodies:
            gw.send(body, endpoint)
        st = gw.models.tokenizer_stats()[0]
        print(
            f"  caches: skeleton {st.skeleton_hits} hits / {st.skeleton_misses} misses"
            f" ({st.skeleton_refused} refused), carry {st.carry_hits} / {st.carry_misses},"
            f" reuse {st.reuse_hits} / {st.reuse_misses}"
        )
        if not args.no_profile:
            profiled(bodies, endpoint, args.top)


if __name__ == "__main__":
    main()
