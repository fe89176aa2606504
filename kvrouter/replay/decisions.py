"""Recorded decisions made again on the rebuilt mirror, under the recorded policy or another one (pure).

`Replayer.feed` takes a recording's records in file order. Frames rebuild the mirror; a request is
prepared again from its recorded body (`Models.prepare`: tokens, keys per variant, session key); a
decision is recomputed: hits, boundaries and warm tokens come from `router.core.lookup.computed_blocks` on
the rebuilt mirror, while trust, load, breaker and admission state (inputs the mirror cannot know) come from
the recorded candidates. A fresh `Scorer`, fed every decision in order, chooses: with the recorded
settings its round-robin turn, seeded RNG and session table evolve exactly as the gateway's did.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Final

import msgspec

from events.recording import DecisionRecord, FrameRecord, Record, RequestRecord
from kvrouter.replay.rebuild import Rebuild, ReplicaReplay
from kvrouter.replay.setup import Setup
from router.core.ids import EngineId, RequestId
from router.core.lookup.computed_blocks import LookupRequest, LookupResult, ReplicaId, lookup
from router.core.mirror.full_reports import PendingReport
from router.core.mirror.shared_index import Mirror
from router.core.policy.load import LoadSnapshot
from router.core.policy.scoring import (
    Candidate,
    CandidateScore,
    Decision,
    RouteRequest,
    Scorer,
    ScorerSettings,
)
from router.core.policy.trust import TrustReason, TrustState, TrustStatus
from router.prepare.served_models import Prepared
from tokenization.openai_request import Endpoint, RequestError

__all__ = ["DecisionReplay", "Replayer", "candidates_now", "predict", "recorded_candidates"]

_NO_HIT: Final = LookupResult(0, 0, (), 0)
_DECISION = msgspec.msgpack.Decoder(Decision)
_KEPT_REQUESTS: Final = 4096  # prepared requests kept for their retries (retries follow within seconds)


class DecisionReplay(msgspec.Struct, frozen=True):
    """One recorded decision and its replay (`replayed` None: the request could not be prepared)."""

    index: int
    time: float
    request_id: str
    attempt: int
    recorded: Decision
    replayed: Decision | None
    error: str = ""

    @property
    def exact(self) -> bool:
        """The replay reproduced the recorded decision field for field."""
        return self.replayed == self.recorded

    @property
    def hits_match(self) -> bool:
        """Every candidate's hit, boundary and warm tokens on the rebuilt mirror equal the recorded ones."""
        if self.replayed is None:
            return False
        return [_hits(c) for c in self.recorded.candidates] == [_hits(c) for c in self.replayed.candidates]


def _hits(c: CandidateScore) -> tuple[str, int, int, int]:
    return c.engine, c.hit_tokens, c.boundary, c.warm_tokens


class _Request(msgspec.Struct):
    prepared: Prepared
    session: str | None


def predict(
    rebuild: Rebuild, prepared: Prepared, engines: Sequence[EngineId]
) -> dict[EngineId, tuple[LookupResult, int]]:
    """Per replica: the lookup result on the rebuilt mirror and the prompt length under its variant
    (as `router.core.routing.RoutingCore.predict`; a replica the config does not name gets no hit)."""
    by_variant: dict[str, list[EngineId]] = {}
    out: dict[EngineId, tuple[LookupResult, int]] = {}
    for rid in engines:
        info = rebuild.setup.replicas.get(rid)
        if info is None:
            out[rid] = (_NO_HIT, prepared.prompt_tokens)
        else:
            by_variant.setdefault(info.variant.id, []).append(rid)
    for vid, rids in by_variant.items():
        keys = prepared.keys_for(vid)
        if keys is None:
            out.update((rid, (_NO_HIT, prepared.prompt_tokens)) for rid in rids)
            continue
        spec = rebuild.setup.replicas[rids[0]].variant.spec
        results = lookup(
            rebuild.mirror, spec, LookupRequest(keys.keys, keys.num_tokens, prepared.skip_cache), rids
        )
        out.update((rid, (results[ReplicaId(rid, 0)], keys.num_tokens)) for rid in rids)
    return out


def recorded_candidates(
    recorded: Decision, predicted: dict[EngineId, tuple[LookupResult, int]], mirror: Mirror
) -> tuple[list[Candidate], frozenset[EngineId]]:
    """The recorded decision's candidates with hits and cached blocks recomputed on the rebuilt
    `mirror`, and the engines it excluded (retries).

    Breaker, admission and health state come back from each candidate's recorded `why_not`."""
    candidates, excluded = [], set()
    for c in recorded.candidates:
        result, n = predicted[c.engine]
        if c.why_not == "already tried for this request":
            excluded.add(c.engine)
        candidates.append(
            Candidate(
                engine=c.engine,
                hit_tokens=result.hit_tokens,
                boundary=result.shared_prefix_boundary,
                warm_tokens=result.fa_warm_tokens,
                prompt_tokens=n,
                healthy=c.why_not != "unhealthy",
                breaker_open=c.why_not == "circuit breaker open",
                at_capacity=c.why_not == "at its in-flight limit",
                cached_blocks=mirror.blocks(c.engine),
                **_recorded_inputs(c),
            )
        )
    return candidates, frozenset(excluded)


