"""`albatross bench recipe --quick`: every claim of the recipe measured by real runs, at the smallest size."""

import json
import math
import subprocess
import sys

import pytest

from albatross.bench.loop import QUICK_OVERRIDES
from albatross.bench.recipe import REQUIRED_KEYS
from albatross.sandbox import local_available

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not local_available(), reason="needs root, namespaces and overlayfs")]


def _share(x):
    return x is None or (isinstance(x, float | int) and 0.0 <= x <= 1.0)


def test_bench_recipe_quick_writes_every_key_in_range(tmp_path):
    path = tmp_path / "bench_recipe.json"
    tiny = [arg for kv in QUICK_OVERRIDES + ["eval.trials=2"] for arg in ("--set", kv)]  # bench loop's warm start
    # 10 tasks x 4 attempts: the fault injector's seeded draws fail 2 of the first 40 forks
    # --loop-minutes 0: bench loop's part is its own test (test_bench_loop.py)
    cmd = [sys.executable, "-m", "albatross.cli", "bench", "recipe", "--quick", "--minutes", "0.15",
           "--loop-minutes", "0", "--probe-tasks", "10", *tiny, "--out", str(tmp_path / "out")]
    proc = subprocess.run([*cmd, "--json", str(path)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(path.read_text())
    assert [k for k in REQUIRED_KEYS if k not in data] == []
    assert data["quick"] is True and data["seeds"] == 1
    for key in ("zero_signal_unfiltered", "zero_signal_filtered", "infra_group_loss_without_retries",
                "infra_group_loss_with_retries", "tis_truncated_token_share", "rl_pass_at_1",
                "sft_control_pass_at_1"):
        assert _share(data[key]), (key, data[key])
    assert data["zero_signal_unfiltered"] is not None and data["rl_pass_at_1"] is not None
    assert data["infra_group_loss_with_retries"] <= 0.005  # 10% of forks fail; 3 retries recover them
    assert data["infra_group_loss_without_retries"] >= data["infra_group_loss_with_retries"]
    assert sum(data["infra"]["without"]["faults"].get(k, 0) for k in ("fork_failed", "sandbox_died")) > 0
    assert len(data["rl_pass_at_1_by_seed"]) == 1 and len(data["sft_control_pass_at_1_by_seed"]) == 1
    assert data["runs"]["sft_control"][0]["sft_steps"] > 0
    gaps = data["logprob_gap_by_staleness"]
    assert sorted(gaps, key=int) == [str(s) for s in range(7)]
    assert gaps["0"] is not None and all(v is None or 0.0 <= v < 5.0 for v in gaps.values())
    assert data["entropy_by_step"] and len(data["entropy_by_step"]) == len(data["mismatch_kl_by_step"])
    assert all(math.isfinite(x) and x >= 0 for x in data["entropy_by_step"] + data["mismatch_kl_by_step"])
    assert data["harness_cost_reduction"] is None or -1.0 < data["harness_cost_reduction"] < 1.0
    assert data["harness"]["unfair"] == []  # equal display limits, one model, cached tokens priced as cached
    assert data["tokens_per_solve_ratio"] is None or data["tokens_per_solve_ratio"] > 0
    assert data["async_vs_sync_steps_per_hour"] is None and data["loop"] == {}  # skipped, and said so
    assert any("--loop-minutes 0" in note for note in data["notes"])
    assert (tmp_path / data["stability_plot"]).is_file()
    # the demo config's reward-only families: RL vs SFT on them and on the warm-started ones, two rows more
    assert data["rl_pass_at_1_reward_only"] is not None and _share(data["sft_control_pass_at_1_reward_only"])
    assert len(data["table"]) == 11 and all(len(row) == 3 for row in data["table"])
    assert any(row[0].startswith("held-out Pass@1 of the reward-only families") for row in data["table"])
    assert "quick: a smoke test" in " ".join(data["notes"])
    assert "albatross bench recipe --quick" in proc.stdout
    # the same command again on the same --out: every part is reused, not measured again
    again = subprocess.run([*cmd, "--json", str(tmp_path / "again.json")], capture_output=True, text=True,
                           timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    reused = sorted(p.stem for p in (tmp_path / "out" / "parts").glob("*.json"))
    assert reused == ["base", "harness", "infra", "logprob_gaps", "seed0", "zero_signal"]
    assert all(f"[recipe] {name}: reusing" in again.stdout for name in reused)
    second = json.loads((tmp_path / "again.json").read_text())
    for key in REQUIRED_KEYS:
        assert second[key] == data[key], key
