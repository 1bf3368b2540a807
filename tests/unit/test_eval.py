import io
import json
import math
from collections import Counter

import pytest

from albatross.cli.eval import Progress, format_summary
from albatross.eval.report import pareto_front
from albatross.eval.run import (
    EvalResult,
    Price,
    Usage,
    evaluate,
    final_records,
    finished_pairs,
    load_attempts,
    load_prices,
    pass_at_k,
    record_usage,
    sample_usage,
    summarize,
)
from albatross.harness.agent import AttemptSpec
from albatross.records import Reward, Sample, Trajectory
from albatross.tasks.format import Task


def test_pass_at_k_hand_values():
    assert pass_at_k(5, 0, 1) == 0.0
    assert pass_at_k(5, 5, 3) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    # n=4, c=2, k=2: 1 - C(2,2)/C(4,2) = 1 - 1/6
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)
    # n=5, c=2, k=3: 1 - C(3,3)/C(5,3) = 1 - 1/10
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9)
    # n=10, c=3, k=5: 1 - C(7,5)/C(10,5) = 1 - 21/252
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)
    # k=1 is the success rate c/n
    assert pass_at_k(7, 3, 1) == pytest.approx(3 / 7)


def _t(task, ok, tokens, status="ok"):
    return Trajectory(task, "g", 0, reward=Reward(success=ok), status=status, completion_tokens=tokens)


def test_eval_result_ignores_infra_errors():
    r = EvalResult([_t("a", True, 10), _t("a", False, 20), _t("b", False, 5),
                    _t("b", False, 5, status="infra_error")])
    assert r.pass_at_1 == pytest.approx((0.5 + 0.0) / 2)
    assert r.tokens_per_solve == 10


def test_sample_usage_counts_prefix_caching():
    # instruction (3), completion (2), observation (2), completion (3)
    mask = [0, 0, 0, 1, 1, 0, 0, 1, 1, 1]
    # request 1: 3 fresh; request 2: 5 cached (all of request 1 and its answer) + 2 fresh
    assert sample_usage(mask) == Usage(input=5, cached_input=5, output=5)
    assert sample_usage([0, 0]) == Usage(2 * 0, 0, 0)
    rec = {"samples": [Sample([1] * 10, mask, [0.0] * 10, [0] * 10).__dict__,
                       Sample([1] * 3, [0, 1, 1], [0.0] * 3, [0] * 3).__dict__]}
    assert record_usage(rec) == Usage(6, 5, 7)  # a new sample (compression) starts uncached
    assert record_usage({"usage": {"input": 1, "cached_input": 2, "output": 3}}) == Usage(1, 2, 3)


def test_price_table(tmp_path):
    path = tmp_path / "prices.toml"
    path.write_text('["big-model"]\ninput = 1.25\ncached_input = 0.125\noutput = 10\n'
                    '["no-cache"]\ninput = 2\noutput = 4\n')
    prices = load_prices(path)
    assert prices["big-model"].cost(Usage(1_000_000, 2_000_000, 100_000)) == pytest.approx(1.25 + 0.25 + 1.0)
    assert prices["no-cache"].cached_input == 2.0  # defaults to the input price
    path.write_text('["m"]\ninput = -1\n')
    with pytest.raises(ValueError, match=r'prices.toml: \["m"\] input must be a non-negative number'):
        load_prices(path)
    path.write_text('["m"]\ninputs = 1\n')
    with pytest.raises(ValueError, match="unknown field 'inputs'"):
        load_prices(path)
    with pytest.raises(ValueError, match="price table not found"):
        load_prices(tmp_path / "missing.toml")


def _rec(task, trial, ok, status="ok", cost=0.0, category=None, output=4):
    r = {"task_id": task, "attempt": trial, "status": status, "reward": {"success": ok},
         "turns": [{}] * 2, "wall_seconds": 1.0, "cost": cost,
         "usage": {"input": 10, "cached_input": 6, "output": output}}
    if category:
        r["category"] = category
    return r


