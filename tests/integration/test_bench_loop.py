"""`albatross bench loop`: sync vs async RL with long-tail command durations, at a tiny size."""

import json
import os
import subprocess
import sys
import time

import pytest

from albatross.bench.loop import EngineBusy, SlowBackend, TailDelay, mode_figures
from albatross.sandbox import local_available
from albatross.sandbox.faults import FaultInjector

MODE_KEYS = ("steps", "steps_per_hour", "trainer_idle_share", "engine_idle_share", "mean_staleness",
             "heldout_pass_at_1", "wall_seconds")


class _FakeAttempt:
    def __init__(self, log):
        self.log, self.closed = log, False

    def exec(self, command, timeout_s=None):
        self.log.append((command, timeout_s))
        return "ran"

    def read_file(self, path):
        return b"content of " + path.encode()

    def close(self):
        self.closed = True


class _FakeBackend:
    name, isolated, restarts = "fake", True, 0

    def __init__(self):
        self.log, self.attempts, self.closed = [], [], False
        self.faults = FaultInjector(0.0, 0)

    def fork(self, env_dir, workdir="/app", limits=None):
        self.attempts.append(_FakeAttempt(self.log))
        return self.attempts[-1]

    def close(self):
        self.closed = True


def test_tail_delay_is_seeded_capped_and_long_tailed():
    a, b = TailDelay(0.1, 1.5, 10.0, seed=3), TailDelay(0.1, 1.5, 10.0, seed=3)
    xs = [a.draw() for _ in range(4000)]
    assert xs == [b.draw() for _ in range(4000)]
    assert max(xs) <= 10.0 and min(xs) > 0
    xs.sort()
    median, p99 = xs[len(xs) // 2], xs[int(0.99 * len(xs))]
    assert 0.08 < median < 0.12
    assert p99 > 20 * median  # a long tail: the slowest commands take far longer than the typical one
    assert TailDelay(0.0, 1.5, 10.0).draw() == 0.0
    with pytest.raises(ValueError):
        TailDelay(-1.0, 1.0, 1.0)


def test_slow_backend_delays_exec_and_forwards_everything_else():
    inner = _FakeBackend()
    delay = TailDelay(0.02, 0.0, 1.0)  # sigma 0: every command waits exactly 20 ms
    backend = SlowBackend(inner, delay)
    assert backend.name == "fake" and backend.isolated is True and backend.faults is inner.faults
    inner.restarts = 2
    assert backend.restarts == 2  # the real backend's count, read when asked
    attempt = backend.fork(None, "/app")
    t0 = time.monotonic()
    assert attempt.exec("echo hi", 5) == "ran"
    assert time.monotonic() - t0 >= 0.019
    assert inner.log == [("echo hi", 5)] and delay.draws == [0.02]
    assert attempt.read_file("/app/x") == b"content of /app/x"  # delegated
    attempt.close()
    assert inner.attempts[0].closed
    backend.close()
    assert not inner.closed  # the real backend belongs to whoever created it


def test_engine_busy_counts_only_time_inside_the_window():
    class Engine:  # the engine's own counter of seconds in forward passes
        busy_seconds = 0.0

    engine = Engine()
    meter = EngineBusy(engine)
    engine.busy_seconds += 5.0  # before the window: not counted
    assert meter.busy == 0.0
    meter.open_window(10.0)
    engine.busy_seconds += 0.07
    assert meter.busy == pytest.approx(0.07)
    meter.stop()  # the run ended before the window did: later passes are not counted
    engine.busy_seconds += 1.0
    assert meter.busy == pytest.approx(0.07)

    timed = EngineBusy(engine)
    timed.open_window(0.05)
    engine.busy_seconds += 0.5
    time.sleep(0.3)  # the window closes on its own
    engine.busy_seconds += 2.0
    assert timed.busy == pytest.approx(0.5)
    timed.stop()


def test_mode_figures_count_steps_within_the_budget(tmp_path):
    t0 = 1000.0
    rows = [
        {"step": 1, "time": t0 + 10, "seconds": 2.0, "trainer_wait_s": 8.0, "staleness_max": 0,
         "staleness_hist/0": 30.0},
        {"step": 2, "time": t0 + 20, "seconds": 2.0, "trainer_wait_s": 8.0, "staleness_max": 2,
         "staleness_hist/0": 10.0, "staleness_hist/2": 10.0},
        {"step": 3, "time": t0 + 70, "seconds": 2.0, "trainer_wait_s": 0.0, "staleness_max": 5,
         "staleness_hist/5": 100.0},  # after the 60 s budget
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "trajectories.jsonl").write_text("".join(json.dumps({"wall_seconds": s}) + "\n"
                                                         for s in (1.0, 2.0, 9.0)))
    f = mode_figures(tmp_path, t0, 60.0, busy_s=15.0)
    assert f["steps"] == 2 and f["steps_total"] == 3
    assert f["steps_per_hour"] == 120.0
    assert f["trainer_idle_share"] == 0.8
    assert f["engine_idle_share"] == 0.75
    assert f["mean_staleness"] == pytest.approx(20 / 50)
    assert f["attempts"] == 3 and f["attempt_seconds_max"] == 9.0 and f["attempt_seconds_p50"] == 2.0


@pytest.mark.slow
@pytest.mark.skipif(not local_available(), reason="needs root, namespaces and overlayfs")
def test_bench_loop_quick(tmp_path, demo_cache):
    out, tmp = tmp_path / "bench_loop.json", tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "ALBATROSS_CACHE": str(demo_cache), "TMPDIR": str(tmp)}
    r = subprocess.run([sys.executable, "-m", "albatross.cli", "bench", "loop", "--quick", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[bench] sync" in r.stdout and "[bench] async" in r.stdout and "async_vs_sync_steps_per_hour" in r.stdout
    data = json.loads(out.read_text())
    cfg = data["config"]
    budget = cfg["minutes_per_mode"] * 60
    for key in ("minutes_per_mode", "group_size", "groups_per_step", "tail", "async_max_staleness"):
        assert key in cfg, key
    assert cfg["tail"]["distribution"] == "lognormal" and cfg["tail"]["p99_s"] > cfg["tail"]["median_s"]
    for mode in ("sync", "async"):
        m = data[mode]
        for key in MODE_KEYS:
            assert key in m, (mode, key)
        assert m["steps"] >= 1, (mode, m)
        assert m["steps_per_hour"] == pytest.approx(m["steps"] / budget * 3600, rel=0.01)
        for key in ("trainer_idle_share", "engine_idle_share", "heldout_pass_at_1"):
            assert 0.0 <= m[key] <= 1.0, (mode, key, m[key])
        assert m["engine_idle_share"] < 1.0  # the engine generated something within the budget
        assert m["wall_seconds"] >= budget
        assert m["evaluated_version"] == m["steps"]  # the model the budget bought is the one evaluated
        assert m["attempts"] > 0 and m["attempt_seconds_max"] >= m["attempt_seconds_p50"] > 0
        # the bound holds for every trained token: overtaken groups are dropped, never masked in the loss
        assert m["dropped_stale_tokens"] == 0 and m["train_version_mismatches"] == 0, (mode, m)
        assert m["stale_dropped_groups"] >= 0
    # sync trains every batch with the weights that generated it; async lets attempts overlap training
    assert data["sync"]["mean_staleness"] == 0.0 and data["sync"]["max_staleness"] == 0
    assert 0.0 <= data["async"]["max_staleness"] <= cfg["async_max_staleness"]
    assert data["async_vs_sync_steps_per_hour"] == pytest.approx(
        data["async"]["steps_per_hour"] / data["sync"]["steps_per_hour"], rel=0.01)
    assert 0.0 <= data["base_pass_at_1"] <= 1.0
    assert not [p.name for p in tmp.iterdir() if p.name.startswith("albatross-bench-loop-")]  # removed
