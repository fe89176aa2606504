"""Why no replica could take a request, as the error to answer with: the limit that bound, named.

Given the first decision's candidates (none eligible): if any engine of the model is at its own
in-flight limit, the answer is the per-engine limit's 429 (capacity frees as requests end, so retrying
helps); otherwise, if breakers are open, a 503 whose Retry-After is the time until the first one lets a
probe through; when every engine is saturated (`policy.max_predicted_ttft_s`, `max_scraped_waiting`),
a 503 `saturated`, rather than piling onto one, whose Retry-After is the predicted drain time: how
long until the engine nearest the bound has worked off the excess over it of its predicted TTFT
(or wait, `policy.saturation_bound`: `CandidateScore.bounded_s`; `over_bound`); a model no engine
serves (or none healthy) is a 503 `no_engine`. Pure: time passed in.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Final

from router.core.errors import NoEngineAvailable, RouterError
from router.core.ids import EngineId
from router.core.policy.admission import Admission
from router.core.policy.scoring import WHY_AT_CAPACITY, WHY_BREAKER_OPEN, WHY_SATURATED, CandidateScore

__all__ = ["over_bound", "refusal"]

_NONE: Final[Mapping[EngineId, float]] = MappingProxyType({})


def over_bound(candidates: Iterable[CandidateScore], max_predicted_ttft_s: float) -> dict[EngineId, float]:
    """Per saturated candidate whose bounded prediction (`CandidateScore.bounded_s`: its predicted TTFT,
    or wait) is past `max_predicted_ttft_s` (0: no bound, none),
    by how many seconds: the queued prefill its engine must work off before a request like this one
    is predicted within the bound again. The engine drains that work at the rate the TTFT model
    prices it, so, with nothing more sent there, that many seconds from now."""
    if max_predicted_ttft_s <= 0:
        return {}
    return {
        c.engine: c.bounded_s - max_predicted_ttft_s
        for c in candidates
        if c.why_not == WHY_SATURATED and c.bounded_s > max_predicted_ttft_s
    }


def refusal(
    model: str,
    why_not: Sequence[tuple[EngineId, str]],
    admission: Admission,
    reopens_in_s: Mapping[EngineId, float],
    over_bound_s: Mapping[EngineId, float] = _NONE,
) -> RouterError:
    """The error for a request of `model` none of whose candidates was eligible.

    `why_not` pairs each candidate with its `CandidateScore.why_not`; `reopens_in_s` gives, per
    engine with an open breaker, the seconds until it admits a probe; `over_bound_s`, per engine
    saturated by its predicted TTFT, how far past the bound it is (`over_bound`). Retry-After is never
    below `limits.retry_after_s`."""
    full = [e for e, why in why_not if why == WHY_AT_CAPACITY]
    open_ = [e for e, why in why_not if why == WHY_BREAKER_OPEN]
    if full:
        others = "; ".join(f"{e}: {why}" for e, why in why_not if why != WHY_AT_CAPACITY)
        return admission.engines_full(model, others)
    if open_:
        wait = min((reopens_in_s.get(e, 0.0) for e in open_), default=0.0)
        return NoEngineAvailable(
            f"circuit breaker open on every engine of model `{model}` ({', '.join(open_)}) after repeated "
            "failures; retry later",
            retry_after_s=max(admission.retry_after_s, math.ceil(wait)),
            reason="breaker_open",
        )
    if why_not and all(why == WHY_SATURATED for _e, why in why_not):
        return _saturated(model, [e for e, _why in why_not], admission, over_bound_s)
    if not why_not:
        return NoEngineAvailable(f"no engine serves model `{model}`", retry_after_s=admission.retry_after_s)
    why = "; ".join(f"{e}: {w}" for e, w in why_not)
    return NoEngineAvailable(
        f"no engine available for model `{model}` ({why})", retry_after_s=admission.retry_after_s
    )


def _saturated(
    model: str, engines: Sequence[EngineId], admission: Admission, over_bound_s: Mapping[EngineId, float]
) -> RouterError:
    """Every engine saturated: retry once the first one to drain is within the bound (when a
    predicted TTFT saturated them all; a scraped waiting queue has no drain time to predict)."""
    over = [(over_bound_s[e], e) for e in engines if e in over_bound_s]
    if len(over) < len(engines):  # some engine is saturated by its scraped waiting queue
        why, wait = "predicted time to first token or waiting queue past the policy's limit", 0.0
    else:
        figures = ", ".join(f"{e}: {s:.2f} s" for s, e in sorted(over))
        why, wait = (
            f"predicted time to first token (or wait, policy.saturation_bound) past "
            f"policy.max_predicted_ttft_s by {figures}",
            min(over)[0],
        )
    retry_after_s = max(admission.retry_after_s, math.ceil(wait))
    return NoEngineAvailable(
        f"every engine of model `{model}` is saturated ({why}); retry in {retry_after_s} s",
        retry_after_s=retry_after_s,
        reason="saturated",
    )
