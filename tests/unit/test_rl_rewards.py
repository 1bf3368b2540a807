import math

import pytest

from albatross.rl.rewards import (
    calibrate,
    efficiency_adjust,
    efficiency_penalties,
    fit_isotonic,
    partial_credit,
    score,
)


def test_partial_credit_uniform_weights():
    assert partial_credit({"a": 1.0, "b": 0.0, "c": 1.0, "d": 0.0}) == 0.5


def test_partial_credit_ignores_tests_that_pass_untouched():
    # "a" passes in the untouched environment (weight 0); of b, c, d only b passes -> 1/3.
    metrics = {"a": 1.0, "b": 1.0, "c": 0.0, "d": 0.0}
    assert partial_credit(metrics, {"a": 0.0}) == pytest.approx(1 / 3)


def test_partial_credit_weighted_and_degenerate():
    assert partial_credit({"a": 1.0, "b": 0.0}, {"a": 3.0, "b": 1.0}) == 0.75
    assert partial_credit({"a": 1.0}, {"a": 0.0}) == 0.0
    assert partial_credit({}) == 0.0
    with pytest.raises(ValueError):
        partial_credit({"a": 1.0}, {"a": -1.0})


def test_score_success_outranks_failure():
    assert score(True, 0.3) == 1.0
    assert score(False, 0.6) == pytest.approx(0.3)
    assert score(False, 0.6, c=0.25) == pytest.approx(0.15)
    assert score(False, 1.0) < score(True, 0.0)
    with pytest.raises(ValueError):
        score(False, 0.5, c=1.0)


def test_efficiency_adjust_successes_only():
    scores, metrics = efficiency_adjust(
        [1.0, 1.0, 1.0, 0.25], [True, True, True, False], [100, 200, 300, 50], lam=0.1, eps=0.0
    )
    assert scores == pytest.approx([1.0, 0.95, 0.9, 0.25])
    assert metrics["efficiency/successes"] == 3.0
    assert metrics["efficiency/mean_penalty"] == pytest.approx(0.05)
    assert metrics["efficiency/max_penalty"] == pytest.approx(0.1)


def test_efficiency_default_eps_and_single_success():
    pen = efficiency_penalties([True, True], [10, 20])
    assert pen[0] == 0.0 and math.isclose(pen[1], 0.1 * 10 / (10 + 1e-6))
    assert efficiency_penalties([True, False], [500, 10]) == [0.0, 0.0]
    assert efficiency_penalties([False, False], [5, 10]) == [0.0, 0.0]
    with pytest.raises(ValueError):
        efficiency_penalties([True], [1, 2])


def test_isotonic_fit_pools_violators():
    # (0.2, 1) then (0.3, 0) violate monotonicity and pool to 0.5
    assert fit_isotonic([0.1, 0.2, 0.3, 0.4], [0, 1, 0, 1]) == [(0.1, 0.0), (0.2, 0.5), (0.3, 0.5), (0.4, 1.0)]
    # equal x values are pooled first, with weights
    assert fit_isotonic([0.5, 0.5, 1.0], [1, 0, 1], weights=[3, 1, 1]) == [(0.5, 0.75), (1.0, 1.0)]
    assert fit_isotonic([0.9, 0.1], [0.2, 0.6]) == [(0.1, 0.4), (0.9, 0.4)]
    with pytest.raises(ValueError):
        fit_isotonic([0.1], [1, 0])


def test_calibrate_interpolates_between_knots():
    knots = fit_isotonic([0.0, 0.5, 0.5, 1.0], [0, 1, 0, 1])
    assert knots == [(0.0, 0.0), (0.5, 0.5), (1.0, 1.0)]
    assert calibrate(0.25, knots) == pytest.approx(0.25)
    assert calibrate(-1.0, knots) == 0.0 and calibrate(2.0, knots) == 1.0
    assert calibrate(0.7, [(0.2, 0.1), (0.6, 0.3)]) == 0.3
