"""How busy a workload keeps the stubs, by the stubs' own time model: their schedulers run in
simulated time behind a reference router. Pure (no clock, no I/O).

The stubs are simulated by `virtual_fleet` (the stub's own `Scheduler` per rank, every step priced
as the stub prices it; a request that arrives during a step joins the next one, as on the stub).
So the busy seconds hold prefill at the caching the reference gets (hits from the real pool,
evictions included), decode steps shared as the batches share them, and every step's fixed costs
(`step_overhead_s`, `decode_step_s`, context reads).

The reference router (`REFERENCE`, `virtual_fleet.SoonestForecast`) is the load test's `ttft_oracle`
without its HTTP round trips: each request goes to the rank whose forecast first token comes soonest
(`scheduler_ttft`, from the rank's true queues, hits and cost model, after the step under way), then
the longer hit, then the lower index. A load has to be priced at some policy's caching and
spreading. This one is defined by the stubs alone (no router under test), caches what pays (a cached
prefix is a faster first token) and spreads work as queues build, as the policies compared try to. A
policy's own caching and spreading move the busy time it meets (one that caches less computes more
prefill, one that gathers work on fewer ranks batches more decode steps), which is why the harness
measures every policy's. Ideal caching (one unbounded cache, `shared_prefix_tokens`) is a lower
bound of the prefill work and is only reported beside it; a cache-first rule that ignores queues
piled an idle fleet's requests on one rank, whose batching then made the load jump with the rate
(0.53 to 0.98 between scales 20% apart on a test workload).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine_stub.core.engine_config import EngineCoreConfig
from engine_stub.runtime.cost_model import CostModel
from kvrouter.loadtest.virtual_fleet import REFERENCE, FleetRun, SoonestForecast, run_fleet, sim_ranks
from kvrouter.loadtest.workload import RequestSpec

__all__ = ["REFERENCE", "simulate_busy"]


def simulate_busy(
    requests: Sequence[RequestSpec], core: EngineCoreConfig, cost: CostModel, ranks: int
) -> FleetRun:
    """Run `requests` (arrival times in wall-clock seconds) on `ranks` simulated stub ranks behind the
    reference router until every request finished: each rank's busy seconds (stub-major: stub 0's
    ranks first), and the prompt tokens sent and found cached at first admission."""
    fleet = sim_ranks(core, ranks)
    return run_fleet(requests, fleet, cost, SoonestForecast(fleet, cost))
