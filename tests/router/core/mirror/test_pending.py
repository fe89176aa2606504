"""Pending prefixes: a routed prompt counts as cached on its replica until its time is up."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.core.ids import EngineId, RequestId
from router.core.mirror.pending import PendingPrefixes, _Tree
from router.core.policy.scoring import Candidate, PolicyName, RouteRequest, Scorer, ScorerSettings
from router.core.policy.trust import TrustStatus
from tests.scoring_helpers import FRESH, STALE, candidate, snapshot

A, B = EngineId("a"), EngineId("b")


R1, R2 = RequestId("r1"), RequestId("r2")


def chain(blocks: list[int]) -> list[int]:
    """Chained keys of these blocks, as the router's are: key i stands for blocks 0..i."""
    return [hash(("chain", *blocks[: i + 1])) for i in range(len(blocks))]


def test_leading_run_of_a_routed_prompt() -> None:
    p = PendingPrefixes(ttl_s=5.0)
    p.add(R1, A, chain([1, 2, 3, 4]), now=0.0)
    assert p.leading_run(A, chain([1, 2, 3, 9]), limit=10, now=1.0) == 3
    assert p.leading_run(A, chain([1, 2, 3, 4, 5]), limit=2, now=1.0) == 2  # capped (prompt length - 1)
    assert p.leading_run(A, chain([9, 1, 2]), limit=10, now=1.0) == 0  # a leading run, not any overlap
    assert p.leading_run(B, chain([1, 2]), limit=10, now=1.0) == 0  # only where it was sent


def test_an_answer_hands_over_to_the_mirror_after_the_grace() -> None:
    p = PendingPrefixes(ttl_s=5.0, grace_s=0.1)
    p.add(R1, A, chain([1, 2]), now=0.0)
    p.add(R2, A, chain([1, 3]), now=0.0)
    p.answered(R1, now=1.0)
    assert p.leading_run(A, chain([1, 2]), limit=10, now=1.05) == 2
    assert p.leading_run(A, chain([1, 2]), limit=10, now=1.1) == 1  # r1 gone; key 1 still pending for r2
    assert p.size == 2
    assert p.leading_run(A, chain([1, 3]), limit=10, now=5.0) == 0  # r2 hit its ttl
    assert p.size == 0


def test_zero_ttl_disables_and_drop_forgets() -> None:
    off = PendingPrefixes(ttl_s=0.0)
    off.add(R1, A, chain([1]), now=0.0)
    assert off.leading_run(A, chain([1]), limit=1, now=0.0) == 0
    p = PendingPrefixes(ttl_s=5.0)
    p.add(R1, A, chain([1, 2]), now=0.0)
    p.add(R2, B, chain([1, 2]), now=0.0)
    p.drop(A)
    assert (p.leading_run(A, chain([1]), limit=1, now=0.0), p.size) == (0, 2)
    with pytest.raises(ValueError):
        PendingPrefixes(ttl_s=-1.0)


def test_bounded_size_and_resend() -> None:
    p = PendingPrefixes(ttl_s=5.0, max_keys=3)
    p.add(R1, A, chain([1, 2]), now=0.0)
    p.add(R2, B, chain([3, 4]), now=0.0)  # would exceed the bound: not recorded
    assert (p.size, p.leading_run(B, chain([3]), limit=1, now=0.0)) == (2, 0)
    p.add(R1, B, chain([5]), now=0.0)  # a retry on another replica replaces the first entry
    assert (
        p.size,
        p.leading_run(A, chain([1]), limit=1, now=0.0),
        p.leading_run(B, chain([5]), limit=1, now=0.0),
    ) == (
        1,
        0,
        1,
    )


LOAD = snapshot(0.01, 1e-4)


def cand(name: str, pending: int = 0, trust: TrustStatus = FRESH, hit: int = 0) -> Candidate:
    return candidate(name, LOAD, hit, trust=trust, pending_tokens=pending)


def test_kv_counts_pending_prefixes_and_predicts_them() -> None:
    scorer = Scorer(ScorerSettings(policy=PolicyName.KV))
    decision = scorer.choose(RouteRequest("r"), [cand("a"), cand("b", pending=800)])
    assert decision.engine == "b" and decision.predicted_cached_tokens == 800
    assert "800 expected from requests just sent" in decision.reason
    (_, b) = decision.candidates
    assert (b.hit_tokens, b.pending_tokens, b.uncached_tokens) == (0, 800, 200)


def test_pending_on_a_stale_replica_is_ignored() -> None:
    scorer = Scorer(ScorerSettings(policy=PolicyName.KV))
    decision = scorer.choose(RouteRequest("r"), [cand("a", hit=100), cand("b", pending=800, trust=STALE)])
    assert decision.engine == "a"
    assert msgspec.json.decode(msgspec.json.encode(decision.candidates[1]))["pending_tokens"] == 800


