"""GPU: trainer tokens/s/GPU and MFU at 8K and 32K tokens, engine tokens/s (built-in, vLLM), ~0.5B Qwen3.

One prepared command for a CUDA machine: a Qwen3 with Qwen3-0.6B's shape and random weights (nothing downloaded)
trains on packed agent-like samples (log-normal lengths, observations masked out of the loss) through the albatross
``Trainer`` on one GPU (bf16 autocast, fp32 master weights, activation checkpointing), with micro-batches of 8K
and 32K tokens. Model FLOPs per step = 6 x (matmul parameters) x tokens + 6 x layers x attention width x sum of
squared document lengths (causal attention, forward and backward); MFU = those FLOPs per second over the GPU's
dense bf16 peak (``--peak-tflops``, or a table of known GPUs). Then the same model serves closed-loop clients from
the built-in engine on the GPU and, when ``albatross engines install vllm`` was run, from a vLLM server launched
by ``make_engine``. Without CUDA the command stops with one line, exit code 2.
"""

from __future__ import annotations

import argparse
import math
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from albatross.bench.common import print_table, write_json
from albatross.errors import UserError

QWEN3_05B = {"vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
             "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
             "tie_word_embeddings": True, "rope_theta": 1000000.0}  # the shape of Qwen3-0.6B
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "B200": 2250.0, "A100": 312.0, "A800": 312.0,
                    "L40S": 362.0, "L4": 121.0, "A10": 125.0, "RTX 4090": 165.0}  # dense, per GPU
TOKEN_BUDGETS = (8192, 32768)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="one timed step per size, fewer engine requests")
    parser.add_argument("--peak-tflops", type=float, default=0.0,
                        help="dense bf16 peak of one GPU for MFU (default: looked up from the GPU's name)")
    parser.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=None,
                        help="also measure a vLLM server (default: when `albatross engines install vllm` was run)")


def matmul_params(cfg: dict[str, Any]) -> int:
    """Weights that multiply every token: attention and MLP projections of each layer and the LM head (the
    input embedding is a lookup; norms are negligible)."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * cfg["intermediate_size"]
    return layers * per_layer + cfg["vocab_size"] * h


def train_flops(cfg: dict[str, Any], doc_lengths: list[int]) -> float:
    """Model FLOPs of one training step (forward + backward, no recomputation) over documents of these lengths:
    6 N T for the matmuls plus 6 x layers x (heads x head_dim) x L^2 per document for causal attention
    (QK^T and AV, 2 L^2 d each, half of it masked)."""
    attn = cfg["num_hidden_layers"] * cfg["num_attention_heads"] * cfg["head_dim"]
    return 6.0 * matmul_params(cfg) * sum(doc_lengths) + 6.0 * attn * sum(n * n for n in doc_lengths)


def peak_flops(name: str, explicit_tflops: float) -> float | None:
    """Dense bf16 FLOP/s of one GPU: ``--peak-tflops`` or the table entry whose key is in the device name."""
    if explicit_tflops > 0:
        return explicit_tflops * 1e12
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key in name:
            return PEAK_BF16_TFLOPS[key] * 1e12
    return None


def require_cuda() -> str:
    """The GPU's name; a one-line ``UserError`` (exit code 2) on a machine without CUDA."""
    import torch

    if not torch.cuda.is_available():
        raise UserError("bench gpu: needs a CUDA GPU (torch sees none on this machine); the CPU figures are in "
                        "`albatross bench trainer` and `albatross bench engine`")
    return torch.cuda.get_device_name(0)


