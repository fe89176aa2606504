"""The `session` policy's rule: keep an agent session on its engine, hard or soft. Pure (time passed in).

A session's steps resend its whole conversation, so the engine that served the last step holds the
prefix of the next. The rule, given the session key (router.core.policy.session_key), the eligible
candidates and kv's choice among them:

- no session key: kv's choice (outcome `none`);
- no pin (a new session; or one this gateway has not seen: after a restart, or evicted): kv's
  choice, which goes where the conversation's prefix is cached (the mirror's hit), and the session
  is pinned there (`new`). This is how pins are rebuilt after a gateway restart: from the mirror;
- pinned engine not eligible (unhealthy, circuit breaker open, at its in-flight limit, saturated,
  already tried for this request) or gone from the fleet (its pins were dropped): kv's choice,
  re-pinned there (`unavailable`), in both modes: a hard pin never waits for, or fails on, an
  engine that cannot take the request;
- `hard`: the pinned engine, whatever the load elsewhere (`kept`);
- `soft`: the pinned engine unless kv's choice is predicted to reach the first token faster by more
  than `margin_s` (`moved`, re-pinned there); the reason gives both predicted TTFTs, the difference
  and the margin either way (`kept`).

Each outcome is counted (`OUTCOMES`; exported as `kvrouter_session_decisions_total{outcome}`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Final

from router.core.ids import EngineId
from router.core.policy.session_pins import SessionPins

if TYPE_CHECKING:  # (scoring imports this module: the candidates' type for annotations only)
    from router.core.policy.scoring import CandidateScore

    Pick = tuple[CandidateScore, str]

__all__ = ["OUTCOMES", "SessionMode", "SessionRule"]

OUTCOMES: Final = ("none", "new", "kept", "moved", "unavailable")
"""What the rule did with a request (see the module docstring)."""


class SessionMode(enum.Enum):
    """How firmly a session stays on its engine."""

    HARD = "hard"
    SOFT = "soft"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


class SessionRule:
    """The pin table and the rule over it (see the module docstring)."""

    def __init__(self, mode: SessionMode, capacity: int, ttl_s: float, margin_s: float) -> None:
        """Pins for at most `capacity` sessions, each forgotten `ttl_s` after its last use (0: never);
        `margin_s`: how much faster to first token elsewhere moves a soft pin."""
        self.mode, self.margin_s = mode, margin_s
        self.pins = SessionPins(capacity, ttl_s)
        self.outcomes: dict[str, int] = dict.fromkeys(OUTCOMES, 0)

    def pick(
        self, session: str | None, eligible: Sequence[CandidateScore], kv: Callable[[], Pick], now: float
    ) -> Pick:
        """Choose among `eligible` (not empty) for `session` at `now`; `kv()` gives kv's choice and words."""
        if session is None:
            self.outcomes["none"] += 1
            chosen, why = kv()
            return chosen, f"session: no session key; {why}"
        pinned = self.pins.get(session, now)
        held = next((s for s in eligible if s.engine == pinned), None) if pinned is not None else None
        if held is None:
            return self._place(session, pinned, kv, now)
        if self.mode is SessionMode.HARD:
            self._use(session, held, "kept", now)
            return held, f"session {session!r}: kept on {held.engine} (hard pin: session affinity)"
        return self._soft(session, held, kv, now)

    def _place(self, session: str, pinned: EngineId | None, kv: Callable[[], Pick], now: float) -> Pick:
        """No usable pin: kv's choice, pinned."""
        chosen, why = kv()
        if pinned is None:
            outcome, lost = "new", "no pin (a new session, or one this gateway has not seen): placed by kv"
        else:
            outcome = "unavailable"
            lost = f"pinned engine {pinned} unavailable (not eligible now): moved by kv"
        self._use(session, chosen, outcome, now)
        return chosen, f"session {session!r}: {lost}, pinned to {chosen.engine}; {why}"

    def _soft(self, session: str, held: CandidateScore, kv: Callable[[], Pick], now: float) -> Pick:
        """Pinned and eligible, soft: move only when kv's choice is faster to first token by the margin."""
        best, why = kv()
        if best is held:
            self._use(session, held, "kept", now)
            return held, f"session {session!r}: kept on {held.engine} (soft pin, kv's choice too); {why}"
        margin = self.margin_s
        gain = held.predicted_ttft_s - best.predicted_ttft_s
        figures = (
            f"predicted TTFT {_ms(held.predicted_ttft_s)} on {held.engine}, {_ms(best.predicted_ttft_s)} "
            f"on {best.engine}: better by {_ms(gain)}"
        )
        if gain > margin:
            self._use(session, best, "moved", now)
            return best, (
                f"session {session!r}: moved from {held.engine} to {best.engine} (soft pin): "
                f"{figures} > margin {_ms(margin)}; {why}"
            )
        self._use(session, held, "kept", now)
        return (
            held,
            f"session {session!r}: kept on {held.engine} (soft pin): {figures} <= margin {_ms(margin)}",
        )

    def _use(self, session: str, chosen: CandidateScore, outcome: str, now: float) -> None:
        self.pins.pin(session, chosen.engine, now)
        self.outcomes[outcome] += 1
