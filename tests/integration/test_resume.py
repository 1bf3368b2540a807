"""Stop a run with Ctrl-C, resume it, kill its trainer with SIGKILL, resume again: the run finishes
with every step trained exactly once and no attempt counted twice."""

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

STEPS = 8


def _state_step(out: Path) -> int:
    try:
        return json.loads((out / "run" / "state.json").read_text())["step"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return -1


def _default_sigint() -> None:
    """A child started from a background job inherits SIGINT ignored (POSIX: asynchronous commands of a
    shell without job control ignore it) and Python then installs no KeyboardInterrupt handler: give the
    run the disposition a terminal's Ctrl-C meets."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(args, env, log):
    return subprocess.Popen([sys.executable, "-m", "albatross.cli", *args], stdout=log,
                            stderr=subprocess.STDOUT, env=env, preexec_fn=_default_sigint)


def _wait_for_step(proc, out: Path, step: int, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while _state_step(out) < step:
        assert proc.poll() is None, f"run ended early with {proc.returncode}"
        assert time.monotonic() < deadline, "run made no progress"
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.skipif(not local_available(), reason="needs root, namespaces and overlayfs")
def test_interrupt_and_trainer_kill_then_resume(tmp_path, demo_cache):
    out = tmp_path / "out"
    env = {**os.environ, "ALBATROSS_CACHE": str(demo_cache), "PYTHONUNBUFFERED": "1"}
    log = (tmp_path / "log.txt").open("w")
    args = ["demo", "--quick", "--out", str(out), *TINY_DEMO_ARGS, f"--orchestrator.max_steps={STEPS}",
            "--orchestrator.max_minutes=10", "--orchestrator.groups_per_step=1",
            "--orchestrator.checkpoint_every=1"]  # a checkpoint after every step (written in the background)
    proc = _start(args, env, log)
    _wait_for_step(proc, out, 2)
    proc.send_signal(signal.SIGINT)  # Ctrl-C
    assert proc.wait(timeout=120) == 130
    pids = json.loads((out / "run" / "pids.json").read_text())
    assert not Path(f"/proc/{pids['trainer']}").exists(), "trainer left running after Ctrl-C"
    stopped_at = _state_step(out)

    proc = _start(["train", "--resume", str(out)], env, log)
    _wait_for_step(proc, out, stopped_at + 2)
    trainer = json.loads((out / "run" / "pids.json").read_text())["trainer"]
    os.kill(trainer, signal.SIGKILL)  # the trainer crashes
    assert proc.wait(timeout=120) == 1

    proc = _start(["train", "--resume", str(out)], env, log)
    assert proc.wait(timeout=600) == 0, (tmp_path / "log.txt").read_text()[-3000:]
    log.close()
    text = (tmp_path / "log.txt").read_text()
    assert "[resume] from step" in text and "resume with" in text

    summary = json.loads((out / "summary.json").read_text())
    assert summary["train_steps"] == STEPS
    steps = [json.loads(line)["step"] for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1)), steps  # every step once, in order
    rows = [json.loads(line) for line in (out / "run" / "trajectories.jsonl").read_text().splitlines()]
    keys = [(r["group_id"], r["attempt"]) for r in rows]
    assert len(keys) == len(set(keys)), "an attempt was counted twice"
    state = json.loads((out / "run" / "state.json").read_text())
    assert state["counts"]["attempts"] == len(rows)
