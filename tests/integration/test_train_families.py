"""The seeds' hybrid MoE families through the real CLI: `albatross serve` generates with a tiny `qwen4_exp` as
transformers does, and `albatross train` runs RL steps on tiny `qwen4_exp` / `glm_moe_dsa` models from `model.path`
with routing replay on, logging the sampler-trainer mismatch KL."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from albatross.sandbox import local_available
from model_dirs import bpe_tokenizer

pytest.importorskip("transformers")
needs_sandbox = pytest.mark.skipif(not local_available(), reason="needs root, namespaces and overlayfs")


def family_dir(root: Path, family: str, seed: int = 0) -> Path:
    """``root/<family>``: a tiny random ``family`` model sized to a BPE tokenizer with a ChatML template."""
    from albatross.models.tiny import tiny_model

    tok = bpe_tokenizer("qwen")
    ids = {"vocab_size": len(tok), "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id,
           "bos_token_id": None}
    model = tiny_model(family, seed=seed, **ids)
    d = root / family
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read().decode())


def test_albatross_serve_generates_a_hybrid_family_like_transformers(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    d = family_dir(tmp_path, "qwen4_exp")
    prompt = [40, 17, 300, 301, 5, 77, 120, 9]
    model = AutoModelForCausalLM.from_pretrained(d).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):].tolist()
    proc = subprocess.Popen([sys.executable, "-m", "albatross.cli", "serve", str(d), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line, deadline = "", time.monotonic() + 180
        while "albatross serve:" not in line and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
        url = re.search(r"on (http://\S+)", line).group(1)
        body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        first = post(url + "/v1/completions", body)["choices"][0]["token_ids"]
        again = post(url + "/v1/completions", {**body, "prompt": prompt + first + [50, 51]})["usage"]
    finally:
        proc.terminate()
        code = proc.wait(timeout=30)
    assert first == want
    assert again["prompt_tokens_details"]["cached_tokens"] == len(prompt) + 15  # the first turn's snapshot
    assert code == 0


def albatross(*args: str, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "albatross.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def write_config(path: Path, model: Path, tasks: Path, out: Path) -> Path:
    path.write_text(f"""
out = "{out}"
[model]
path = "{model}"
[tasks]
train = ["{tasks / 'train'}"]
heldout = ["{tasks / 'heldout'}"]
[harness]
action_format = "bash_block"
max_turns = 3
max_tokens_per_turn = 48
max_context_tokens = 2048
[warmstart]
source = "oracle"
steps = 60
lr = 5e-3
batch_size = 8
check_every = 20
check_tasks = 8
target_pass_rate = 0.1
[orchestrator]
group_size = 4
groups_per_step = 2
max_steps = 1
max_minutes = 3.0
rollout_workers = 8
[rl]
routing_replay = true
[eval]
trials = 1
""")
    return path


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    from albatross.tasks.builtin import generate_tasks

    root = tmp_path_factory.mktemp("tasks")
    generate_tasks(root, families=["count_lines"], n_train=12, n_heldout=4, seed=3)
    return root


@pytest.mark.slow
@needs_sandbox
@pytest.mark.parametrize("family", ["qwen4_exp", "glm_moe_dsa"])
def test_train_runs_rl_steps_on_a_hybrid_moe_family_with_routing_replay(tmp_path, tasks, family) -> None:
    d = family_dir(tmp_path, family)
    out = tmp_path / "out"
    r = albatross("train", str(write_config(tmp_path / "run.toml", d, tasks, out)),
                  env={"ALBATROSS_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["train_steps"] >= 1 and summary["weight_version_final"] >= 1
    metrics = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    kls = [m["mismatch_kl"] for m in metrics if "mismatch_kl" in m]
    assert kls and all(k == k and k > -1e-6 for k in kls)  # r - log r - 1 >= 0, up to rounding
    rows = [json.loads(line) for line in (out / "run" / "trajectories.jsonl").read_text().splitlines()]
    routed = [s for row in rows for s in row["samples"] if s.get("routing")]
    assert routed, "routing replay is on: the engine recorded the experts of the sampled tokens"
    s = routed[0]
    assert all(bool(r) == bool(m) for r, m in zip(s["routing"], s["loss_mask"], strict=True))