def test_the_run_is_a_prefix_shared_with_one_request_and_nothing_is_kept_after() -> None:
    p = PendingPrefixes(ttl_s=5.0)
    p.add(R1, A, chain([7, 9, 8]), now=0.0)
    p.add(R2, A, chain([7, 8]), now=0.0)
    p.add(RequestId("r3"), A, chain([7, 8]), now=0.0)  # the same prompt twice: both held
    assert p.leading_run(A, chain([7, 8, 5]), limit=5, now=0.1) == 2
    p.answered(R2, now=0.0)
    assert p.leading_run(A, chain([7, 8]), limit=5, now=0.2) == 2  # r3 still holds it
    p.answered(RequestId("r3"), now=0.0)
    # r1's blocks are 7, 9, 8: it shares only the first with 7, 8.
    assert p.leading_run(A, chain([7, 8]), limit=5, now=0.2) == 1
    p.answered(R1, now=0.0)
    assert (p.leading_run(A, chain([7, 8]), limit=5, now=0.2), p.size, p.holds(A)) == (0, 0, False)
    for i in range(3000):  # many short-lived requests: nothing is kept once they are gone
        p.add(RequestId(f"x{i}"), A, chain([i, i + 1]), now=1.0)
        p.answered(RequestId(f"x{i}"), now=1.0 - p.grace_s)
    p.expire(1.0)
    assert p.size == 0 and not p.holds(A)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=200, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.integers(0, 4), st.sampled_from([A, B]), st.lists(st.integers(0, 3), max_size=6)),
        max_size=30,
    ),
    probes=st.lists(st.lists(st.integers(1, 3), max_size=7), min_size=1, max_size=4),
    limit=st.integers(0, 7),
)
def test_leading_run_is_the_longest_prefix_shared_with_a_live_request(
    ops: list[tuple[int, EngineId, list[int]]], probes: list[list[int]], limit: int
) -> None:
    p = PendingPrefixes(ttl_s=5.0)
    live: dict[RequestId, tuple[EngineId, list[int]]] = {}
    for who, replica, keys in ops:
        request = RequestId(f"r{who}")
        if keys and keys[0] == 0:  # answered: gone once the grace is over
            p.answered(request, now=1.0 - p.grace_s)
            p.expire(1.0)
            live.pop(request, None)
            continue
        p.add(request, replica, chain(keys), now=1.0)
        live.pop(request, None)
        if keys:
            live[request] = (replica, keys)
        for r in (A, B):
            for probe in probes:
                held = [ks for rep, ks in live.values() if rep == r]
                want = max((common_prefix(probe[:limit], ks) for ks in held), default=0)
                assert p.leading_run(r, chain(probe), limit=limit, now=1.0) == want
            assert p.holds(r) == any(rep == r for rep, _ in live.values())
        assert p.size == sum(len(ks) for _, ks in live.values())


@settings(max_examples=300, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(1, 3), min_size=1, max_size=7), max_size=6),
    probe=st.lists(st.integers(1, 3), max_size=8), guess=st.integers(0, 9), limit=st.integers(-1, 9),
)  # fmt: skip
def test_a_run_proven_from_any_guess_is_the_longest_held_prefix(
    prompts: list[list[int]], probe: list[int], guess: int, limit: int
) -> None:
    """Whatever the tree remembers as the last run (right, too short, too long, past the keys), the
    run it answers is the longest prefix of the probe a pending prompt shares, up to the limit."""
    tree = _Tree()
    for blocks in prompts:
        keys = chain(blocks)
        tree.insert(keys, tree.leading_run(keys, len(keys)))
    tree.guess = guess
    want = max((common_prefix(probe[: max(limit, 0)], blocks) for blocks in prompts), default=0)
    assert tree.leading_run(chain(probe), limit) == want


def test_requests_sharing_a_prefix_share_its_run() -> None:
    """A request that extends or shares a pending prefix adds only its own keys to the tree."""
    p = PendingPrefixes(ttl_s=5.0)
    base = list(range(500))
    p.add(R1, A, chain([*base, 1, 2]), now=0.0)
    p.add(R2, A, chain([*base, 3]), now=0.0)  # splits r1's run after the shared 500 keys
    p.add(RequestId("r3"), A, chain(base[:10]), now=0.0)  # ends inside the shared run: splits it again
    tree = p._trees[A]
    assert len(tree.held) == 503 and [len(r.keys) for r in tree.roots.values()] == [10]
    assert p.leading_run(A, chain([*base, 3, 9]), limit=600, now=0.0) == 501
    p.answered(R2, now=0.0)
    p.answered(RequestId("r3"), now=0.0)
    p.expire(1.0)
    assert len(tree.held) == 502 and p.leading_run(A, chain([*base, 1, 2]), limit=600, now=1.0) == 502
    p.answered(R1, now=1.0)
    p.expire(2.0)
    assert not p.holds(A) and p.size == 0


