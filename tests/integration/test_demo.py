"""`albatross demo --quick` end to end, as a user runs it, on bench loop's tiny task set (16 training tasks, a
60-step warm start, groups of 4): the warm start of the default quick settings (240 tasks) alone took minutes of
every CI run; this one is built once and shared with the other tests of the demo (``demo_cache``)."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from albatross.pipeline.summary import SUMMARY_KEYS
from albatross.sandbox import local_available
from demo_util import TINY_DEMO_ARGS


@pytest.mark.slow
@pytest.mark.skipif(not local_available(), reason="needs root, namespaces and overlayfs")
def test_demo_quick(tmp_path, demo_cache):
    out = tmp_path / "out"
    env = {**os.environ, "ALBATROSS_CACHE": str(demo_cache)}
    r = _run_timed([sys.executable, "-m", "albatross.cli", "demo", "--quick", "--out", str(out), *TINY_DEMO_ARGS],
                   env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "[warm-start]" in r.stdout and "[train] step" in r.stdout and "[eval]" in r.stdout
    # progress a person can plan by: an ETA within 10 seconds, and every phase says why it stopped
    first_eta = next(t for t, line in r.lines if line.startswith("[plan]") and " eta " in line)
    assert first_eta < 10, r.stdout[:2000]
    for phase in ("tasks", "sandbox", "warm-start", "base eval", "train", "trained eval", "report"):
        assert any(line.startswith(f"[{phase}] stopped: ") for _t, line in r.lines), phase
    train_stop = next(line for _t, line in r.lines if line.startswith("[train] stopped: "))
    assert "max_steps" in train_stop or "max_minutes" in train_stop, train_stop
    assert any(line.startswith("[train] step") and " eta " in line for _t, line in r.lines)
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
    _check_final(out, rows, summary, env)


def _check_final(out, rows, summary, env) -> None:
    """``<out>/final`` loads with transformers' Auto classes, gives the ids the run trained on, stops at the end of
    a turn, and ``albatross eval --model <out>/final`` on the run's held-out tasks gives the run's figure."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    final = out / "final"
    tokenizer = AutoTokenizer.from_pretrained(final)
    AutoModelForCausalLM.from_pretrained(final)
    first = rows[0]
    instruction = (out / "tasks" / "train" / first["task_id"] / "instruction.md").read_text()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": instruction}], tokenize=True,
                                           add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    assert first["samples"][0]["token_ids"][: len(prompt)] == prompt
    assert tokenizer.convert_tokens_to_ids("<|end|>") in GenerationConfig.from_pretrained(final).eos_token_id
    trials = json.loads((out / "config.json").read_text())["eval"]["trials"]
    r = subprocess.run([sys.executable, "-m", "albatross.cli", "eval", "--model", str(final), "--tasks",
                        str(out / "tasks" / "heldout"), "--config", str(out / "config.json"), "--trials", str(trials),
                        "--out", str(out / "eval-final")], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    again = json.loads((out / "eval-final" / "summary.json").read_text())
    # the run's own evaluation again (its config: eval.seed), from <out>/final: the same attempts
    ran = {(a["task_id"], a["attempt"]): a["samples"][0]["token_ids"]
           for a in map(json.loads, (out / "eval_trained.jsonl").read_text().splitlines())}
    now = {(a["task_id"], a["attempt"]): a["samples"][0]["token_ids"]
           for a in map(json.loads, (out / "eval-final" / "attempts.jsonl").read_text().splitlines())}
    same = sum(ran[k] == now.get(k) for k in ran)
    print("final:", again["pass_at_1"], "run:", summary["trained_pass_at_1"], "+/-", summary["trained_pass_at_1_se"],
          f"{same} of {len(ran)} attempts token for token the same")
    assert ran.keys() == now.keys() and same >= len(ran) - 1  # (a rare float tie may flip one)
    assert abs(again["pass_at_1"] - summary["trained_pass_at_1"]) <= (summary["trained_pass_at_1_se"] or 0.0) + 1e-9


def _run_timed(cmd: list[str], env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``cmd``; the result also has ``lines``: (seconds since the start, line) of its stdout."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.append(proc.stderr.read()), daemon=True)
    reader.start()
    lines = []
    for line in proc.stdout:
        lines.append((time.monotonic() - t0, line.rstrip("\n")))
        if time.monotonic() - t0 > timeout:
            proc.kill()
    proc.wait(timeout=60)
    reader.join(timeout=60)
    r = subprocess.CompletedProcess(cmd, proc.returncode, "\n".join(line for _t, line in lines), "".join(err))
    r.lines = lines
    return r
