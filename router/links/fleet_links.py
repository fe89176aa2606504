"""The links to the engines: one `EngineSubscriber` per replica with event endpoints, feeding the state.

The I/O shell around `router.core.fleet_state.FleetState`: it adds and removes engines (their variant from
`Models.learn`), starts and stops their subscribers (the state is their `Consumer`), plugs each one
into its replica as its `Link`, and hands every received frame to the taps (recordings). Everything
the links learn goes into the state; nothing is kept here but the sockets' owners.
"""

from __future__ import annotations

import zmq.asyncio

from events.sources import EngineName, EngineSource, FrameTap, SubscriberConfig
from events.subscriber import EngineSubscriber
from router.core.fleet_state import FleetState, replay_endpoint
from router.core.ids import EngineId
from router.prepare.served_models import Models
from router.settings.config import EngineConfig

__all__ = ["FleetLinks"]


class FleetLinks:
    """Starts, stops and owns the fleet's subscribers; engines join and leave the state through it."""

    def __init__(
        self,
        state: FleetState,
        models: Models,
        *,
        context: zmq.asyncio.Context | None = None,
        subscriber_config: SubscriberConfig | None = None,
    ) -> None:
        if models.hasher is not state.mirror.hasher:
            raise ValueError("Models and the fleet's mirror must share one KeyHasher")
        self.state, self.models = state, models
        self._context = context
        self._sub_config = subscriber_config or SubscriberConfig()
        self._subscribers: dict[EngineId, EngineSubscriber] = {}
        self._taps: list[FrameTap] = []

    async def start(self) -> None:
        """Register the configured engines and start their subscribers."""
        known = {e.name for e in self.state.engines()}
        for engine in self.state.config.engines:
            if engine.name not in known:
                await self.add_engine(engine)

    async def close(self) -> None:
        """Stop every subscriber (the state keeps the mirror)."""
        for rid, subscriber in list(self._subscribers.items()):
            await subscriber.close()
            del self._subscribers[rid]
            self.state.attach(rid, None)

    async def add_engine(self, engine: EngineConfig) -> None:
        """Add an engine at run time (admin API, discovery); ValueError if the name is taken."""
        if any(e.name == engine.name for e in self.state.engines()):
            raise ValueError(f"engine {engine.name!r} is already in the fleet")  # before learning it
        variant = self.models.learn(engine)
        for rid in self.state.add_engine(engine, variant, self.state.clock()):
            rep = self.state.replica(rid)
            if not engine.events:
                continue
            source = EngineSource(
                name=rid, endpoint=engine.events[rep.rank], replay_endpoint=replay_endpoint(rep)
            )
            subscriber = EngineSubscriber(
                source, self.state, self._sub_config, context=self._context, tap=self._tap
            )
            self._subscribers[rid] = subscriber
            self.state.attach(rid, subscriber)
            subscriber.start()

    async def remove_engine(self, name: str) -> None:
        """Remove an engine and everything known about its replicas; KeyError if unknown."""
        for rid in self.state.remove_engine(name):
            subscriber = self._subscribers.pop(rid, None)
            if subscriber is not None:
                await subscriber.close()

    def subscriber(self, replica: EngineId) -> EngineSubscriber | None:
        """The replica's running subscriber (None: no event endpoints, or stopped)."""
        return self._subscribers.get(replica)

    def on_frame(self, tap: FrameTap) -> None:
        """Call `tap` with every frame any subscriber receives (for recordings)."""
        self._taps.append(tap)

    def _tap(self, name: EngineName, frame: object, now: float) -> None:
        for tap in self._taps:
            tap(name, frame, now)  # type: ignore[arg-type]
