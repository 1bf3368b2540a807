"""`albatross bench learn --quick`: every loss and advantage variant learns the sanity family from the reward alone,
on-policy; the same run fails when the advantage's sign is flipped or the trainer scores tokens at a temperature
other than the sampler's."""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys

import pytest

from albatross.bench import learn


@pytest.fixture(scope="module")
def warm() -> learn.Workload:
    import torch

    torch.set_num_threads(1)
    base = learn.Workload(0)
    learn.warm_start(base, random.Random(0))
    return base


def quick_args() -> argparse.Namespace:
    return argparse.Namespace(quick=True, steps=0, seed=0, temperature=0.8, lr=3e-3, json=None)


def test_every_row_learns_on_policy(warm):
    data = learn.measure(quick_args(), base=warm)
    assert [r["name"] for r in data["rows"]] == [f"{loss}/{adv}" for loss, adv in learn.ROWS]
    for row in data["rows"]:
        assert row["start_pass"] <= 0.2, row  # the warm start names the right word only by chance
        assert row["end_pass"] >= learn.LEARNED, row
    assert data["all_learn"] and data["all_on_policy"]


def test_a_flipped_advantage_sign_does_not_learn(warm, monkeypatch):
    from albatross.rl import advantages

    grpo = advantages.ADVANTAGES["grpo"]

    def flipped(scores, successes, **knobs):
        adv, metrics = grpo(scores, successes, **knobs)
        return [-a for a in adv], metrics

    monkeypatch.setitem(advantages.ADVANTAGES, "grpo", flipped)
    data = learn.measure(quick_args(), rows=(("tis", "grpo"),), base=warm)
    assert not data["all_learn"]
    assert data["rows"][0]["end_pass"] <= data["rows"][0]["start_pass"]


def test_a_ratio_at_the_wrong_temperature_is_caught(warm, monkeypatch):
    from albatross.trainer import step

    monkeypatch.setattr(step, "sampling_temperature", lambda temperature: 1.0)  # the sampler runs at 0.8
    data = learn.measure(quick_args(), rows=(("tis", "grpo"),), base=warm)
    assert not data["all_on_policy"]
    assert data["rows"][0]["mismatch_kl"] > learn.ON_POLICY_KL


def test_the_command_writes_its_json(tmp_path):
    out = tmp_path / "learn.json"
    r = subprocess.run([sys.executable, "-m", "albatross.cli", "bench", "learn", "--quick", "--steps", "2",
                        "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(out.read_text())
    assert set(data) >= {"rows", "all_learn", "all_on_policy"}
    assert {"name", "start_pass", "end_pass", "steps", "seconds"} <= set(data["rows"][0])
    assert "all_learn" in r.stdout
