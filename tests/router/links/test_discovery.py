"""DNS discovery: addresses become engines; real resolution of localhost; changes and failures."""

from __future__ import annotations

from router.links.discovery import DnsDiscovery, engines_for
from router.settings.config import Discovery, EngineConfig


def test_each_address_becomes_an_engine() -> None:
    d = Discovery(dns_name="vllm.svc", port=8000, events_port=5557, replay_port=5558, model="m")
    engines = engines_for(d, ["10.0.0.2", "10.0.0.1", "10.0.0.2"])
    assert list(engines) == ["vllm.svc/10.0.0.1", "vllm.svc/10.0.0.2"]
    e = engines["vllm.svc/10.0.0.1"]
    assert (e.url, e.events, e.replay, e.model) == (
        "http://10.0.0.1:8000",
        ["tcp://10.0.0.1:5557"],
        ["tcp://10.0.0.1:5558"],
        "m",
    )


def test_no_event_port_means_no_event_endpoints() -> None:
    e = engines_for(Discovery(dns_name="x", events_port=None, replay_port=5558), ["10.1.1.1"])["x/10.1.1.1"]
    assert (e.events, e.replay) == ([], [])


async def test_resolves_a_real_name_and_reports_changes() -> None:
    changes: list[tuple[set[str], set[str]]] = []

    async def on_change(added: dict[str, EngineConfig], removed: set[str]) -> None:
        changes.append((set(added), removed))

    disco = DnsDiscovery(Discovery(dns_name="localhost", port=9000), on_change)
    await disco.refresh()
    assert changes == [({"localhost/127.0.0.1"}, set())]
    await disco.refresh()  # same answer: no change reported
    assert len(changes) == 1
    disco.discovery = Discovery(dns_name="kvrouter-test.invalid", port=9000)
    await disco.refresh()  # NXDOMAIN: counted, nothing dropped
    assert disco.failures == 1 and set(disco.known) == {"localhost/127.0.0.1"}
    assert len(changes) == 1


async def test_an_address_that_disappears_is_removed() -> None:
    changes: list[tuple[set[str], set[str]]] = []

    async def on_change(added: dict[str, EngineConfig], removed: set[str]) -> None:
        changes.append((set(added), removed))

    d = Discovery(dns_name="localhost", port=9000)
    disco = DnsDiscovery(d, on_change)
    disco.known = engines_for(d, ["127.0.0.1", "127.0.0.9"])
    await disco.refresh()
    assert changes == [(set(), {"localhost/127.0.0.9"})]
