"""`disagreements`: one line per difference between gateways' digests, none when they agree."""

from __future__ import annotations

from router.core.mirror.digest import ViewDigest
from router.ops.digests import FleetDigests, ReplicaDigests, disagreements

A, B, C = "http://a", "http://b", "http://c"


def replica(seq: int | None = 7, digest: str = "00000000000000aa", trust: str = "fresh") -> ReplicaDigests:
    reason = "ok" if trust == "fresh" else "history_lost"
    return ReplicaDigests(
        engine="e0",
        model="m",
        last_seq=seq,
        trust=trust,
        reason=reason,
        views=[ViewDigest(0, 0, 3, 3, digest)],
    )


def test_agreeing_gateways_give_no_line() -> None:
    same = FleetDigests({"e0": replica()})
    assert disagreements({A: same, B: same, C: same}) == []


def test_each_kind_of_difference_is_named_with_the_gateways() -> None:
    gateways = {
        A: FleetDigests({"e0": replica(), "e1": replica()}),
        B: FleetDigests({"e0": replica(seq=8, digest="00000000000000bb")}),
        C: FleetDigests({"e0": replica(trust="stale"), "e1": replica()}),
    }
    assert disagreements(gateways) == [
        "e0: stale on http://c (history_lost)",
        "e0: last applied seq differs: http://a 7, http://b 8, http://c 7",
        "e0: rank 0 group 0 differs: http://a 00000000000000aa (3 blocks, 3 copies), "
        "http://b 00000000000000bb (3 blocks, 3 copies), http://c 00000000000000aa (3 blocks, 3 copies)",
        "e1: not in the fleet of http://b",
    ]