_RECOMPUTED: Final = frozenset(
    {"engine", "hit_tokens", "boundary", "warm_tokens", "prompt_tokens", "cached_blocks"}
)


def _recorded_inputs(c: CandidateScore) -> dict[str, Any]:
    """Every input a candidate shares with its recorded score (trust, load, and any added later)."""
    shared = set(Candidate.__struct_fields__) & set(CandidateScore.__struct_fields__)
    return {name: getattr(c, name) for name in shared - _RECOMPUTED}


def candidates_now(rebuild: Rebuild, prepared: Prepared, idle: LoadSnapshot) -> list[Candidate]:
    """Candidates for a new request at the rebuild's current point: every replica of its model, with
    the trust and load the gateway last recorded for it (else inferred from the link, and `idle`)."""
    engines = rebuild.setup.serving(prepared.model)
    predicted = predict(rebuild, prepared, engines)
    return [
        Candidate(
            engine=rid,
            hit_tokens=result.hit_tokens,
            boundary=result.shared_prefix_boundary,
            warm_tokens=result.fa_warm_tokens,
            prompt_tokens=n,
            trust=_trust(rebuild.replicas[rid]),
            load=rebuild.replicas[rid].load or idle,
            cached_blocks=rebuild.mirror.blocks(rid),
        )
        for rid, (result, n) in predicted.items()
    ]


def _trust(rep: ReplicaReplay) -> TrustStatus:
    if rep.trust is not None:
        return rep.trust
    if rep.history_lost or rep.link.tracker.stats.stale:
        return TrustStatus(TrustState.STALE, TrustReason.HISTORY_LOST, "inferred from the recording", 0.0)
    if rep.link.replaying:
        return TrustStatus(
            TrustState.CATCHING_UP, TrustReason.REPLAY_IN_FLIGHT, "inferred from the recording", 0.0
        )
    return TrustStatus(TrustState.FRESH, TrustReason.OK, "inferred from the recording (no decision yet)", 0.0)


class Replayer:
    """Rebuild plus requests plus a scorer: feed records in order, get a `DecisionReplay` per decision."""

    def __init__(self, setup: Setup, settings: ScorerSettings | None = None) -> None:
        self.setup = setup
        self.rebuild = Rebuild(setup)
        self.scorer = Scorer(settings or setup.settings)
        self.requests: OrderedDict[str, _Request | str] = OrderedDict()
        self.index = -1

    def feed(self, record: Record) -> DecisionReplay | None:
        """Apply one record; a decision record comes back replayed."""
        self.index += 1
        if isinstance(record, FrameRecord):
            self.rebuild.frame(record)
        elif isinstance(record, RequestRecord):
            self._request(record)
        elif isinstance(record, DecisionRecord):
            return self._decision(record)
        return None

    def prepare(self, body: bytes, endpoint: str) -> Prepared:
        """`Models.prepare` with the gateway's models; RequestError on a body the gateway would refuse."""
        return self.setup.models.prepare(body, Endpoint(endpoint))

    def _request(self, record: RequestRecord) -> None:
        self.rebuild.time = record.time
        headers = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in record.headers]
        session = self.setup.session_keys.of(headers, record.body)
        try:
            entry: _Request | str = _Request(self.prepare(record.body, record.endpoint), session)
        except (RequestError, ValueError, OSError) as exc:
            entry = f"cannot prepare the recorded request: {exc}"
        self.requests[record.request_id] = entry
        while len(self.requests) > _KEPT_REQUESTS:
            self.requests.popitem(last=False)

    def _decision(self, record: DecisionRecord) -> DecisionReplay:
        recorded = _DECISION.decode(record.decision)
        request = self.requests.get(record.request_id, "no recorded request with this id")
        replayed = None
        if isinstance(request, _Request):
            replayed = self.decide(request.prepared, request.session, recorded)
            self._sent(record.request_id, request.prepared, recorded)
        self.rebuild.decision(recorded, record.time)
        error = request if isinstance(request, str) else ""
        return DecisionReplay(
            index=self.index,
            time=record.time,
            request_id=record.request_id,
            attempt=record.attempt,
            recorded=recorded,
            replayed=replayed,
            error=error,
        )

    def decide(self, prepared: Prepared, session: str | None, recorded: Decision) -> Decision:
        """The recorded decision recomputed on the current mirror with this replayer's scorer."""
        predicted = predict(self.rebuild, prepared, [c.engine for c in recorded.candidates])
        candidates, excluded = recorded_candidates(recorded, predicted, self.rebuild.mirror)
        route = RouteRequest(key=prepared.session_key, session=session, excluded=excluded)
        return self.scorer.choose(route, candidates, self.rebuild.time or 0.0)

    def _sent(self, request_id: str, prepared: Prepared, recorded: Decision) -> None:
        # Mirrors FleetState.request_sent for full report mode, on the engine the gateway really chose.
        if recorded.engine is None or prepared.report_mode != "full":
            return
        info = self.setup.replicas.get(recorded.engine)
        keys = prepared.keys_for(info.variant.id) if info is not None else None
        if keys is not None:
            self.rebuild.sent(
                recorded.engine, RequestId(request_id), PendingReport(keys.keys, keys.num_tokens)
            )
