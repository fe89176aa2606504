"""The simulated step-time model: priced by example."""

from __future__ import annotations

import pytest

from engine_stub.runtime.cost_model import CostModel, StepWork


def test_idle_step_costs_nothing() -> None:
    assert CostModel().step_seconds(StepWork()) == 0.0


@pytest.mark.parametrize(
    ("work", "seconds"),
    [
        (StepWork(prefill_tokens=1000), 0.5e-3 + 1000 * 32e-6),
        (StepWork(decode_seqs=4, context_tokens=4000), 0.5e-3 + 6e-3 + 4 * 40e-6 + 4000 * 38e-9),
        (
            StepWork(prefill_tokens=16, decode_seqs=1, context_tokens=16),
            0.5e-3 + 16 * 32e-6 + 6.04e-3 + 16 * 38e-9,
        ),
    ],
)
def test_step_price(work: StepWork, seconds: float) -> None:
    assert CostModel().step_seconds(work) == pytest.approx(seconds)


def test_speed_factor_divides_time() -> None:
    work = StepWork(prefill_tokens=8192)
    assert CostModel(speed_factor=10).step_seconds(work) == pytest.approx(CostModel().step_seconds(work) / 10)


@pytest.mark.parametrize("bad", [{"speed_factor": 0.0}, {"prefill_s_per_token": -1.0}])
def test_invalid_model_is_rejected(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        CostModel(**bad)
