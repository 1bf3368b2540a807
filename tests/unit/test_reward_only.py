"""tasks.reward_only_families: no demonstration of them reaches the warm start; evaluations report them apart."""

from pathlib import Path

import pytest

from albatross.errors import UserError
from albatross.eval.run import EvalResult
from albatross.pipeline.summary import split_fields
from albatross.pipeline.warmstart import demonstrated
from albatross.records import Reward, Trajectory
from albatross.tasks.format import Task, family_of


def _task(task_id: str, family: str | None = None) -> Task:
    p = Path("/nonexistent") / task_id
    return Task(task_id, p, "do it", 60.0, 30.0, p / "environment", p / "tests", p / "solution",
                metadata={"family": family} if family else {})


def _attempt(task_id: str, success: bool) -> Trajectory:
    return Trajectory(task_id, "g", 0, reward=Reward(score=float(success), success=success))


def test_family_comes_from_metadata_then_the_builtin_id() -> None:
    assert family_of(_task("heldout-0003-count_to")) == "count_to"
    assert family_of(_task("heldout-0003-count_to", "mine")) == "mine"
    assert family_of(_task("fix-the-build")) == "uncategorized"


def test_the_warm_start_never_sees_a_reward_only_family() -> None:
    tasks = [_task("train-0000-count_lines"), _task("train-0001-count_to"), _task("x", "count_to")]
    assert [t.id for t in demonstrated(tasks, ["count_to"])] == ["train-0000-count_lines"]
    assert demonstrated(tasks, []) == tasks
    with pytest.raises(UserError, match="reward_only_families"):
        demonstrated(tasks[1:], ["count_to"])


def test_split_fields_score_each_part_on_its_own_tasks() -> None:
    heldout = [_task("heldout-0000-count_lines"), _task("heldout-0001-count_to"), _task("heldout-0002-count_to")]
    trained = EvalResult([_attempt("heldout-0000-count_lines", True), _attempt("heldout-0001-count_to", True),
                          _attempt("heldout-0002-count_to", False), _attempt("heldout-0002-count_to", False)])
    fields = split_fields(heldout, ["count_to"], trained=trained, base=None)
    assert fields["trained_pass_at_1_warm_started"] == 1.0
    assert fields["trained_pass_at_1_reward_only"] == 0.5  # per task: 1.0 and 0.0
    assert fields["trained_pass_at_1_reward_only_se"] == pytest.approx(0.5)
    assert fields["base_pass_at_1_reward_only"] is None  # no base evaluation: no figure
    assert split_fields(heldout, [], trained=trained) == {}