def build_model(device: str = "cuda") -> Any:
    """The random ~0.5B Qwen3 (seed 0, fp32 master weights) on ``device``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**QWEN3_05B, attn_implementation="sdpa")).to(device)


def save_model(directory: Path) -> Path:
    """The same model in bf16 as a checkpoint directory, for the engines."""
    import torch

    build_model("cpu").to(torch.bfloat16).save_pretrained(directory, safe_serialization=True)
    return directory


def packed_batch(budget: int, rng: random.Random) -> tuple[Any, list[int]]:
    """Agent-like samples (log-normal lengths, median 2K tokens, up to ``budget``) filling about 4 micro-batches
    of ``budget`` tokens; returns (batch, document lengths)."""
    from albatross.bench.trainer import synthetic_batch

    lengths: list[int] = []
    while sum(lengths) < 4 * budget * 0.9:
        lengths.append(min(max(int(rng.lognormvariate(math.log(2048), 1.0)), 256), budget))
    return synthetic_batch(lengths, QWEN3_05B["vocab_size"]), lengths


def trainer_figures(budget: int, steps: int, peak: float | None) -> dict[str, Any]:
    """tokens/s/GPU, MFU and peak memory of ``Trainer.step`` with ``budget``-token micro-batches."""
    import torch

    from albatross.trainer.step import Trainer

    model = build_model()
    trainer = Trainer(model, micro_batch_tokens=budget, precision="bf16", activation_checkpointing=True, lr=1e-5)
    batch, lengths = packed_batch(budget, random.Random(budget))
    trainer.step(batch)  # warm-up
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        trainer.step(batch)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    best = min(seconds)
    flops = train_flops(QWEN3_05B, lengths)
    out = {"tokens": sum(lengths), "documents": len(lengths), "step_seconds": best,
           "tokens_per_s_per_gpu": sum(lengths) / best, "tflops_per_s": flops / best / 1e12,
           "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30}
    out["mfu"] = flops / best / peak if peak else None
    del trainer, model
    torch.cuda.empty_cache()
    return out


def engine_rate(engine: Any, requests: int, concurrency: int) -> float:
    """Generated tokens/s of ``concurrency`` closed-loop clients, prompts of 512-2048 random tokens, 256 out."""
    from albatross.bench.engine import builtin_submit, closed_loop, remote_submit

    rng = random.Random(0)
    vocab = QWEN3_05B["vocab_size"]
    prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(512, 2049))] for _ in range(requests)]
    submit = builtin_submit(engine) if hasattr(engine, "scheduler") else remote_submit(engine, seeded=False)
    seconds, tokens = closed_loop(submit, prompts, [256] * requests, concurrency)
    return tokens / seconds


def engine_figures(model_dir: Path, requests: int, with_vllm: bool) -> dict[str, Any]:
    """Built-in engine on the GPU, then (``with_vllm``) a vLLM server on GPU 0, same requests, 64 clients."""
    import torch

    from albatross.bench.engine import vllm_engine
    from albatross.engine.builtin import BuiltinEngine

    out: dict[str, Any] = {}
    with BuiltinEngine(str(model_dir), device="cuda", dtype=torch.bfloat16, max_batch_size=64) as eng:
        out["builtin_tokens_per_s"] = engine_rate(eng, requests, 64)
    if with_vllm:
        with tempfile.TemporaryDirectory(prefix="albatross-bench-gpu-") as tmp:
            engine = vllm_engine(model_dir, 1, Path(tmp), gpu_memory_utilization=0.6)
            try:
                out["vllm_tokens_per_s"] = engine_rate(engine, requests, 64)
            finally:
                engine.close()
        out["vllm_vs_builtin"] = out["vllm_tokens_per_s"] / out["builtin_tokens_per_s"]
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from albatross.bench.engine import want_vllm

    name = require_cuda()
    quick = bool(getattr(args, "quick", False))
    peak = peak_flops(name, float(getattr(args, "peak_tflops", 0.0) or 0.0))
    results: dict[str, Any] = {"gpu": name, "model": QWEN3_05B, "matmul_params": matmul_params(QWEN3_05B),
                               "peak_bf16_tflops": peak / 1e12 if peak else None}
    for budget in TOKEN_BUDGETS:
        results[f"trainer_{budget // 1024}k"] = trainer_figures(budget, 1 if quick else 3, peak)
    with tempfile.TemporaryDirectory(prefix="albatross-bench-gpu-model-") as tmp:
        results["engine"] = engine_figures(save_model(Path(tmp)), 64 if quick else 256, want_vllm(getattr(args, "vllm", None)))
    rows = [(k, v) for k, v in results.items() if not isinstance(v, dict)]
    rows += [(f"{k}.{f}", v) for k, figs in results.items() if isinstance(figs, dict) and k != "model"
             for f, v in figs.items()]
    print_table("albatross bench gpu", rows)
    write_json(getattr(args, "json", None), results)
    return results
