"""Engines discovered from DNS: every A record of a name (e.g. a Kubernetes headless service).

`engines_for(discovery, addresses)` turns resolved addresses into engine configs (pure);
`DnsDiscovery` re-resolves the name every `period_s` and reports additions and removals. A failed
resolution changes nothing (an engine is not dropped because DNS blinked); an empty answer removes
every discovered engine, as the service then has no endpoints.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable

from router.settings.config import Discovery, EngineConfig

__all__ = ["DnsDiscovery", "engines_for"]

log = logging.getLogger(__name__)


def engines_for(discovery: Discovery, addresses: Iterable[str]) -> dict[str, EngineConfig]:
    """One engine per address, named `<dns_name>/<address>`, on the configured ports."""
    out: dict[str, EngineConfig] = {}
    for ip in sorted(set(addresses)):
        host = f"[{ip}]" if ":" in ip else ip
        events = [f"tcp://{host}:{discovery.events_port}"] if discovery.events_port else []
        replay = [f"tcp://{host}:{discovery.replay_port}"] if discovery.replay_port and events else []
        name = f"{discovery.dns_name}/{ip}"
        out[name] = EngineConfig(
            name=name,
            url=f"http://{host}:{discovery.port}",
            model=discovery.model,
            events=events,
            replay=replay,
        )
    return out


OnChange = Callable[[dict[str, EngineConfig], set[str]], Awaitable[None]]


class DnsDiscovery:
    """Re-resolves `discovery.dns_name` periodically and calls `on_change(added, removed_names)`."""

    def __init__(self, discovery: Discovery, on_change: OnChange) -> None:
        if discovery.dns_name is None:
            raise ValueError("discovery.dns_name is not set")
        self.discovery = discovery
        self._on_change = on_change
        self.known: dict[str, EngineConfig] = {}
        self.failures = 0
        self._task: asyncio.Task[None] | None = None

    async def resolve(self) -> set[str]:
        """Every IPv4 address the name resolves to now."""
        loop = asyncio.get_running_loop()
        name = self.discovery.dns_name or ""
        infos = await loop.getaddrinfo(name, None, family=socket.AF_INET, type=socket.SOCK_STREAM)
        return {str(info[4][0]) for info in infos}

    async def refresh(self) -> None:
        """Resolve once and apply the difference; resolution errors are counted and logged."""
        try:
            addresses = await self.resolve()
        except OSError as exc:
            self.failures += 1
            log.warning(
                "dns discovery failed", extra={"dns_name": self.discovery.dns_name, "error": str(exc)}
            )
            return
        current = engines_for(self.discovery, addresses)
        added = {n: e for n, e in current.items() if n not in self.known}
        removed = set(self.known) - set(current)
        self.known = current
        if added or removed:
            log.info("dns discovery changed", extra={"added": sorted(added), "removed": sorted(removed)})
            await self._on_change(added, removed)

    async def _run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.discovery.period_s)

    def start(self) -> None:
        """Start the periodic refresh task."""
        self._task = asyncio.create_task(self._run(), name="dns-discovery")

    async def close(self) -> None:
        """Stop refreshing."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
