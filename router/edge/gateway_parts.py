"""What the request path uses, in one place: built and owned by `router.lifecycle.Service`, read by
the gateway, its deciding (`router.edge.decider`), the passthrough and admin routes.

Its own module so that the deciding, which the gateway builds, can name it without importing the
gateway back."""

from __future__ import annotations

from dataclasses import dataclass

from router.core.fleet_state import FleetState
from router.core.routing import RoutingCore
from router.edge.auth import Guard
from router.edge.proxy import Proxy
from router.links.fleet_links import FleetLinks
from router.ops.debug import DecisionRing
from router.ops.metrics import RouterMetrics
from router.ops.recording import GatewayRecorder
from router.ops.worker_peers import WorkerPeers
from router.prepare.served_models import Models
from router.settings.config import RouterConfig

__all__ = ["GatewayParts"]


@dataclass
class GatewayParts:
    """Everything the request path uses, built and owned by `router.lifecycle.Service`."""

    config: RouterConfig
    fleet: FleetState
    links: FleetLinks
    models: Models
    core: RoutingCore
    proxy: Proxy
    metrics: RouterMetrics
    guard: Guard
    ring: DecisionRing
    recorder: GatewayRecorder | None = None
    peers: WorkerPeers | None = None
