"""Kill an engine replica process and the sandbox helper of a running training run with SIGKILL (by the
pids the run wrote to pids.json): both are restarted, the attempts they were serving are re-run as
infrastructure errors, and the run finishes every step with no attempt counted twice."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from albatross.sandbox import local_available
from demo_util import TINY_DEMO_ARGS

STEPS = 10


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _wait_for_step(proc: subprocess.Popen, out: Path, step: int, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while _read(out / "run" / "state.json").get("step", -1) < step:
        assert proc.poll() is None, f"run ended early with {proc.returncode}"
        assert time.monotonic() < deadline, "run made no progress"
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.skipif(not local_available(), reason="needs root, namespaces and overlayfs")
def test_engine_and_sandbox_killed_mid_run_are_restarted_and_the_run_finishes(tmp_path, demo_cache) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "ALBATROSS_CACHE": str(demo_cache), "PYTHONUNBUFFERED": "1"}
    args = ["demo", "--quick", "--out", str(out), *TINY_DEMO_ARGS, f"--orchestrator.max_steps={STEPS}",
            "--eval.trials=1", "--tasks.n_heldout=4", "--orchestrator.max_minutes=10", "--engine.replicas=2", "--engine.process=true",
            "--orchestrator.checkpoint_every=1"]
    with (tmp_path / "log.txt").open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "albatross.cli", *args], stdout=log,
                                stderr=subprocess.STDOUT, env=env)
        try:
            _wait_for_step(proc, out, 1)
            before = _read(out / "run" / "pids.json")
            os.kill(before["engine0"], signal.SIGKILL)  # an engine replica dies mid-run
            _wait_for_step(proc, out, 3)
            os.kill(before["sandbox"], signal.SIGKILL)  # and so does the sandbox helper
            code = proc.wait(timeout=900)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    text = (tmp_path / "log.txt").read_text()
    assert code == 0, text[-3000:]
    assert "replica 0" in text and "restarted as pid" in text and "sandbox zygote" in text

    after = _read(out / "run" / "pids.json")  # rewritten while the loop ran
    assert after["sandbox"] != before["sandbox"] and after["engine1"] == before["engine1"]
    restarted = [int(w) for w in text.split("restarted as pid ")[1].split()[:1]]
    assert not any(Path(f"/proc/{pid}").exists() for pid in [*after.values(), *restarted]
                   if pid != after["orchestrator"]), "a process of the run outlived it"

    summary = _read(out / "summary.json")
    assert summary["train_steps"] == STEPS
    metrics = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    # the engine restart may end after the last step (a server start takes seconds on a busy machine)
    assert metrics[-1]["engine_restarts"] <= 1 and metrics[-1]["sandbox_restarts"] == 1
    assert all(0.0 <= m["engine_idle_share"] <= 1.0 for m in metrics)
    state = _read(out / "run" / "state.json")
    assert state["counts"]["infra_error_attempts"] >= 1  # the attempts in flight were re-run
    rows = [json.loads(line) for line in (out / "run" / "trajectories.jsonl").read_text().splitlines()]
    keys = [(r["group_id"], r["attempt"]) for r in rows]
    assert len(keys) == len(set(keys)) and state["counts"]["attempts"] == len(rows)
    assert all(r["status"] != "infra_error" or r["dropped"] == "infra_error" for r in rows)
