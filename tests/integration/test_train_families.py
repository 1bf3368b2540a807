"""The seeds' hybrid MoE families through the real CLI: `albatross serve` generates with a tiny `qwen4_exp` as
transformers does, and `albatross train` runs RL steps on tiny `qwen4_exp` / `glm_moe_dsa` models from `model.path`
(issue 16's "done when" run): exact packing, routing replay of experts and indexer selections, the MTP head trained,
and the sampler-trainer mismatch KL logged with and without replay."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from albatross.sandbox import local_available
from model_dirs import albatross, bpe_tokenizer, write_config

pytest.importorskip("transformers")
needs_sandbox = pytest.mark.skipif(not local_available(), reason="needs root, namespaces and overlayfs")


def family_dir(root: Path, family: str, seed: int = 0) -> Path:
    """``root/<family>``: a tiny random ``family`` model sized to a BPE tokenizer with a ChatML template, its MTP
    head saved in the family's checkpoint layout."""
    from albatross.models.mtp import save_pretrained_with_mtp
    from albatross.models.tiny import tiny_model

    tok = bpe_tokenizer("qwen")
    ids = {"vocab_size": len(tok), "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id,
           "bos_token_id": None}
    model = tiny_model(family, seed=seed, **ids)
    d = root / family
    save_pretrained_with_mtp(model, d)
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


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    from albatross.tasks.builtin import generate_tasks

    root = tmp_path_factory.mktemp("tasks")
    generate_tasks(root, families=["count_lines"], n_train=12, n_heldout=4, seed=3)
    return root


# the warm start's learning rate: qwen4_exp passes the 0.1 check at step 20 at 1e-2 (at 5e-3 at step 40: twice
# the SFT steps, most of this test's time); glm_moe_dsa passes it at step 40 at 5e-3 and never within 60 at 1e-2
WARM_LR = {"qwen4_exp": 1e-2, "glm_moe_dsa": 5e-3}

RUN = """
[rl]
routing_replay = true
[trainer]
mtp = "train"
"""


@pytest.mark.slow
@needs_sandbox
@pytest.mark.parametrize("family", ["qwen4_exp", "glm_moe_dsa"])
def test_train_runs_rl_steps_on_a_hybrid_moe_family_with_routing_replay(tmp_path, tasks, family) -> None:
    from albatross.models.routing import moe_routers, sparse_indexers
    from albatross.models.tiny import load_any

    d = family_dir(tmp_path, family)
    loaded = load_any(d)
    n_routers, n_indexers = len(moe_routers(loaded)), len(sparse_indexers(loaded))
    assert n_routers and n_indexers
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "run.toml", d, tasks, out, RUN, turn_tokens=48, context_tokens=2048, warm_steps=60,
                       warm_lr=WARM_LR[family], warm_batch=8, check_every=20, target_pass_rate=0.1, groups_per_step=2)
    r = albatross("train", str(cfg), env={"ALBATROSS_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["train_steps"] >= 1 and summary["weight_version_final"] >= 1
    metrics = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "mismatch_kl" in m]
    assert steps, "no RL step logged"
    for m in steps:  # r - log r - 1 >= 0, up to rounding, with and without replay
        assert all(k == k and k > -1e-6 for k in (m["mismatch_kl"], m["mismatch_kl_no_replay"]))
        assert m["mtp_tokens"] > 0 and m["mtp_loss"] > 0  # the MTP head trained on the step's tokens
    assert "kl no replay" in r.stdout
    rows = [json.loads(line) for line in (out / "run" / "trajectories.jsonl").read_text().splitlines()]
    routed = [s for row in rows for s in row["samples"] if s.get("routing")]
    assert routed, "routing replay is on: the engine recorded the experts of the sampled tokens"
    for s in routed:  # every model token: its experts per MoE router, then its keys per indexer
        assert all(bool(r) == bool(m) for r, m in zip(s["routing"], s["loss_mask"], strict=True))
        assert all(len(r) == n_routers + n_indexers for r in s["routing"] if r)
