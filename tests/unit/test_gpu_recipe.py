"""The one-node GPU recipe (configs/gpu-node.toml) validates, and launched servers land on the GPUs after the
trainer's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from albatross.config import ConfigError, RunConfig, load_config
from albatross.engine.launch import server_gpus, trainer_gpu_count

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "gpu-node.toml"


def test_recipe_loads_with_a_model_path(tmp_path: Path) -> None:
    cfg = load_config(RECIPE, [f"model.path={tmp_path}"])
    assert cfg.model.path == str(tmp_path)
    assert (cfg.engine.type, cfg.engine.replicas, cfg.engine.dtype) == ("vllm", 4, "bfloat16")
    assert (cfg.trainer.device, cfg.trainer.gpus, cfg.trainer.precision) == ("cuda", 4, "bf16")
    assert cfg.trainer.gpus + cfg.engine.replicas == 8
    assert cfg.tasks.train and cfg.engine.max_model_len >= cfg.harness.max_context_tokens


def test_recipe_names_the_missing_model_directory() -> None:
    with pytest.raises(ConfigError, match=r"gpu-node.toml: model.path: .*does not exist"):
        load_config(RECIPE)


def test_albatross_config_validates_the_recipe(tmp_path: Path) -> None:
    cli = [sys.executable, "-c", "import sys; from albatross.cli import main; sys.exit(main())", "config",
           str(RECIPE), "--set", f"model.path={tmp_path}"]
    ok = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert '"type": "vllm"' in ok.stdout
    bad = subprocess.run(cli[:-2], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "model.path" in bad.stderr and "Traceback" not in bad.stderr


def test_servers_take_the_gpus_after_the_trainers() -> None:
    assert server_gpus(4, 4, visible="", count=8) == ["4", "5", "6", "7"]
    assert server_gpus(1, 2, visible="3,5,6", count=None) == ["5", "6"]  # indices into an inherited list
    with pytest.raises(ConfigError, match="engine.replicas: 4 server.*need 8 GPUs; this machine has 6"):
        server_gpus(4, 4, visible="", count=6)
    assert server_gpus(4, 2, visible="", count=8, per_server=2) == ["4,5", "6,7"]  # tensor parallel pairs
    assert server_gpus(0, 1, visible="2,3,5,7", per_server=4) == ["2,3,5,7"]
    with pytest.raises(ConfigError, match="x engine.tensor_parallel_size 2 .* need 10 GPUs"):
        server_gpus(4, 3, visible="", count=8, per_server=2)


def test_launched_servers_get_tensor_parallelism_and_the_sampled_logprobs() -> None:
    from albatross.config import EngineConfig
    from albatross.engine.launch import sglang_command, vllm_command

    ec = EngineConfig(type="vllm", tensor_parallel_size=2)
    vllm = vllm_command(ec, Path("/m"), "/py", 8000, cuda=True)
    assert vllm[vllm.index("--tensor-parallel-size") + 1] == "2"
    assert vllm[vllm.index("--logprobs-mode") + 1] == "processed_logprobs"  # after temperature / top-k / top-p
    sglang = sglang_command(ec, Path("/m"), "/py", 8000, cuda=True)
    assert sglang[sglang.index("--tp-size") + 1] == "2"
    assert "--tensor-parallel-size" not in vllm_command(EngineConfig(type="vllm"), Path("/m"), "/py", 8000, True)


def test_a_cpu_trainer_holds_no_gpu() -> None:
    cfg = RunConfig.model_validate({"trainer": {"device": "cpu", "gpus": 2}})
    assert trainer_gpu_count(cfg) == 0
    cfg = RunConfig.model_validate({"trainer": {"device": "cuda", "gpus": 4}})
    assert trainer_gpu_count(cfg) == 4
