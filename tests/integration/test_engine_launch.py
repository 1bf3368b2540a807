"""``make_engine``: the engine of a run config. Built-in (one engine, in-process replicas, ``albatross serve``
processes), attached to ``albatross serve`` by ``engine.urls``, and SGLang servers launched, supervised and stopped
(the fake SGLang of tests/unit/test_engine_remote.py, run as ``python -m sglang.launch_server``), with weights
pushed over the filesystem and over SGLang's weight-update group (gloo here; NCCL on GPUs)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from albatross.config import ConfigError, EngineConfig, RunConfig
from albatross.engine import BuiltinEngine, SamplingParams
from albatross.engine.base import EngineError
from albatross.engine.launch import has_cuda, make_engine, read_endpoints
from albatross.engine.pool import EnginePool

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))
from test_engine_remote import fake_sglang_package  # noqa: E402 - the SGLang protocol double

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
PROMPTS = [[3, 4, 5], [6, 7]]


def run_config(**engine: object) -> RunConfig:
    return RunConfig(engine=EngineConfig(**engine))


def perturbed(model_dir: Path, root: Path, version: int, scale: float = 0.5) -> Path:
    """Version ``version`` of the weights: the model plus noise, exported as the trainer exports it."""
    from albatross.trainer.checkpoint import export_weights
    from albatross.trainer.model import load_model

    model = load_model(model_dir)
    gen = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return export_weights(model, root, version)


def reference(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    with BuiltinEngine(str(path)) as engine:
        return [c.token_ids for c in engine.generate(prompts, GREEDY)]


def gone(pids: list[int]) -> bool:
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{p}").exists() for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(Path(f"/proc/{p}").exists() for p in pids)


def test_builtin_one_engine_and_in_process_replicas(tiny_model_dir: Path, tmp_path: Path) -> None:
    want = reference(tiny_model_dir, PROMPTS)
    with make_engine(run_config(), tiny_model_dir, tmp_path, log=lambda _: None) as one:
        assert isinstance(one, BuiltinEngine) and one.version == 0
        assert [c.token_ids for c in one.generate(PROMPTS, GREEDY)] == want
    pool = make_engine(run_config(replicas=2), tiny_model_dir, tmp_path, log=lambda _: None)
    try:
        assert isinstance(pool, EnginePool) and len(pool.replicas) == 2
        assert [c.token_ids for c in pool.generate(PROMPTS, GREEDY)] == want
        v3 = perturbed(tiny_model_dir, tmp_path / "weights", 3)
        pool.update_weights(str(v3), 3)
        out = pool.generate(PROMPTS, GREEDY)
        assert pool.version == 3 and all(set(c.versions) == {3} for c in out)
        assert [c.token_ids for c in out] == reference(v3, PROMPTS)
    finally:
        pool.close()


def test_builtin_replica_processes_are_stopped_with_the_engine(tiny_model_dir: Path, tmp_path: Path) -> None:
    pool = make_engine(run_config(replicas=2, process=True), tiny_model_dir, tmp_path, log=lambda _: None)
    pids = list(pool.pids().values())
    try:
        assert len(pids) == 2 and all(Path(f"/proc/{p}").exists() for p in pids)
        assert sorted((tmp_path / "logs").iterdir()) == [tmp_path / "logs" / f"engine-{i}.log" for i in (0, 1)]
        assert [c.token_ids for c in pool.generate(PROMPTS, GREEDY)] == reference(tiny_model_dir, PROMPTS)
    finally:
        pool.close()
    assert gone(pids), "a replica process outlived close()"


def start_albatross_serve(model_dir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "albatross.cli", "serve", str(model_dir), "--port", "0"],
                            stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        for line in log.read_text().splitlines():
            if line.startswith("albatross serve: ") and " on http" in line:
                return proc, line.rsplit(" on ", 1)[1].strip()
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"albatross serve did not start:\n{log.read_text()[-2000:]}")


def test_attach_to_a_server_by_url_never_stops_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    proc, url = start_albatross_serve(tiny_model_dir, tmp_path / "serve.log")
    try:
        pool = make_engine(run_config(urls=[url + "/"]), tiny_model_dir, tmp_path / "run", log=lambda _: None)
        try:
            assert pool.urls() == [url] and read_endpoints(tmp_path / "run")["urls"] == [url]
            with pool.session() as s:  # an attempt's turns
                first = s.generate([PROMPTS[0]], GREEDY)[0]
                assert first.token_ids == reference(tiny_model_dir, PROMPTS[:1])[0]
            v1 = perturbed(tiny_model_dir, tmp_path / "weights", 1)
            pool.update_weights(str(v1), 1)
            out = pool.generate(PROMPTS, GREEDY)
            assert pool.version == 1 and all(set(c.versions) == {1} for c in out)
            assert [c.token_ids for c in out] == reference(v1, PROMPTS)
        finally:
            pool.close()
        assert proc.poll() is None, "closing an attached engine stopped a server albatross did not start"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


@pytest.fixture
def fake_sglang(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = fake_sglang_package(tmp_path / "fake-sglang")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))


def test_launched_sglang_servers_serve_reload_restart_and_stop(fake_sglang, tiny_model_dir: Path,
                                                               tmp_path: Path) -> None:
    logs: list[str] = []
    cfg = run_config(type="sglang", python=sys.executable, replicas=2, start_timeout_s=120)
    pool = make_engine(cfg, tiny_model_dir, tmp_path / "run", log=logs.append)
    pids = list(pool.pids().values())
    try:
        assert len(pids) == 2 and len(set(pool.urls())) == 2
        assert read_endpoints(tmp_path / "run") == {"type": "sglang", "weight_sync": "filesystem",
                                                    "urls": pool.urls()}
        assert [c.token_ids for c in pool.generate(PROMPTS, GREEDY)] == reference(tiny_model_dir, PROMPTS)
        v1 = perturbed(tiny_model_dir, tmp_path / "weights", 1)
        pool.update_weights(str(v1), 1)  # filesystem: /update_weights_from_disk
        sessions = [pool.session(), pool.session()]
        assert {s.index for s in sessions} == {0, 1}  # least loaded: one attempt on each server
        outs = [s.generate([PROMPTS[0]], GREEDY)[0] for s in sessions]
        assert all(o.versions == [1] * 6 and o.token_ids == reference(v1, PROMPTS[:1])[0] for o in outs)
        for s in sessions:
            s.close()

        os.kill(pids[0], signal.SIGKILL)  # a server dies: the pool starts it again with version 1
        deadline = time.monotonic() + 120
        while pool.restarts < 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert pool.restarts == 1 and pool.pids()["engine0"] != pids[0], logs
        assert read_endpoints(tmp_path / "run")["urls"] == pool.urls()  # rewritten for the weight transport
        with pool.session() as s, pool.session() as t:
            assert {s.index, t.index} == {0, 1}
            assert all(x.generate([PROMPTS[0]], GREEDY)[0].versions == [1] * 6 for x in (s, t))
        pids = list(pool.pids().values())
    finally:
        pool.close()
    assert gone(pids), "a launched server outlived close()"
    assert sorted(p.name for p in (tmp_path / "run" / "logs").iterdir()) == ["sglang-0.log", "sglang-1.log"]


def test_weights_pushed_over_sglangs_weight_update_group(fake_sglang, tiny_model_dir: Path, tmp_path: Path) -> None:
    """The ``nccl`` sender's protocol, with gloo on CPU: every server joins the group, receives each tensor
    broadcast from rank 0, and labels the later tokens with the new version; the pool's version follows."""
    from albatross.engine.remote import HTTPClient
    from albatross.trainer.model import load_model
    from albatross.trainer.weights.nccl import NCCLSender

    cfg = run_config(type="sglang", python=sys.executable, replicas=2, start_timeout_s=120)
    pool = make_engine(cfg, tiny_model_dir, tmp_path / "run", log=lambda _: None)
    sender = NCCLSender("sglang", tmp_path / "run", backend="gloo", device="cpu", dtype="float32", names="unique",
                        bucket_bytes=16 << 10)
    try:
        for version in (1, 2):
            path = perturbed(tiny_model_dir, tmp_path / "weights", version)
            locator = sender.send(load_model(path), version)
            assert locator == ""
            pool.update_weights(locator, version)
            with pool.session() as s, pool.session() as t:
                outs = [x.generate([PROMPTS[1]], GREEDY)[0] for x in (s, t)]
            assert pool.version == version and all(o.versions == [version] * 6 for o in outs)
            assert all(o.token_ids == reference(path, PROMPTS[1:])[0] for o in outs)
        record = HTTPClient(pool.urls()[0]).call("GET", "/_record")[1]
    finally:
        sender.close()
        pool.close()
    calls, bodies = record["calls"], record["bodies"]
    first = calls.index("/pause_generation")
    updates = calls[first:].index("/continue_generation") - 1
    assert updates >= 2 and calls[first:first + updates + 2] == [  # paused around the buckets of one version
        "/pause_generation", *["/update_weights_from_distributed"] * updates, "/continue_generation"]
    assert bodies[first] == {"mode": "retract"}  # running requests recompute their KV with the new weights
    sent = bodies[first + 1:first + 1 + updates]
    assert [b["flush_cache"] for b in sent] == [False] * (updates - 1) + [True]  # cache flushed once, at the end
    assert [b.get("weight_version") for b in sent] == [None] * (updates - 1) + ["1"]
    assert sum(len(b["names"]) for b in sent) == len(load_model(tiny_model_dir).state_dict()) - 1  # tied head once