class _AlwaysExpiring(PendingPrefixes):
    """The general path: every call expires afresh (no lower bound of the next due time)."""

    def add(self, request: RequestId, replica: EngineId, keys: list[int], now: float) -> None:  # type: ignore[override]
        self._next_due = -float("inf")
        super().add(request, replica, keys, now)

    def leading_run(self, replica: EngineId, keys: list[int], limit: int, now: float) -> int:  # type: ignore[override]
        self._next_due = -float("inf")
        return super().leading_run(replica, keys, limit, now)


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["add", "answered", "run", "expire"]), st.integers(0, 3), st.sampled_from([A, B]),
            st.lists(st.integers(1, 3), max_size=5), st.sampled_from([0.0, 0.05, 0.1, 0.1, 0.3, 1.0]),
        ),
        max_size=40,
    ),
    ttl=st.sampled_from([0.0, 1e-300, 0.05, 0.1, 0.5]), grace=st.sampled_from([0.0, 0.05, 0.1]),
    forward=st.booleans(),
)  # fmt: skip
def test_expiry_skipped_before_the_next_due_time_changes_nothing(
    ops: list[tuple[str, int, EngineId, list[int], float]], ttl: float, grace: float, forward: bool
) -> None:
    """Asked before anything is due (scoring's candidates share one `now`; a send follows its
    decision by microseconds), with answers and sends due at once in between, a clock moving forward
    or back and forth, and a time to live too small to move the clock, the overlay answers what
    expiring at every call would."""
    fast, general = PendingPrefixes(ttl, grace), _AlwaysExpiring(ttl, grace)
    clock = 1000.0
    for op, who, replica, blocks, step in ops:
        clock = clock + step if forward else 1000.0 + step
        request = RequestId(f"r{who}")
        _step_both(fast, general, op, request, replica, blocks, clock)
        assert fast._entries.keys() == general._entries.keys()


def _step_both(
    a: PendingPrefixes,
    b: PendingPrefixes,
    op: str,
    request: RequestId,
    replica: EngineId,
    blocks: list[int],
    now: float,
) -> None:
    """One step of a property test's script on both overlays, then what they answer compared: the
    leading runs ("run"), their sizes and what each replica holds."""
    for p in (a, b):
        if op == "add":
            p.add(request, replica, chain(blocks), now)
        elif op == "answered":
            p.answered(request, now)
        elif op == "expire":
            p.expire(now)
    if op == "run":
        for r in (A, B):
            assert a.leading_run(r, chain(blocks), 5, now) == b.leading_run(r, chain(blocks), 5, now)
    assert (a.size, a.holds(A), a.holds(B)) == (b.size, b.holds(A), b.holds(B))


class _HeapOnly(PendingPrefixes):
    """Every due time on the heap, as before the in-order queues (those `add` and `answered` queue
    without a call are moved there at once)."""

    def _due(self, queue: deque[tuple[float, RequestId]], until: float, request: RequestId) -> None:
        heapq.heappush(self._heap, (until, request))
        self._next_due = min(self._next_due, until)

    def add(self, request: RequestId, replica: EngineId, keys: Sequence[int], now: float) -> None:
        super().add(request, replica, keys, now)
        self._heap_all()

    def answered(self, request: RequestId, now: float) -> None:
        super().answered(request, now)
        self._heap_all()

    def _heap_all(self) -> None:
        for queue in (self._sent, self._answered):
            while queue:
                heapq.heappush(self._heap, queue.popleft())


@settings(max_examples=300, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["add", "answered", "run", "expire"]), st.integers(0, 4), st.sampled_from([A, B]),
            st.lists(st.integers(1, 3), max_size=5), st.sampled_from([0.0, 0.01, 0.05, 0.1, 0.3]),
        ),
        max_size=60,
    ),
    ttl=st.sampled_from([0.05, 0.1, 0.5]), grace=st.sampled_from([0.0, 0.05, 0.1]), forward=st.booleans(),
)  # fmt: skip
def test_in_order_queues_expire_what_the_heap_did(
    ops: list[tuple[str, int, EngineId, list[int], float]], ttl: float, grace: float, forward: bool
) -> None:
    """With a clock that only moves forward (the gateway's: due times arrive in order) and with one
    that jumps back and forth (out-of-order times go to the heap), the overlay answers, holds and
    counts what it did when every due time went on one heap."""
    queued, heaped = PendingPrefixes(ttl, grace), _HeapOnly(ttl, grace)
    clock = 0.0
    for op, who, replica, blocks, step in ops:
        clock = clock + step if forward else step * 3
        request = RequestId(f"r{who}")
        _step_both(queued, heaped, op, request, replica, blocks, clock)
        assert queued._entries.keys() == heaped._entries.keys()
    if forward:
        assert not queued._heap  # in order: nothing needed the heap