def test_summarize_hand_values():
    records = [
        _rec("a", 0, True, cost=0.02, category="x"), _rec("a", 1, False, cost=0.04, category="x"),
        _rec("b", 0, False, status="infra_error", category="y"),  # retried, then:
        _rec("b", 0, True, cost=0.02, category="y"), _rec("b", 1, False, cost=0.0, category="y"),
    ]
    s = summarize(records)
    assert s["tasks"] == 2 and s["attempts"] == 4 and s["successes"] == 2
    assert s["pass_at_1"] == pytest.approx(0.5)
    # over tasks (trials nested): both tasks pass half their trials, so no spread between tasks
    assert s["pass_at_1_se"] == pytest.approx(0.0)
    assert s["pass_at_k"] == {"1": pytest.approx(0.5), "2": pytest.approx(1.0)}
    assert s["infra_errors"] == 1 and s["unscored_attempts"] == 0
    assert s["cost_per_task"] == pytest.approx(0.08 / 4)
    assert s["tokens"] == {"input": 40, "cached_input": 24, "output": 16}
    assert s["turns_per_task"] == 2.0
    cats = {c["category"]: c for c in s["per_category"]}
    assert cats["x"]["pass_at_1"] == 0.5 and cats["y"]["attempts"] == 2
    assert [t["task"] for t in s["per_task"]] == ["a", "b"]
    # repricing from token usage, a task restriction and a trial restriction
    priced = summarize(records, price=Price(input=1e6, cached_input=0.0, output=0.0))
    assert priced["cost_per_task"] == pytest.approx(10.0)
    assert summarize(records, tasks=["a"])["pass_at_1"] == 0.5
    assert summarize(records, trials=1)["pass_at_1"] == 1.0


def test_infra_errors_are_never_scored():
    s = summarize([_rec("a", 0, True), _rec("a", 1, False, status="infra_error"),
                   _rec("a", 1, False, status="infra_error")])
    assert s["pass_at_1"] == 1.0 and s["attempts"] == 1
    assert s["infra_errors"] == 2 and s["unscored_attempts"] == 1
    assert s["pass_at_1_se"] is None  # one scored trial: no spread to measure


def test_final_records_and_finished_pairs():
    recs = [_rec("a", 0, False, status="infra_error"), _rec("a", 0, True), _rec("a", 1, False,
                                                                               status="infra_error")]
    finals = final_records(recs)
    assert finals[("a", 0)]["status"] == "ok" and finals[("a", 1)]["status"] == "infra_error"
    assert finished_pairs(recs) == {("a", 0)}


def test_load_attempts_cuts_an_unfinished_last_line(tmp_path):
    path = tmp_path / "attempts.jsonl"
    path.write_text(json.dumps(_rec("a", 0, True)) + "\n" + '{"task_id": "a", "att')
    assert len(load_attempts(path)) == 1
    with path.open("a") as f:  # the next append starts on a fresh line
        f.write(json.dumps(_rec("a", 1, True)) + "\n")
    assert [r["attempt"] for r in load_attempts(path)] == [0, 1]
    assert load_attempts(tmp_path / "missing.jsonl") == []


class FlakyRunner:
    """A deterministic fake runner: the first try of every trial 1 is an infrastructure error."""

    def __init__(self) -> None:
        self.tries: Counter = Counter()

    def run(self, spec: AttemptSpec) -> Trajectory:
        key = (spec.task.id, spec.attempt)
        self.tries[key] += 1
        if spec.attempt == 1 and self.tries[key] == 1:
            return Trajectory(spec.task.id, spec.group_id, spec.attempt, status="infra_error")
        return Trajectory(spec.task.id, spec.group_id, spec.attempt, reward=Reward(success=spec.attempt == 0))


def _task(tid, tmp_path):
    return Task(tid, tmp_path, "do it", 10.0, 10.0, tmp_path, tmp_path, tmp_path)


