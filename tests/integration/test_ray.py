"""`orchestrator.backend = "ray"`: the quick demo on a local Ray cluster the test starts (2 CPUs, no
dashboard, its temp dir inside the test's directory): trainer, engine replica and rollout workers are
Ray actors, and the run trains every step with no attempt counted twice."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from albatross.sandbox import local_available

ray = pytest.importorskip("ray")


@pytest.mark.slow
@pytest.mark.skipif(not local_available(), reason="needs root, namespaces and overlayfs")
def test_quick_demo_on_a_local_ray_cluster(tmp_path_factory, demo_cache, monkeypatch) -> None:
    from albatross.bench.loop import QUICK_OVERRIDES
    from albatross.pipeline.demo import demo_config
    from albatross.pipeline.driver import Pipeline

    monkeypatch.setenv("ALBATROSS_CACHE", str(demo_cache))
    root = tmp_path_factory.mktemp("ray")  # short: Ray's socket paths live under it
    out = root / "out"
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(root / "r"), log_to_driver=False)
    logs: list[str] = []
    try:
        # bench loop's tiny demo (16 training tasks, a 60-step warm start, groups of 4): its warm start in
        # demo_cache is this run's
        cfg = demo_config(None, True, str(out), [*QUICK_OVERRIDES, "orchestrator.backend=ray", "eval.trials=1",
                                                 "tasks.n_heldout=4", "engine.replicas=2",
                                                 "ray.engine_cpus=0.25", "orchestrator.checkpoint_every=1"])
        summary = Pipeline(cfg, log=logs.append, command="demo").run()
        assert ray.is_initialized()  # a cluster the caller started is left to the caller
    finally:
        ray.shutdown()
    assert any(line.startswith("[ray] cluster: 2 CPUs") for line in logs), logs
    assert any("2 engine replica(s), 2 rollout worker(s)" in line for line in logs), logs
    assert summary["train_steps"] == cfg.orchestrator.max_steps

    pids = json.loads((out / "run" / "pids.json").read_text())
    actors = [pids["trainer"], pids["engine0"], pids["engine1"], pids["rollout0"], pids["rollout1"]]
    assert len(set(actors)) == 5 and os.getpid() not in actors  # each part in its own actor process
    assert not any(Path(f"/proc/{pid}").exists() for pid in actors), "an actor outlived ray.shutdown()"

    rows = [json.loads(line) for line in (out / "run" / "trajectories.jsonl").read_text().splitlines()]
    keys = [(r["group_id"], r["attempt"]) for r in rows]
    assert rows and len(keys) == len(set(keys)), "an attempt was counted twice"
    state = json.loads((out / "run" / "state.json").read_text())
    assert state["counts"]["attempts"] == len(rows) and state["step"] == summary["train_steps"]
    versions = {v for r in rows for s in r["samples"] for v in s["versions"] if v >= 0}
    assert len(versions) > 1  # the engine actors loaded the trainer actor's weights as it stepped


def test_actors_that_do_not_fit_the_cluster_are_a_config_error() -> None:
    from albatross.config import ConfigError, load_config
    from albatross.orchestrator.ray_backend import check_resources

    cfg = load_config(None, ["engine.replicas=2", "ray.engine_gpus=1"])
    with pytest.raises(ConfigError, match=r"need 2 GPUs .*engine.replicas x ray.engine_gpus.* has 1"):
        check_resources(cfg, {"CPU": 16.0, "GPU": 1.0})
    with pytest.raises(ConfigError, match=r"need 2.5 CPUs"):
        check_resources(load_config(None, ["engine.replicas=2"]), {"CPU": 2.0})
    check_resources(load_config(None, ["engine.replicas=2", "ray.engine_cpus=0.25"]), {"CPU": 2.0})
