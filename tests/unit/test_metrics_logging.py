"""Logging that fits the tools users have: TensorBoard tags keep their groups, the warm start and the evaluations
are logged beside the trainer steps, W&B runs are named after the run and resumed by id, and a W&B project set
without wandb installed is a one-line error."""

import sys

import pytest

from albatross.cli import main
from albatross.errors import UserError
from albatross.orchestrator.metrics import MetricsSink, check_wandb, wandb_init_args


def test_tensorboard_tags_keep_their_groups_and_every_phase_is_logged(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = MetricsSink(tmp_path, max_steps=2, log=lambda _line: None, max_minutes=1.0)
    sink.scalars("warmstart", {"loss": 2.5, "pass_rate": 0.1}, 25)
    sink.scalars("eval/base", {"pass_at_1": 0.25, "pass_at_1_se": 0.05}, 0)
    sink.start_training()
    sink.step({"step": 1, "time": 0.0, "pass_rate": 0.5, "loss": 0.1, "batch/groups_seen": 4.0})
    sink.scalars("eval/trained", {"pass_at_1": 0.5}, 2)
    sink.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"batch/groups_seen", "pass_rate", "loss", "warmstart/loss", "warmstart/pass_rate",
            "eval/base/pass_at_1", "eval/trained/pass_at_1"} <= tags
    assert "batch_groups_seen" not in tags and "time" not in tags
    assert [e.value for e in acc.Scalars("eval/base/pass_at_1")] == [0.25]
    assert (tmp_path / "metrics.jsonl").is_file() and (tmp_path / "metrics_other.jsonl").is_file()


def test_wandb_runs_are_named_after_the_run_and_resumed_by_id(tmp_path):
    run_dir = tmp_path / "own-model-20260101-120000" / "run"
    run_dir.mkdir(parents=True)
    first = wandb_init_args("proj", run_dir, {"lr": 1e-6}, "own-model-20260101-120000", "own-model", resume=False)
    assert first["name"] == "own-model-20260101-120000" and first["group"] == "own-model"
    assert first["project"] == "proj" and first["resume"] == "allow" and len(first["id"]) == 16
    resumed = wandb_init_args("proj", run_dir, {}, "own-model-20260101-120000", "own-model", resume=True)
    assert resumed["id"] == first["id"]  # `train --resume` continues the same W&B run
    fresh = wandb_init_args("proj", tmp_path, {}, "x", "", resume=False)
    assert fresh["id"] != first["id"] and fresh["group"] is None


def test_a_wandb_project_without_wandb_is_a_user_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    check_wandb("")  # no project: nothing to check
    with pytest.raises(UserError) as e:
        check_wandb("my-project")
    assert "albatross[wandb]" in str(e.value)
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'out = "{tmp_path / "out"}"\n[orchestrator]\nwandb_project = "my-project"\n')
    assert main(["train", str(cfg)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "wandb is not installed" in err and not (tmp_path / "out").exists()
