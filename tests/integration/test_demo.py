"""`albatross demo --quick` end to end, as a user runs it, on bench loop's tiny task set (16 training tasks, a
60-step warm start, groups of 4): the warm start of the default quick settings (240 tasks) alone took minutes of
every CI run; this one is built once and shared with the other tests of the demo (``demo_cache``)."""

import json
import os
import subprocess
import sys

import pytest

from albatross.pipeline.summary import SUMMARY_KEYS
from albatross.sandbox import local_available
from demo_util import TINY_DEMO_ARGS


@pytest.mark.slow
@pytest.mark.skipif(not local_available(), reason="needs root, namespaces and overlayfs")
def test_demo_quick(tmp_path, demo_cache):
    out = tmp_path / "out"
    env = {**os.environ, "ALBATROSS_CACHE": str(demo_cache)}
    r = subprocess.run([sys.executable, "-m", "albatross.cli", "demo", "--quick", "--out", str(out),
                        *TINY_DEMO_ARGS], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[warm-start]" in r.stdout and "[train] step" in r.stdout and "[eval]" in r.stdout
    summary = json.loads((out / "summary.json").read_text())
    for key in SUMMARY_KEYS:
        assert key in summary, key
    for key in ("base_pass_at_1", "trained_pass_at_1", "zero_signal_group_fraction"):
        assert 0.0 <= summary[key] <= 1.0
    assert summary["heldout_tasks"] >= 4
    assert summary["train_steps"] >= 1
    assert 0 < summary["wall_seconds"] < 600
    assert summary["max_staleness_seen"] >= 0 and summary["dropped_stale_tokens"] >= 0
    assert summary["infra_error_attempts"] >= 0
    # every attempt can be inspected afterwards, with per-token versions
    rows = [json.loads(line) for line in (out / "run" / "trajectories.jsonl").read_text().splitlines()]
    assert rows and all(len(s["versions"]) == len(s["token_ids"]) for r in rows for s in r["samples"])
    versions = {v for r in rows for s in r["samples"] for v in s["versions"] if v >= 0}
    assert len(versions) >= 2, "tokens after a weight swap must carry the new version"
    assert (out / "run" / "metrics.jsonl").is_file()
