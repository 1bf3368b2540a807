"""`albatross bench gpu`: its FLOP counting, and the one-line refusal on a machine without CUDA."""

from __future__ import annotations

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


def test_peak_flops_lookup() -> None:
    assert peak_flops("NVIDIA H200", 0.0) == 989e12
    assert peak_flops("NVIDIA L4", 0.0) == 121e12 and peak_flops("NVIDIA L40S", 0.0) == 362e12
    assert peak_flops("Some GPU", 0.0) is None and peak_flops("Some GPU", 100.0) == 100e12


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the bench would run")
def test_without_cuda_it_exits_2_with_one_line(tmp_path) -> None:
    code = "import sys; from albatross.cli import main; sys.exit(main())"
    out = subprocess.run([sys.executable, "-c", code, "bench", "gpu", "--json", str(tmp_path / "gpu.json")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a CUDA GPU" in lines[0], out.stderr
    assert not (tmp_path / "gpu.json").exists()
