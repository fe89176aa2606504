"""Recorded decisions against their replay: where the engines differ, and a summary (pure).

Under the recorded policy every decision must come back exact (`Comparison.exact == decisions`);
under another policy the differences are what that policy would have done with the same requests,
the same event history and the same recorded load and trust. The history is the recorded one: the
engines' caches do not follow the replayed choices, so replayed hits are those of the recorded fleet.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from kvrouter.replay.decisions import DecisionReplay

__all__ = ["Comparison", "Difference", "compare", "render_comparison"]


class Difference(msgspec.Struct, frozen=True):
    """One decision whose replay differs: both engines, both predicted cached tokens, both reasons."""

    index: int
    time: float
    request_id: str
    attempt: int
    recorded_engine: str | None
    replayed_engine: str | None
    recorded_hit_tokens: int
    replayed_hit_tokens: int
    recorded_reason: str
    replayed_reason: str
    hits_match: bool
    error: str = ""


class Comparison(msgspec.Struct):
    """Counts over every decision, and the decisions that differ."""

    recorded_policy: str = ""
    replayed_policy: str = ""
    decisions: int = 0
    same_engine: int = 0
    different_engine: int = 0
    exact: int = 0
    hit_mismatches: int = 0
    not_replayed: int = 0
    recorded_cached_tokens: int = 0
    replayed_cached_tokens: int = 0
    recorded_share: dict[str, int] = {}
    replayed_share: dict[str, int] = {}
    differences: list[Difference] = []

    def add(self, r: DecisionReplay) -> None:
        """Count one decision replay; a difference is another engine, or (same policy) not exact."""
        self.decisions += 1
        self.recorded_policy = r.recorded.policy.value
        _count(self.recorded_share, r.recorded.engine)
        self.recorded_cached_tokens += r.recorded.predicted_cached_tokens
        if r.replayed is None:
            self.not_replayed += 1
            self.differences.append(_difference(r))
            return
        self.replayed_policy = r.replayed.policy.value
        _count(self.replayed_share, r.replayed.engine)
        self.replayed_cached_tokens += r.replayed.predicted_cached_tokens
        same = r.replayed.engine == r.recorded.engine
        self.same_engine += same
        self.different_engine += not same
        self.exact += r.exact
        self.hit_mismatches += not r.hits_match
        if not same or (r.replayed.policy == r.recorded.policy and not r.exact):
            self.differences.append(_difference(r))


def _count(share: dict[str, int], engine: str | None) -> None:
    key = engine or "none"
    share[key] = share.get(key, 0) + 1


def _difference(r: DecisionReplay) -> Difference:
    rec, rep = r.recorded, r.replayed
    return Difference(
        index=r.index,
        time=r.time,
        request_id=r.request_id,
        attempt=r.attempt,
        recorded_engine=rec.engine,
        replayed_engine=rep.engine if rep else None,
        recorded_hit_tokens=rec.predicted_cached_tokens,
        replayed_hit_tokens=rep.predicted_cached_tokens if rep else 0,
        recorded_reason=rec.reason,
        replayed_reason=rep.reason if rep else "",
        hits_match=r.hits_match,
        error=r.error,
    )


def compare(replays: Iterable[DecisionReplay]) -> Comparison:
    """Fold decision replays into a `Comparison` (see `Comparison.add`)."""
    out = Comparison()
    for r in replays:
        out.add(r)
    return out


def render_comparison(c: Comparison, limit: int = 50) -> str:
    """The differences (the first `limit`) as a table, then the summary."""
    lines = []
    if c.differences:
        lines.append(
            f"{'#':>6} {'request':<20} {'try':>3} {'recorded':<14} {'hit':>6}"
            f" {'replayed':<14} {'hit':>6}  reason"
        )
        for d in c.differences[:limit]:
            reason = d.error or d.replayed_reason + (
                "" if d.hits_match else "  [hits differ from the recording]"
            )
            lines.append(
                f"{d.index:>6} {d.request_id[:20]:<20} {d.attempt:>3} {d.recorded_engine or '-':<14}"
                f" {d.recorded_hit_tokens:>6} {d.replayed_engine or '-':<14}"
                f" {d.replayed_hit_tokens:>6}  {reason}"
            )
        if len(c.differences) > limit:
            lines.append(f"... {len(c.differences) - limit} more (--json lists all)")
        lines.append("")
    share = ", ".join(f"{e} {c.recorded_share.get(e, 0)}->{c.replayed_share.get(e, 0)}" for e in _engines(c))
    lines += [
        f"recorded policy {c.recorded_policy or '-'}, replayed under {c.replayed_policy or '-'}",
        f"decisions {c.decisions}: same engine {c.same_engine}, different {c.different_engine},"
        f" exact {c.exact}, not replayed {c.not_replayed}, hit mismatches {c.hit_mismatches}",
        f"predicted cached tokens: recorded {c.recorded_cached_tokens}, replayed {c.replayed_cached_tokens}",
        f"decisions per engine (recorded->replayed): {share or '-'}",
    ]
    return "\n".join(lines)


def _engines(c: Comparison) -> list[str]:
    return sorted(set(c.recorded_share) | set(c.replayed_share))
