"""`routing_sim.forecast_audit`: every routed request judged against the engines' true forecasts
(bench/kv_forecast_audit.py). The TTFT oracle routes by those forecasts, so it is never late; kv,
which predicts them, is judged on every request it routed."""

from __future__ import annotations

from bench.kv_forecast_audit import summary
from router.core.policy.scoring import PolicyName
from tests.router.core.policy.test_decode_heavy_routing import SIM, decode_heavy
from tests.routing_sim import TTFT_ORACLE, forecast_audit, run


def test_the_oracle_is_never_later_than_the_soonest_forecast() -> None:
    rows = forecast_audit(TTFT_ORACLE, decode_heavy(0), SIM)
    assert len(rows) == 200
    assert all(r.chosen == r.soonest and r.regret_s == 0.0 for r in rows)
    assert summary(rows).startswith("late 0/200 (0%)")


def test_kv_is_judged_on_each_request_it_routed_with_its_own_prediction() -> None:
    requests = decode_heavy(0)
    rows = forecast_audit(PolicyName.KV, requests, SIM)
    result = run(PolicyName.KV, requests, SIM)
    assert [r.index for r in rows] == list(range(len(requests)))
    assert [r.predicted_s for r in rows] == result.predicted_ttft_s  # the same replay, deterministic
    assert all(r.regret_s >= 0.0 and r.chosen_forecast_s >= r.soonest_forecast_s for r in rows)
    assert any(r.regret_s > 0.0 for r in rows)  # (kv predicts; here it is late on some)