def test_evaluate_retries_skips_and_records_every_try(tmp_path):
    tasks = [_task("a", tmp_path), _task("b", tmp_path)]
    runner, tries, seen = FlakyRunner(), [], []
    result = evaluate(runner, tasks, 3, workers=2, out_jsonl=tmp_path / "out.jsonl",
                      skip={("b", 2)}, on_try=tries.append, progress=lambda d, t: seen.append((d, t)))
    assert [(t.task_id, t.attempt) for t in result.trajectories] == [
        ("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1)]
    assert result.infra_errors == 2 and len(tries) == 7
    assert ("b", 2) not in runner.tries
    assert result.pass_at_1 == pytest.approx((1 / 3 + 1 / 2) / 2)  # a: 1 of 3; b: 1 of 2 (one skipped)
    assert sorted(seen)[-1] == (5, 5)
    assert len(load_attempts(tmp_path / "out.jsonl")) == 7


def test_pareto_front():
    pts = [(1.0, 0.2), (2.0, 0.5), (3.0, 0.4), (0.5, 0.1), (2.0, 0.3), (10.0, 0.9)]
    assert pareto_front(pts) == [3, 0, 1, 5]
    assert pareto_front([(1.0, 0.5), (1.0, 0.5)]) == [0]


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_and_plain_lines():
    plain = io.StringIO()
    p = Progress(20, plain)
    for i in range(1, 21):
        p.on_try(Trajectory("a", "g", i, reward=Reward(success=i % 2 == 0)))
        p(i, 20)
    lines = plain.getvalue().splitlines()
    assert 5 <= len(lines) <= 11 and "\r" not in plain.getvalue()
    assert lines[-1].startswith("[eval] 20/20 attempts  solved 10")
    tty = _Tty()
    p = Progress(4, tty)
    p(1, 4)
    p(4, 4)
    assert tty.getvalue().count("\r") == 2 and "[" + "#" * 24 + "]" in tty.getvalue()


def test_format_summary_tables():
    s = {"label": "m", **summarize([_rec("a", 0, True, category="x"), _rec("a", 1, False, category="x")])}
    text = format_summary(s)
    assert "Pass@1              0.500\n" in text  # one task: no interval
    two = {"label": "m", **summarize([_rec("a", 0, True), _rec("a", 1, True), _rec("b", 0, False), _rec("b", 1, False)])}
    assert "Pass@1              0.500 ± 0.500 (s.e. over tasks; 95% CI 0.000 to 1.000)" in format_summary(two)
    assert "k=1 0.500  k=2 1.000" in text
    assert not math.isnan(s["cost_per_task"])
    assert "x         1      2         0.500" in text


def test_pass_at_1_standard_error_over_tasks():
    rows = [_t("a", True, 1), _t("a", True, 1), _t("b", True, 1), _t("b", False, 1), _t("c", False, 1),
            _t("c", False, 1), _t("c", True, 1, status="infra_error")]
    r = EvalResult(rows)
    rates = [1.0, 0.5, 0.0]
    assert r.pass_at_1 == pytest.approx(0.5)
    mean = sum(rates) / 3
    sd = (sum((x - mean) ** 2 for x in rates) / 2) ** 0.5
    assert r.pass_at_1_se == pytest.approx(sd / 3 ** 0.5) == pytest.approx(0.288675, abs=1e-6)
    assert EvalResult([_t("a", True, 1), _t("a", False, 1)]).pass_at_1_se is None  # one task
    assert EvalResult([_t("a", True, 1), _t("b", True, 1)]).pass_at_1_se == 0.0


def test_pass_at_1_by_family_reads_builtin_ids_or_a_mapping():
    from albatross.eval.run import pass_at_1_by_family, task_family

    r = EvalResult([_t("heldout-0000-count_lines", True, 1), _t("heldout-0003-count_lines", False, 1),
                    _t("heldout-0001-grep_word", True, 1), _t("heldout-0001-grep_word", True, 1),
                    _t("validation-0002-follow_pointer", False, 1), _t("my-task", True, 1)])
    assert pass_at_1_by_family(r) == {"count_lines": 0.5, "follow_pointer": 0.0, "grep_word": 1.0,
                                      "uncategorized": 1.0}
    assert pass_at_1_by_family(r, {"my-task": "custom"})["custom"] == 1.0
    assert task_family("train-0012-py_fix") == "py_fix" and task_family("heldout-x-count_lines") == "uncategorized"


def test_report_shows_the_network_policies_attempts_ran_under() -> None:
    from albatross.eval.report import network_policies

    rows = [{"task_id": "a", "network": "registries"}, {"task_id": "b", "network": "registries"}]
    assert network_policies(rows) == "registries"
    assert network_policies([*rows, {"task_id": "c", "network": "none"}]) == "registries (2), none (1)"
    assert network_policies([{"task_id": "a"}]) == "—"
