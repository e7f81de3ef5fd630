"""bench.service_interference's exchange rate: the worker's extra time per token over the burner's CPU per token."""

from __future__ import annotations

import pytest

from bench.service_interference import loss_per_burn


def test_a_burner_that_costs_nothing_has_u_zero() -> None:
    assert loss_per_burn(200, 200, 600, 0.0045)["u"] == 0


def test_a_burner_that_stops_the_worker_for_its_whole_burn_has_u_one() -> None:
    # 5 ms per token alone; 600 us burnt per 4.5 ms sleep + 0.6 ms burn, all of it added to the tokens.
    token_ms = 5 / (1 - 0.6 / 5.1)
    loss = loss_per_burn(200, 1000 / token_ms, 600, 0.0045)
    assert loss["burn_ms_per_token"] == pytest.approx(token_ms - 5)
    assert loss["u"] == pytest.approx(1)


def test_half_the_burn_lost() -> None:
    token_ms = 5 / (1 - 0.3 / 5.1)
    assert loss_per_burn(200, 1000 / token_ms, 600, 0.0045)["u"] == pytest.approx(0.5)
