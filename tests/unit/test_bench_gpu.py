"""`albatross bench gpu`: its FLOP counting, and the one-line refusal on a machine without CUDA."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from albatross.bench.gpu import QWEN3_05B, matmul_params, peak_flops, train_flops

TINY = {**QWEN3_05B, "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 128}


def tiny_model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**TINY, attn_implementation="eager")).eval()


def test_matmul_params_are_the_linear_weights_of_the_model() -> None:
    model = tiny_model()
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert matmul_params(TINY) == linear


def test_flops_match_torchs_count_of_the_forward() -> None:
    """torch's FLOP counter on one forward over L tokens: the matmuls are 2 N L, and eager attention's two
    batched matmuls 4 L^2 d per layer (it computes the masked half too); a training step is 3x the forward
    and causal attention needs half of those attention FLOPs."""
    from torch.utils.flop_counter import FlopCounterMode

    length = 40
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        tiny_model()(torch.randint(0, 96, (1, length)))
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    linear = sum(n for op, n in counts.items() if "mm" in op and "bmm" not in op)
    attention = sum(n for op, n in counts.items() if "bmm" in op)
    assert linear == 2 * matmul_params(TINY) * length
    assert train_flops(TINY, [length]) == pytest.approx(3 * (linear + attention / 2))


def test_attention_flops_grow_with_the_square_of_each_document() -> None:
    one, two = train_flops(TINY, [64]), train_flops(TINY, [32, 32])
    attn = TINY["num_hidden_layers"] * TINY["num_attention_heads"] * TINY["head_dim"]
    assert one - two == pytest.approx(6 * attn * (64**2 - 2 * 32**2))


def test_peak_flops_per_gpu_model() -> None:
    """Dense bf16 peaks of the data sheets, by the names torch reports: the SXM and PCIe parts of one chip differ."""
    assert peak_flops("NVIDIA H100 80GB HBM3", 0.0) == 989e12  # SXM
    assert peak_flops("NVIDIA H100 PCIe", 0.0) == 756e12
    assert peak_flops("NVIDIA H100 NVL", 0.0) == 835e12
    assert peak_flops("NVIDIA H200", 0.0) == 989e12 and peak_flops("NVIDIA H200 NVL", 0.0) == 835e12
    assert peak_flops("NVIDIA B200", 0.0) == 2250e12 and peak_flops("NVIDIA GB200", 0.0) == 2500e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", 0.0) == 312e12 and peak_flops("NVIDIA A100 80GB PCIe", 0.0) == 312e12
    assert peak_flops("NVIDIA A10", 0.0) == 125e12  # not the A100's
    assert peak_flops("NVIDIA L4", 0.0) == 121e12 and peak_flops("NVIDIA L40S", 0.0) == 362e12
    assert peak_flops("Some GPU", 0.0) is None and peak_flops("Some GPU", 100.0) == 100e12


def test_the_run_takes_the_gpus_present(tmp_path) -> None:
    """One GPU: trainer and engine share it (filesystem sync: NCCL cannot put two ranks on one GPU); more: the
    engine gets the last, the trainer shards over the others with FSDP2 and vLLM takes the weights over NCCL."""
    from albatross.bench.gpu import RL_STEPS, gpu_split, run_config

    assert gpu_split(1) == (1, 0) and gpu_split(2) == (1, 1) and gpu_split(8) == (7, 7)
    (tmp_path / "model").mkdir()
    one = run_config(tmp_path, 1, vllm=True, sandbox="process")
    assert (one.trainer.gpus, one.engine.type, one.engine.weight_sync) == (1, "vllm", "filesystem")
    assert one.engine.gpu_memory_utilization < 0.5
    eight = run_config(tmp_path, 8, vllm=True, sandbox="local")
    assert (eight.trainer.gpus, eight.engine.weight_sync, eight.trainer.device) == (7, "nccl", "cuda")
    assert eight.orchestrator.max_steps == RL_STEPS and eight.model.path == str(tmp_path / "model")
    assert run_config(tmp_path, 2, vllm=False, sandbox="process").engine.type == "builtin"


def test_run_figures_from_the_metrics_of_a_run(tmp_path) -> None:
    from albatross.bench.gpu import run_figures

    (tmp_path / "run").mkdir()
    rows = [{"step": i, "seconds": 2.0, "input_tokens": 4000, "weight_sync_s": 0.5, "engine_tokens_per_s": 900.0 + i,
             "peak_memory_gib": 10.0 + i} for i in (1, 2)]
    (tmp_path / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    figs = run_figures(tmp_path, 100.0, params=1_000_000, peak=1e12, ranks=2)
    assert figs["steps"] == 2 and figs["trainer_tokens_per_s"] == 2000.0 and figs["weight_sync_s"] == 0.5
    assert figs["rollout_tokens_per_s"] == 902.0 and figs["trainer_peak_memory_gib"] == 12.0
    assert figs["trainer_mfu_6nt"] == pytest.approx(6 * 1e6 * 8000 / 4.0 / 2e12)
    assert run_figures(tmp_path / "none", 5.0, 1, None, 1) == {"steps": 0, "seconds": 5.0}


def test_sync_check_finds_unchanged_weights_identical_and_changed_ones_not(tiny_model_dir, tmp_path) -> None:
    """The acceptance script's sync phase on the CPU (built-in engine, filesystem): the same weights pushed back
    leave the greedy tokens as they were; other weights would not."""
    from albatross.bench.gpu import sync_figures
    from albatross.engine import BuiltinEngine
    from albatross.trainer.model import load_model

    model = load_model(tiny_model_dir)
    with BuiltinEngine(str(tiny_model_dir)) as engine:
        same = sync_figures(engine, model, tmp_path / "w", "float32")
        assert engine.version == 0  # the same weights, the same version: a run still starts from version 0
        assert same["greedy_identical_after_filesystem"] and same["filesystem_s"] >= same["filesystem_export_s"] > 0
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5 * torch.randn_like(p))
        assert not sync_figures(engine, model, tmp_path / "w", "float32", version=1)[
            "greedy_identical_after_filesystem"]
        assert engine.version == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the bench would run")
def test_without_cuda_it_exits_2_with_one_line(tmp_path) -> None:
    code = "import sys; from albatross.cli import main; sys.exit(main())"
    out = subprocess.run([sys.executable, "-c", code, "bench", "gpu", "--json", str(tmp_path / "gpu.json")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a CUDA GPU" in lines[0], out.stderr
    assert not (tmp_path / "gpu.json").exists()