def test_unusable_engine_configs_are_one_line_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ALBATROSS_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("ALBATROSS_VLLM_PYTHON", raising=False)
    with pytest.raises(ConfigError, match="engine.weight_sync: nccl needs engine.type vllm or sglang"):
        make_engine(run_config(weight_sync="nccl"), tmp_path, tmp_path)
    with pytest.raises(ConfigError, match=r"engine.type: sglang is not installed: run `albatross engines install"):
        make_engine(run_config(type="sglang"), tmp_path, tmp_path)
    with pytest.raises(ConfigError, match="engine.python: /nowhere/python does not exist"):
        make_engine(run_config(type="vllm", python="/nowhere/python"), tmp_path, tmp_path)
    with pytest.raises(ConfigError, match="engine.process: only for engine.type builtin"):
        make_engine(run_config(type="vllm", process=True), tmp_path, tmp_path)
    if not has_cuda():
        with pytest.raises(ConfigError, match="nccl needs CUDA GPUs and this machine has none"):
            make_engine(run_config(type="vllm", weight_sync="nccl"), tmp_path, tmp_path)


@pytest.mark.skipif(has_cuda(), reason="SGLang installs on a GPU machine")
def test_engines_install_sglang_without_a_gpu_exits_2(tmp_path: Path) -> None:
    env = {**os.environ, "ALBATROSS_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "albatross.cli", "engines", "install", "sglang"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out
    assert out.stderr.count("\n") == 1 and "SGLang needs an NVIDIA GPU" in out.stderr
    assert not (tmp_path / "sglang-venv").exists()


def test_a_server_that_exits_while_starting_is_an_engine_error(fake_sglang, tmp_path: Path) -> None:
    cfg = run_config(type="sglang", python=sys.executable, start_timeout_s=60, extra_args=["--no-such-flag"])
    (tmp_path / "model").mkdir()
    with pytest.raises(EngineError, match="exited with code 2 while starting"):
        make_engine(cfg, tmp_path / "model", tmp_path / "run", log=lambda _: None)
    assert "unrecognized arguments: --no-such-flag" in (tmp_path / "run" / "logs" / "sglang-0.log").read_text()


def test_vllm_serves_a_tied_checkpoint_from_an_untied_copy(tiny_model_dir: Path, tmp_path: Path) -> None:
    from albatross.engine.launch import served_model_dir, sglang_command, vllm_command
    from albatross.engine.remote import tied_without_lm_head

    assert tied_without_lm_head(tiny_model_dir)
    copy = served_model_dir("vllm", tiny_model_dir, tmp_path)
    assert copy == tmp_path / "engine-model" and not tied_without_lm_head(copy)
    assert tied_without_lm_head(tiny_model_dir)  # the original is untouched
    assert served_model_dir("sglang", tiny_model_dir, tmp_path) == tiny_model_dir
    ec = EngineConfig(type="vllm", max_model_len=512, extra_args=["--seed", "3"], gpu_memory_utilization=0.5)
    cmd = vllm_command(ec, copy, "/py", 8123, cuda=False)
    assert cmd[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"] and cmd[-2:] == ["--seed", "3"]
    assert "--enable-scale-out" in cmd and cmd[cmd.index("--dtype") + 1] == "float32"
    assert "--gpu-memory-utilization" not in cmd  # no GPU: the flag would be refused
    gpu = sglang_command(ec, copy, "/py", 8123, cuda=True)
    assert gpu[gpu.index("--dtype") + 1] == "auto" and gpu[gpu.index("--mem-fraction-static") + 1] == "0.5"


def test_the_filesystem_sender_exports_what_the_engine_reloads(tiny_model_dir: Path, tmp_path: Path) -> None:
    from albatross.trainer.model import load_model
    from albatross.trainer.weights import make_weight_sender

    sender = make_weight_sender(run_config(), tmp_path / "weights", tmp_path)
    assert sender.name == "filesystem"
    model = load_model(perturbed(tiny_model_dir, tmp_path / "elsewhere", 4))
    locator = sender.send(model, 4)
    assert Path(locator) == tmp_path / "weights" / "v000004" and (tmp_path / "weights" / "LATEST").read_text() == "4\n"
    with BuiltinEngine(str(tiny_model_dir)) as engine:
        engine.update_weights(locator, 4)
        out = engine.generate(PROMPTS, GREEDY)
    assert [c.token_ids for c in out] == reference(Path(locator), PROMPTS) and out[0].versions == [4] * 6
    with pytest.raises(ConfigError, match="nccl needs engine.type vllm or sglang"):
        make_weight_sender(run_config(weight_sync="nccl"), tmp_path / "weights", tmp_path)
