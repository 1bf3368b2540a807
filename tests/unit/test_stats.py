"""One confidence interval everywhere: over tasks, trials nested; the difference paired by task; a plain verdict."""

import math

import pytest

from albatross.eval.run import EvalResult, summarize
from albatross.eval.stats import paired_difference, t95, task_interval, verdict
from albatross.pipeline.summary import difference_fields, eval_fields
from albatross.records import Reward, Trajectory


def _result(outcomes: dict[str, list[bool]]) -> EvalResult:
    return EvalResult([Trajectory(task, f"eval-{task}", i, samples=[], status="ok",
                                  reward=Reward(success=ok, score=float(ok)))
                       for task, oks in outcomes.items() for i, ok in enumerate(oks)])


def test_the_interval_is_over_tasks_with_trials_nested():
    iv = task_interval([0.0, 1.0, 0.5, 0.5])
    assert iv.mean == 0.5 and iv.se == pytest.approx(math.sqrt(1 / 6) / 2)
    assert iv.half_width == pytest.approx(3.182 * iv.se) and (iv.low, iv.high) == (0.0, 1.0)  # clipped to a rate
    assert task_interval([0.5]).se is None and "no interval" in task_interval([0.5]).text()
    assert t95(1) == 12.706 and 1.96 < t95(200) < 1.98


def test_every_figure_uses_the_same_interval():
    """summary.json (EvalResult), `albatross eval` and the report (summarize) give one and the same s.e."""
    outcomes = {"a": [True, True, False], "b": [False, False, False], "c": [True, True, True], "d": [True, False, False]}
    result = _result(outcomes)
    rates = [sum(v) / len(v) for v in outcomes.values()]
    expected = task_interval(rates)
    assert result.pass_at_1_se == pytest.approx(expected.se)
    assert eval_fields("base", result)["base_pass_at_1_se"] == round(expected.se, 4)
    summary = summarize([t.to_dict() for t in result.trajectories])
    assert summary["pass_at_1_se"] == pytest.approx(expected.se)
    assert summary["pass_at_1_ci95"] == pytest.approx([expected.low, expected.high])


def test_the_difference_is_paired_and_has_a_plain_verdict():
    base = {f"t{i}": 0.2 for i in range(10)}
    better = {f"t{i}": 0.2 + 0.3 + 0.01 * i for i in range(10)}
    noisy = {f"t{i}": (0.9 if i % 2 else 0.0) for i in range(10)}
    assert verdict(paired_difference(base, better)) == "training helped"
    assert verdict(paired_difference(better, base)) == "training hurt"
    assert verdict(paired_difference(base, noisy)) == "no significant change"
    assert verdict(paired_difference({"t0": 0.1}, {"t0": 0.9})) == "too few tasks to tell"
    fields = difference_fields(_result({"a": [False, False], "b": [False, True], "c": [False, False]}),
                               _result({"a": [True, True], "b": [True, True], "c": [True, False]}))
    d = fields["trained_minus_base"]
    assert d["mean"] == pytest.approx(round(2.5 / 3 - 0.5 / 3, 4), abs=1e-4) and d["tasks"] == 3
    assert d["verdict"] in ("training helped", "no significant change")
    assert d["ci95_low"] <= d["mean"] <= d["ci95_high"]
