"""Choosing an engine: candidates in, a `Decision` value out, which the proxy only carries out.

Policies (`PolicyName`):
- `kv` (default): minimise the predicted TTFT (router.core.policy.ttft_model: prefill of the queue and
  the uncached prompt tokens at the learned cost, the decode part of its chunked steps, the wait for a
  free slot in a full running batch), plus the prefill work the request adds to that engine (its own
  uncached prefill time x `prefill_work_weight` x (1 + the engine's unanswered requests):
  `CandidateScore.work_s`, `work_factor`), which whoever comes there after it waits for; a greedy TTFT
  alone trades a long hit behind a queue for an idle engine's whole prefill. An engine past
  `max_predicted_ttft_s` (its predicted TTFT, or with `saturation_bound` "wait" its predicted wait:
  the TTFT less the request's prefill on an idle engine) or `max_scraped_waiting` is saturated and not
  eligible under any policy. Hits count only from FRESH mirrors (a stale or catching-up engine's hits
  are taken as 0). Candidates within `tie_tolerance_s` x (1 + weight) of the best cost tie, and ties
  break, in order, on: (1) the longer prefix left for the next request sharing this one's head (the
  counted hit, or the warm full-attention prefix of an engine where routing pins a hybrid junction: a
  trusted engine whose warm prefix exceeds its hit), (2) the larger counted hit, (3) fewer in-flight
  requests, (4) fewer blocks in the engine's cache (the mirror's count: a prompt that finds its prefix
  nowhere starts its home where the least is cached, as SGLang's gateway sends a request that matches
  no tree to the smallest), (5) a stable hash of (request key, engine), which spreads ties over
  engines without randomness; in (1) and (2) only a prefix of at least `tie_min_hit_share` of the
  prompt counts, a shorter one breaking the tie after (3) (a head every prompt shares, such as a chat
  template's, must not herd new sessions onto the engine that took the first). The reason names the
  rules that decided.
- `round_robin`, `least_loaded` (in-flight, then queued tokens, then the stable hash), `random`
  (seeded), `session` (agent sessions kept on their engine, hard or soft: router.core.policy.session_rule),
  `prefix_approx` (longest warm full-attention prefix, ignoring trust and hybrid rules; for A/B).
Pure: the scorer's only state is the round-robin counter, the seeded RNG and the session pins.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import operator
import random
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import TYPE_CHECKING, Final, Literal, NamedTuple

import msgspec

from router.core.ids import EngineId
from router.core.policy.load import LoadSnapshot
from router.core.policy.session_rule import SessionMode, SessionRule
from router.core.policy.stored_responses import StoredResponses
from router.core.policy.trust import TrustState, TrustStatus
from router.core.policy.ttft_model import idle_prefill_s, ttft_terms

if TYPE_CHECKING:
    from router.settings.config import RouterConfig

__all__ = [
    "WHY_AT_CAPACITY",
    "WHY_BREAKER_OPEN",
    "WHY_SATURATED",
    "WHY_TRIED",
    "WHY_UNHEALTHY",
    "Candidate",
    "CandidateScore",
    "Decision",
    "PolicyName",
    "RouteRequest",
    "SaturationBound",
    "Scorer",
    "ScorerSettings",
]


class PolicyName(enum.Enum):
    """The routing policies; see the module docstring."""

    KV = "kv"
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    RANDOM = "random"
    SESSION = "session"
    PREFIX_APPROX = "prefix_approx"


SaturationBound = Literal["ttft", "wait"]
"""What `policy.max_predicted_ttft_s` bounds (`ScorerSettings.saturation_bound`)."""


PENDING_READERS: Final = frozenset({PolicyName.KV, PolicyName.SESSION})
"""The policies whose choice reads pending prefixes (router.core.mirror.pending)."""


PROMPT_FREE: Final = frozenset({PolicyName.ROUND_ROBIN, PolicyName.RANDOM})
"""The policies whose choice reads nothing of the prompt (no tokens, keys, hits or pending prefixes)."""


def reads_prompt(policy: str, max_predicted_ttft_s: float) -> bool:
    """Whether routing under `policy` reads the prompt: its choice does, or saturation does (a
    predicted-TTFT limit needs the uncached tokens). Recording needs it too (the gateway's rule)."""
    return PolicyName(policy) not in PROMPT_FREE or max_predicted_ttft_s > 0


def reads_pending(policy: str, max_predicted_ttft_s: float) -> bool:
    """Whether routing under `policy` reads pending prefixes: its choice does, or saturation does (a
    predicted-TTFT limit counts pending tokens as cached). Otherwise the overlay is not kept at all."""
    return PolicyName(policy) in PENDING_READERS or max_predicted_ttft_s > 0


class Candidate(msgspec.Struct, frozen=True):
    """One engine as scoring sees it: the lookup's prediction, its trust and load, its availability."""

    engine: EngineId
    hit_tokens: int
    boundary: int
    warm_tokens: int
    prompt_tokens: int
    trust: TrustStatus
    load: LoadSnapshot
    healthy: bool = True
    breaker_open: bool = False
    at_capacity: bool = False
    pending_tokens: int = 0
    cached_blocks: int = 0
    """Blocks the mirror holds for the engine (`Mirror.blocks`): how much of its cache the prefixes
    already sent there take (kv's tie rule before the hash)."""


class RouteRequest(msgspec.Struct, frozen=True):
    """What scoring needs of the request: a key for stable tie-breaks, the session, engines to avoid,
    the Responses `previous_response_id` it continues."""

    key: str
    session: str | None = None
    excluded: frozenset[EngineId] = frozenset()
    previous_response: str | None = None


class ScorerSettings(msgspec.Struct, frozen=True):
    """Policy choice and weights (mirrors the `[policy]` config table)."""

    policy: PolicyName = PolicyName.KV
    tie_tolerance_s: float = 0.002
    seed: int = 0
    session_capacity: int = 100_000
    max_predicted_ttft_s: float = 0.0
    """An engine whose predicted TTFT (or wait, `saturation_bound`) exceeds this is saturated and not
    chosen (0: no limit)."""
    max_scraped_waiting: int = 0
    """An engine whose scraped `vllm:num_requests_waiting` exceeds this is saturated (0: no limit)."""
    prefill_work_weight: float = 1.0
    """kv: the cost adds this many times the request's own uncached prefill time, once and once per
    request the engine has not answered (`work_s`, `work_factor`)."""
    session_mode: SessionMode = SessionMode.HARD
    session_ttl_s: float = 3600.0
    """A session pin unused this long is forgotten (0: never)."""
    session_margin_s: float = 0.5
    """session, soft: a pinned session moves when kv's choice is predicted this much faster to first token."""
    saturation_bound: SaturationBound = "ttft"
    """What `max_predicted_ttft_s` bounds: the predicted TTFT, or the predicted wait (`wait_s`)."""
    stored_responses_capacity: int = 100_000
    """Responses ids kept with the engine that stored them (router.core.policy.stored_responses)."""
    tie_min_hit_share: float = 0.1
    """kv: a prefix shorter than this share of the prompt neither takes a replica out of the tie band
    (`_band_cost`) nor, in a tie, comes before the load (`_TIE_RULES`)."""

    @classmethod
    def from_config(cls, config: RouterConfig) -> ScorerSettings:
        """The `[policy]` table as scoring settings (the gateway and `kvrouter replay` both use this)."""
        p = config.policy
        return cls(
            policy=PolicyName(p.name),
            tie_tolerance_s=p.tie_tolerance_s,
            seed=p.seed,
            session_capacity=p.session_capacity,
            max_predicted_ttft_s=p.max_predicted_ttft_s,
            max_scraped_waiting=p.max_scraped_waiting,
            prefill_work_weight=p.prefill_work_weight,
            session_mode=SessionMode(p.session_mode),
            session_ttl_s=p.session_ttl_s,
            session_margin_s=p.session_margin_s,
            saturation_bound=p.saturation_bound,
            stored_responses_capacity=p.stored_responses_capacity,
            tie_min_hit_share=p.tie_min_hit_share,
        )


class CandidateScore(msgspec.Struct, frozen=True):
    """One candidate as the decision saw it (every field is recorded for /debug/decisions)."""

    engine: EngineId
    hit_tokens: int
    trusted_hit_tokens: int
    boundary: int
    warm_tokens: int
    pins_junction: bool
    uncached_tokens: int
    predicted_ttft_s: float
    trust: TrustStatus
    load: LoadSnapshot
    eligible: bool
    why_not: str = ""
    pending_tokens: int = 0
    counted_tokens: int = 0
    prefill_steps: int = 0
    decode_s: float = 0.0
    slot_wait_s: float = 0.0
    work_s: float = 0.0
    """The prefill work this request adds to the engine, weighted (`work_factor`)."""
    cost_s: float = 0.0
    """What kv minimises: `predicted_ttft_s + work_s`."""
    wait_s: float = 0.0
    """`predicted_ttft_s` less the request's prefill on an idle engine (`ttft_model.idle_prefill_s`):
    the wait this engine's load adds (its queue left, the decode part of the steps, a slot)."""
    bounded_s: float = 0.0
    """What the saturation bound compared: `predicted_ttft_s`, or `wait_s` (`saturation_bound`)."""
    cached_blocks: int = 0
    """`Candidate.cached_blocks`: the blocks the mirror held for the engine at the decision."""

    @property
    def expected_tokens(self) -> int:
        """What the engine should report cached: the mirror's hit, or a longer pending prefix.

        Trust does not enter: an untrusted mirror's hit is still the router's best estimate of the
        engine's cache (after a reset or a lost batch the mirror holds a subset of it), while
        `counted_tokens` is what scoring dared to count."""
        return max(self.hit_tokens, self.pending_tokens)


class Decision(msgspec.Struct, frozen=True):
    """The chosen engine (None when none is eligible), every candidate's score, the policy, the reason.

    For the chosen candidate: `predicted_cached_tokens` is what its engine is expected to report as
    `usage.prompt_tokens_details.cached_tokens` (`CandidateScore.expected_tokens`: the mirror's hit,
    or the leading run of prefixes just routed there when that is longer, trusted or not);
    `mirror_hit_tokens` is the mirror's raw hit; `counted_cached_tokens` is what scoring counted
    (0 from a mirror that is not fresh, unless a pending prefix counts).
    """

    engine: EngineId | None
    policy: PolicyName
    reason: str
    predicted_cached_tokens: int
    candidates: list[CandidateScore]
    mirror_hit_tokens: int = 0
    counted_cached_tokens: int = 0
    runner_up: EngineId | None = None
    """The eligible candidate with the lowest kv cost besides the chosen one (None: it was alone)."""
    margin_s: float = 0.0
    """The runner-up's kv cost minus the chosen one's (negative: kv's cost preferred the runner-up)."""

    def candidate(self, engine: EngineId | str | None) -> CandidateScore | None:
        """`engine`'s candidate in the decision (None when it was not scored)."""
        for c in self.candidates:
            if c.engine == engine:
                return c
        return None

    def chosen(self) -> CandidateScore | None:
        """The chosen engine's candidate (None when nothing was chosen)."""
        return self.candidate(self.engine)


@functools.lru_cache(maxsize=4096)  # (a session's requests share their key: its ties hash the same pairs)
def stable_hash(key: str, engine: EngineId) -> int:
    """A process-independent 64-bit hash of (request key, engine): the last tie-break."""
    digest = hashlib.blake2b(f"{key}\0{engine}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


WHY_TRIED: Final = "already tried for this request"
WHY_UNHEALTHY: Final = "unhealthy"
WHY_BREAKER_OPEN: Final = "circuit breaker open"
WHY_AT_CAPACITY: Final = "at its in-flight limit"
WHY_SATURATED: Final = "saturated"
"""`CandidateScore.why_not` values (router.core.policy.refusal reads them to name the limit that refused)."""


def _why_not(c: Candidate, excluded: frozenset[EngineId]) -> str:
    if c.engine in excluded:
        return WHY_TRIED
    if not c.healthy:
        return WHY_UNHEALTHY
    if c.breaker_open:
        return WHY_BREAKER_OPEN
    return WHY_AT_CAPACITY if c.at_capacity else ""


def _saturated(load: LoadSnapshot, bounded_s: float, settings: ScorerSettings) -> bool:
    """Past a configured limit, a request sent there would wait in the engine's queue rather than in
    ours (`bounded_s`: the predicted TTFT or wait, `CandidateScore.bounded_s`)."""
    if settings.max_predicted_ttft_s > 0 and bounded_s > settings.max_predicted_ttft_s:
        return True
    waiting = load.scrape.num_requests_waiting if load.scrape is not None else 0
    return settings.max_scraped_waiting > 0 and waiting > settings.max_scraped_waiting


def _score(c: Candidate, excluded: frozenset[EngineId], settings: ScorerSettings) -> CandidateScore:
    state = c.trust.state
    trusted = state is TrustState.FRESH  # TrustStatus.trusted
    trusted_hit = c.hit_tokens if trusted else 0
    # A prefix the router itself just sent there is known without the mirror, unless the engine's
    # state is in doubt altogether (stale: restarted, history lost, silent).
    pending = c.pending_tokens if state is not TrustState.STALE else 0
    counted = max(trusted_hit, pending)
    uncached = max(0, c.prompt_tokens - counted)
    load = c.load
    steps, decode_s, slot_s, ttft = ttft_terms(load, uncached)
    work = work_factor(settings, load) * load.per_token_s * uncached
    wait = ttft - idle_prefill_s(load, uncached)
    bounded = wait if settings.saturation_bound == "wait" else ttft
    pins = trusted and c.warm_tokens > c.hit_tokens
    why_not = _why_not(c, excluded)
    if not why_not and (settings.max_predicted_ttft_s > 0 or settings.max_scraped_waiting > 0):
        why_not = WHY_SATURATED if _saturated(load, bounded, settings) else ""  # (no limit: never)
    # By position, one field a line in the class's order (each named): by keyword, CPython 3.11
    # first builds a dict of the 21 keywords (a call past 30 argument slots), +10.5k instructions
    # a candidate, ~1% of a chat request per engine (callgrind, issue #30 session 21).
    return CandidateScore(
        c.engine,  # engine
        c.hit_tokens,  # hit_tokens
        trusted_hit,  # trusted_hit_tokens
        c.boundary,  # boundary
        c.warm_tokens,  # warm_tokens
        pins,  # pins_junction
        uncached,  # uncached_tokens
        ttft,  # predicted_ttft_s
        c.trust,  # trust
        c.load,  # load
        not why_not,  # eligible
        why_not,  # why_not
        c.pending_tokens,  # pending_tokens
        counted,  # counted_tokens
        steps,  # prefill_steps
        decode_s,  # decode_s
        slot_s,  # slot_wait_s
        work,  # work_s
        ttft + work,  # cost_s
        wait,  # wait_s
        bounded,  # bounded_s
        c.cached_blocks,  # cached_blocks
    )


Pick = tuple[CandidateScore, str]
_ENGINE: Final = operator.attrgetter("engine")
_ELIGIBLE: Final = operator.attrgetter("eligible")
_COST: Final = operator.attrgetter("cost_s")


class Scorer:
    """Applies the configured policy to a request's candidates and returns a `Decision`."""

    def __init__(self, settings: ScorerSettings) -> None:
        self.settings = settings
        self._turn = 0
        self._rng = random.Random(settings.seed)
        self.sessions = SessionRule(
            settings.session_mode,
            settings.session_capacity,
            settings.session_ttl_s,
            settings.session_margin_s,
        )
        self.stored = StoredResponses(settings.stored_responses_capacity)
        self._now = 0.0  # the time of the decision being made (`choose`): session pins read it
        self._policies: dict[PolicyName, Callable[[RouteRequest, list[CandidateScore]], Pick]] = {
            PolicyName.KV: self._kv,
            PolicyName.ROUND_ROBIN: self._round_robin,
            PolicyName.LEAST_LOADED: self._least_loaded,
            PolicyName.RANDOM: self._random,
            PolicyName.SESSION: self._session,
            PolicyName.PREFIX_APPROX: self._prefix_approx,
        }
        self._policy = self._policies[settings.policy]  # (an enum's hash is a Python call per lookup)

    def choose(self, request: RouteRequest, candidates: Sequence[Candidate], now: float = 0.0) -> Decision:
        """Score every candidate and pick one with the configured policy (deterministic given the seed);
        `now` (the fleet's clock) ages session pins."""
        policy = self.settings.policy
        self._now = now
        # (`map` and `filter` rather than comprehensions: no Python frame of their own)
        scores = list(map(_score, candidates, repeat(request.excluded), repeat(self.settings)))
        if len(scores) > 1:  # (one engine's list is sorted: no key list, no call)
            scores.sort(key=_ENGINE)
        eligible = list(filter(_ELIGIBLE, scores))
        if not eligible:
            why = "; ".join(f"{s.engine}: {s.why_not}" for s in scores) or "no engines configured"
            return Decision(
                engine=None,
                policy=policy,
                reason=f"no eligible engine ({why})",
                predicted_cached_tokens=0,
                candidates=scores,
            )
        chosen, reason = self._stored(request, eligible) or self._policy(request, eligible)
        others = [s for s in eligible if s is not chosen]
        runner = min(others, key=_COST) if others else None
        return Decision(
            engine=chosen.engine,
            policy=policy,
            reason=reason,
            predicted_cached_tokens=chosen.expected_tokens,
            candidates=scores,
            mirror_hit_tokens=chosen.hit_tokens,
            counted_cached_tokens=chosen.counted_tokens,
            runner_up=runner.engine if runner else None,
            margin_s=runner.cost_s - chosen.cost_s if runner else 0.0,
        )

    def forget_engine(self, engine: EngineId) -> None:
        """Drop session pins to, and stored responses of, an engine that left the fleet."""
        self.sessions.pins.forget_engine(engine)
        self.stored.forget_engine(engine)

    def _stored(self, request: RouteRequest, eligible: list[CandidateScore]) -> Pick | None:
        """A continuation of a stored response goes to the engine that stored it, whatever the policy
        (no other can answer it); None when the id is unknown (routed normally: the engine answers its
        404) or that engine is not eligible (routed normally, the policy's reason saying so)."""
        if request.previous_response is None:
            return None
        rid = request.previous_response
        engine = self.stored.engine_of(rid)
        if engine is None:
            return None
        for s in eligible:
            if s.engine == engine:
                return s, f"stored response {rid} on {engine}"
        chosen, reason = self._policy(request, eligible)
        return chosen, f"{reason}; stored response {rid} on {engine}, which is not eligible"

    def _kv(self, request: RouteRequest, eligible: list[CandidateScore]) -> Pick:
        best = min(eligible, key=_COST)
        tol = self.settings.tie_tolerance_s
        # The cost counts a prefill difference 1 + weight times on an engine with no queue
        # (`work_factor`); so does the tolerance, which keeps "TTFTs within tie_tolerance_s tie" true
        # of such candidates that differ only in their hit (behind a queue a hit weighs more: the
        # queue is the point).
        cost_tol = tol * (1.0 + self.settings.prefill_work_weight)
        tie = _Tie(request.key, self.settings.tie_min_hit_share * _prompt(best))
        band = [_band_cost(s, tie, self.settings) for s in eligible]
        floor = min(band)
        tied = [s for s, b in zip(eligible, band, strict=True) if b <= floor + cost_tol]
        others: str
        if len(tied) == 1:  # (what `_break_tie` answers for one: no rule narrows)
            chosen = tied[0]
            if chosen.cost_s == best.cost_s:
                return chosen, _kv_words(chosen, True)
            short = (
                f"{best.engine}'s lower cost is a hit under {self.settings.tie_min_hit_share:g} of the prompt"
            )
            return chosen, f"{_kv_words(chosen, False)}; {short}, not counted against the load"
        chosen, rules = _break_tie(tie, tied)
        others = ", ".join(s.engine for s in tied if s is not chosen)
        why = _kv_words(chosen, chosen.cost_s == best.cost_s)
        return (
            chosen,
            f"{why}; tied with {others} within {tol * 1000:g} ms; decided by {', then '.join(rules)}",
        )

    def _round_robin(self, request: RouteRequest, eligible: list[CandidateScore]) -> Pick:
        chosen = eligible[self._turn % len(eligible)]
        self._turn += 1
        return chosen, f"round_robin: turn {self._turn - 1} of {len(eligible)} eligible"

    def _least_loaded(self, request: RouteRequest, eligible: list[CandidateScore]) -> Pick:
        chosen = min(eligible, key=lambda s: _load_key(request, s))
        return (
            chosen,
            f"least_loaded: {chosen.load.in_flight} in flight, {chosen.load.queued_prefill_tokens} queued",
        )

    def _random(self, request: RouteRequest, eligible: list[CandidateScore]) -> Pick:
        return self._rng.choice(eligible), f"random: seeded choice among {len(eligible)} eligible"

    def _prefix_approx(self, request: RouteRequest, eligible: list[CandidateScore]) -> Pick:
        chosen = min(eligible, key=lambda s: (-s.warm_tokens, *_load_key(request, s)))
        return chosen, f"prefix_approx: longest warm prefix {chosen.warm_tokens} tokens (trust ignored)"

    def _session(self, request: RouteRequest, eligible: list[CandidateScore]) -> Pick:
        return self.sessions.pick(request.session, eligible, lambda: self._kv(request, eligible), self._now)


def work_factor(settings: ScorerSettings, load: LoadSnapshot) -> float:
    """How many times kv's cost counts a candidate's own prefill time besides its TTFT (`work_s`):
    `prefill_work_weight x (1 + unanswered)`, `unanswered` the requests sent there and not yet
    answered (`in_flight - decoding`: its queue, the scraped waiting included).

    The prefill runs before whoever comes to the engine after it, and a queue says more are coming
    there (the arrivals it is made of, its sessions' next turns to their prefixes): each unanswered
    request counts the work once more; on an idle engine it counts once, as before (session 21's
    rule, which counted it once whatever the load). Counted once, a cold engine's system prompt
    outweighed a warm engine's queue: on the decode-heavy simulation kv sent the first turns of 50
    sessions to the 2 of 4 engines holding the system prompts (17 in flight on one while two sat
    idle), then moved a third of the later turns off them (48-57 of 150; prefix_approx none): TTFT
    p50 45 / 43 / 75 ms on seeds 0-2 against prefix_approx's 30 / 37 / 33 and round robin's 41 / 50
    / 39. Counted per unanswered request: 37 / 41 / 34 ms, p90 90 / 266 / 257 (138 / 342 / 261
    before), the agent sessions at an offered 3.44 answered 63% within the SLO (38% before), at 1.19
    all (p90 93 ms, 119 before). Tried and not kept: per request held, decoding included, at weight
    0.5 (p50 32 / 37 / 34, but at 1.19 only 90% within the SLO, p90 197 ms); per decoding sequence
    (seed 2's p90 329-1,460 ms)."""
    return settings.prefill_work_weight * (1 + max(0, load.in_flight - load.decoding))


def _band_cost(s: CandidateScore, tie: _Tie, settings: ScorerSettings) -> float:
    """The cost that puts `s` in kv's tie band or not: its `cost_s` with the saving of a hit shorter
    than `tie.least_prefix` (under `tie_min_hit_share` of the prompt: what `_most` does not count)
    added back.

    Why: such a hit (a chat template's header every conversation starts with, one block of an
    agent's thousands of tokens) is worth a few ms of prefill at the learned per-token cost, which
    early in a run is the prior's, ~3x an engine's; counted in both the TTFT and the prefill work,
    it carried every new session to the replica that took the first conversation, whose later turns
    then followed (BENCHMARKS.md "Load test: kv against round robin on each API", history s18-herd).
    A short hit still decides inside the band, after the in-flight count (`_TIE_RULES`)."""
    short = s.counted_tokens - _most(s.counted_tokens, tie)
    return s.cost_s + (1.0 + work_factor(settings, s.load)) * s.load.per_token_s * short


def _kv_words(chosen: CandidateScore, lowest: bool) -> str:
    """kv's reason for `chosen` (`lowest`: its cost is the least), before any tie's words."""
    ttft = "lowest predicted TTFT" if lowest else "predicted TTFT"
    pending, cached = chosen.pending_tokens, chosen.trusted_hit_tokens
    expected = f", {pending} expected from requests just sent" if pending > cached else ""
    return (
        f"kv: {ttft} {chosen.predicted_ttft_s * 1000:.1f} ms "
        f"+ {chosen.work_s * 1000:.1f} ms prefill work "
        f"({cached} cached{expected}, "
        f"{chosen.uncached_tokens} to prefill, {chosen.load.queued_prefill_tokens} queued, "
        f"{chosen.load.decoding} decoding)"
    )


def _load_key(request: RouteRequest, s: CandidateScore) -> tuple[int, int, int]:
    return s.load.in_flight, s.load.queued_prefill_tokens, stable_hash(request.key, s.engine)


def _reusable_tokens(s: CandidateScore) -> int:
    """The prefix this engine will serve the next request sharing this one's head, if it takes this one."""
    return s.warm_tokens if s.pins_junction else s.counted_tokens


def _prompt(s: CandidateScore) -> int:
    """The request's prompt tokens (every candidate's `counted_tokens + uncached_tokens`)."""
    return s.counted_tokens + s.uncached_tokens


class _Tie(NamedTuple):
    """What the tie rules read besides a candidate: the request's key (for the hash) and the shortest
    prefix that counts before the load (`ScorerSettings.tie_min_hit_share` of the prompt, in tokens)."""

    key: str
    least_prefix: float


def _most(tokens: int, tie: _Tie) -> int:
    """`tokens` if they are at least `tie.least_prefix` (not a short head), else 0: rules 1 and 2."""
    return tokens if tokens >= tie.least_prefix else 0


def _hit_words(s: CandidateScore) -> str:
    return f"the larger cached prefix ({s.counted_tokens} tokens)"


def _reusable_words(s: CandidateScore) -> str:
    if s.pins_junction:
        return f"pinning the hybrid junction at {s.warm_tokens} tokens"
    return f"the larger cached prefix ({s.counted_tokens} tokens)"


# Tie-break rules in order: (key, words); each keeps the tied candidates with the least key, and
# its words (said of the candidate finally chosen) go into the reason when it narrowed the tie.
# A prefix of at least `tie_min_hit_share` of the prompt goes before the load and the hash: the
# request's own context lives there (its session's previous turn, its app's or chat's system
# prompt), where it adds the fewest duplicate blocks and, next turn, finds the most, while the costs
# say both are as fast. A shorter prefix comes
# after the load (rules 4 and 5): a head every prompt shares (a chat template's role markers, a tool
# list's preamble: ~75 tokens of an agent's thousands) is on whichever engine took the first
# conversation, and before the load it sent every new session there, each session's later turns
# following (tests/router/core/policy/test_shared_header_sim.py: 12 agent sessions on one of two
# engines); on equal loads it still decides (a chat's second turn). The share is counted in tokens,
# not in the learned cost: where that cost collapses under overload and nearly everything ties, a
# session's own prefix still keeps it with its cache (load first throughout cut goodput at an
# offered 1.2 from 100% to 65%).
# The hybrid junction pin and the hit are weighed in one unit, the prefix left for the next request
# sharing this one's head: routing to an engine that pins stores the sparse groups' state at the
# junction, turning its warm full-attention prefix into a hit for that next request; any other engine
# offers its hit. Neither strictly first is right: pin-first would leave a 512-token hit for an
# engine pinning 20 warm tokens, hit-first would pass over a 768-token pin for a 16-token hit. Rules
# 2 and 5 then prefer this request's own saving when the prefixes left are equal.
# Before the hash, fewer cached blocks: a new prefix (an app's first session, a new conversation)
# ties on every idle engine, and its home decides where its later requests go; the hash put a new app
# beside another while engines held nothing (the routing bench's agents cell, decision records),
# where the count spreads homes over the engines by how much each already holds (virtual time: the
# decode-heavy workload's seed 2 p90 253 -> 210 ms; BENCHMARKS.md, "Routing bench").
_TieRule = tuple[Callable[[_Tie, CandidateScore], int], Callable[[CandidateScore], str]]
_TIE_RULES: Final[tuple[_TieRule, ...]] = (
    (lambda tie, s: -_most(_reusable_tokens(s), tie), _reusable_words),
    (lambda tie, s: -_most(s.counted_tokens, tie), _hit_words),
    (lambda tie, s: s.load.in_flight, lambda s: f"fewer in-flight requests ({s.load.in_flight})"),
    (lambda tie, s: -_reusable_tokens(s), _reusable_words),
    (lambda tie, s: -s.counted_tokens, _hit_words),
    (lambda tie, s: s.cached_blocks, lambda s: f"fewer cached blocks ({s.cached_blocks})"),
    (lambda tie, s: stable_hash(tie.key, s.engine), lambda s: "the stable hash of (request, engine)"),
)


def _break_tie(tie: _Tie, tied: list[CandidateScore]) -> tuple[CandidateScore, list[str]]:
    """Apply `_TIE_RULES` until one candidate is left; returns it and the words of each rule that narrowed."""
    left, narrowed = tied, []
    for rule, words in _TIE_RULES:
        if len(left) == 1:
            break
        values = [rule(tie, s) for s in left]  # once each (the last rule hashes)
        least = min(values)
        kept = [s for s, value in zip(left, values, strict=True) if value == least]
        if len(kept) < len(left):
            narrowed.append(words)
        left = kept
    chosen = left[0]
    said: list[str] = []
    for words in narrowed:
        if (text := words(chosen)) not in said:
            said.append(text)
    return chosen, said
