"""Why no replica could take a request, as the error to answer with: the limit that bound, named.

Given the first decision's candidates (none eligible): if any engine of the model is at its own
in-flight limit, the answer is the per-engine limit's 429 (capacity frees as requests end, so retrying
helps); otherwise, if breakers are open, a 503 whose Retry-After is the time until the first one lets a
probe through; when every engine is saturated (`policy.max_predicted_ttft_s`, `max_scraped_waiting`),
a 503 `saturated` with Retry-After, rather than piling onto one; a model no engine serves (or none
healthy) is a 503 `no_engine`. Pure: time passed in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from router.core.errors import NoEngineAvailable, RouterError
from router.core.ids import EngineId
from router.core.policy.admission import Admission
from router.core.policy.scoring import WHY_AT_CAPACITY, WHY_BREAKER_OPEN, WHY_SATURATED

__all__ = ["refusal"]


def refusal(
    model: str,
    why_not: Sequence[tuple[EngineId, str]],
    admission: Admission,
    reopens_in_s: Mapping[EngineId, float],
) -> RouterError:
    """The error for a request of `model` none of whose candidates was eligible.

    `why_not` pairs each candidate with its `CandidateScore.why_not`; `reopens_in_s` gives, per
    engine with an open breaker, the seconds until it admits a probe."""
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
        return NoEngineAvailable(
            f"every engine of model `{model}` is saturated (predicted time to first token or waiting "
            "queue past the policy's limit); retry later",
            retry_after_s=admission.retry_after_s,
            reason="saturated",
        )
    if not why_not:
        return NoEngineAvailable(f"no engine serves model `{model}`", retry_after_s=admission.retry_after_s)
    why = "; ".join(f"{e}: {w}" for e, w in why_not)
    return NoEngineAvailable(
        f"no engine available for model `{model}` ({why})", retry_after_s=admission.retry_after_s
    )
