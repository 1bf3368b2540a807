"""GPU acceptance: one command that checks and measures the GPU path end to end, in under 8 minutes.

On a machine with CUDA: a Qwen3 with Qwen3-0.6B's shape and random weights (built from a config, nothing
downloaded) and the demo's tokenizer, then

1. **trainer**: ``Trainer.step`` on one GPU (bf16 autocast, fp32 masters, activation checkpointing) on packed
   agent-like samples of 8K-token micro-batches: tokens/s, MFU (model FLOPs per step = 6 x matmul parameters x
   tokens + 6 x layers x attention width x sum of squared document lengths, over the GPU's dense bf16 peak:
   ``PEAK_BF16_TFLOPS``), peak memory;
2. **run**: ``albatross train`` on generated tasks (the run driver, ``Pipeline``): an oracle warm start, then 5 RL
   steps, the trainer sharded with FSDP2 over every GPU but the engine's (one GPU: trainer and engine share it),
   vLLM when ``albatross engines install vllm`` was run, else the built-in engine on the GPU;
3. **sync**, when the engine has started and before RL: the same weights pushed back unchanged over the filesystem
   and (vLLM, two GPUs or more) over NCCL, each timed; greedy tokens of fixed prompts before and after each push
   must be identical.

It writes one JSON (``--json``). Without CUDA the command stops with one line, exit code 2; the table, the config
the run uses and the sync check are tested on the CPU (tests/unit/test_bench_gpu.py).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from albatross.bench.common import print_table, write_json
from albatross.errors import UserError
from albatross.trainer.weights.tensors import Names

QWEN3_05B = {"vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
             "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
             "tie_word_embeddings": True, "rope_theta": 1000000.0}  # the shape of Qwen3-0.6B
# Dense bf16 tensor-core peak per GPU, TFLOP/s (the vendors' data sheets, without sparsity), most specific first:
# every word of a key must be in the device name (case-insensitive).
PEAK_BF16_TFLOPS = [
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0),  # "NVIDIA H100 80GB HBM3" is the SXM part
    ("H200 NVL", 835.0), ("H200", 989.0), ("H800 PCIe", 756.0), ("H800", 989.0),
    ("GB200", 2500.0), ("B200", 2250.0), ("A100", 312.0), ("A800", 312.0),  # A100 SXM and PCIe: 312
    ("L40S", 362.0), ("L4", 121.0), ("A10", 125.0), ("RTX 4090", 165.0),
]
TOKENS = 8192  # trainer micro-batch of the MFU measurement
RL_STEPS = 5
PROMPTS = [[2, 40, 41, 42, 3], [2, 43, 44, 3], [5, 6, 7, 8, 9, 10]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--peak-tflops", type=float, default=0.0,
                        help="dense bf16 peak of one GPU for MFU (default: looked up from the GPU's name)")
    parser.add_argument("--vllm", action=argparse.BooleanOptionalAction, default=None,
                        help="roll out with vLLM (default: when `albatross engines install vllm` was run)")
    parser.add_argument("--out", metavar="DIR", help="keep the run directory here (default: a temporary one)")


# ---------------------------------------------------------------------------------------------- FLOPs


def matmul_params(cfg: dict[str, Any]) -> int:
    """Weights that multiply every token: attention and MLP projections of each layer and the LM head (the
    input embedding is a lookup; norms are negligible)."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * cfg["intermediate_size"]
    return int(layers * per_layer + cfg["vocab_size"] * h)


def train_flops(cfg: dict[str, Any], doc_lengths: list[int]) -> float:
    """Model FLOPs of one training step (forward + backward, no recomputation) over documents of these lengths:
    6 N T for the matmuls plus 6 x layers x (heads x head_dim) x L^2 per document for causal attention
    (QK^T and AV, 2 L^2 d each, half of it masked)."""
    attn = cfg["num_hidden_layers"] * cfg["num_attention_heads"] * cfg["head_dim"]
    return float(6.0 * matmul_params(cfg) * sum(doc_lengths) + 6.0 * attn * sum(n * n for n in doc_lengths))


def peak_flops(name: str, explicit_tflops: float) -> float | None:
    """Dense bf16 FLOP/s of one GPU: ``--peak-tflops``, or the first ``PEAK_BF16_TFLOPS`` entry whose words are
    all in the device name."""
    if explicit_tflops > 0:
        return explicit_tflops * 1e12
    words = name.lower().replace("-", " ").split()
    for key, tflops in PEAK_BF16_TFLOPS:
        if all(w in words for w in key.lower().split()):
            return tflops * 1e12
    return None


def require_cuda() -> tuple[str, int]:
    """The GPU's name and how many there are; a one-line ``UserError`` (exit code 2) without CUDA."""
    import torch

    if not torch.cuda.is_available():
        raise UserError("bench gpu: needs a CUDA GPU (torch sees none on this machine); the CPU figures are in "
                        "`albatross bench trainer` and `albatross bench engine`")
    return torch.cuda.get_device_name(0), torch.cuda.device_count()


# ---------------------------------------------------------------------------------------------- the model


def model_config(tokenizer: Any) -> Any:
    """Qwen3-0.6B's shape with the tokenizer's special ids (its vocabulary fits in the first rows)."""
    from transformers import Qwen3Config

    ids = {"bos_token_id": tokenizer.convert_tokens_to_ids("<|user|>"), "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    # attn_implementation: a keyword of every transformers config that Qwen3Config's signature leaves out
    fields: dict[str, Any] = {**QWEN3_05B, **ids, "attn_implementation": "sdpa"}
    return Qwen3Config(**fields)


def save_model(directory: Path, tokenizer: Any, dtype: str = "bfloat16") -> Path:
    """The random model (seed 0) in ``dtype``, with the tokenizer, as a checkpoint directory."""
    import torch
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(model_config(tokenizer)).to(getattr(torch, dtype))
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


# ---------------------------------------------------------------------------------------------- 1. trainer


def packed_batch(budget: int, rng: random.Random, vocab: int) -> tuple[Any, list[int]]:
    """Agent-like samples (log-normal lengths, median 2K tokens, up to ``budget``) filling about 4 micro-batches
    of ``budget`` tokens; returns (batch, document lengths)."""
    from albatross.bench.batches import synthetic_batch

    lengths: list[int] = []
    while sum(lengths) < 4 * budget * 0.9:
        lengths.append(min(max(int(rng.lognormvariate(math.log(2048), 1.0)), 256), budget))
    return synthetic_batch(lengths, vocab), lengths


def trainer_figures(model_dir: Path, steps: int, peak: float | None, device: str = "cuda") -> dict[str, Any]:
    """tokens/s, MFU and peak memory of ``Trainer.step`` on one GPU with 8K-token micro-batches."""
    import torch

    from albatross.config import TrainerConfig
    from albatross.trainer.model import load_model, to_device
    from albatross.trainer.step import Trainer

    model = to_device(load_model(model_dir), device)
    cfg = {**QWEN3_05B, "vocab_size": model.config.vocab_size}
    trainer = Trainer(model, TrainerConfig(micro_batch_tokens=TOKENS, precision="bf16", activation_checkpointing=True,
                                     lr=1e-5))
    batch, lengths = packed_batch(TOKENS, random.Random(TOKENS), 1000)
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
    flops = train_flops(cfg, lengths)
    out = {"micro_batch_tokens": TOKENS, "tokens": sum(lengths), "step_seconds": best,
           "tokens_per_s": sum(lengths) / best, "tflops_per_s": flops / best / 1e12,
           "mfu": flops / best / peak if peak else None,
           "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30}
    del trainer, model
    torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------------------------- 2. the run


def gpu_split(gpus: int) -> tuple[int, int]:
    """``(trainer ranks, GPUs before the engine's)``: the engine on the last GPU and the trainer on the others;
    with one GPU both share it."""
    return (1, 0) if gpus == 1 else (gpus - 1, gpus - 1)


def run_config(out: Path, gpus: int, vllm: bool, sandbox: str) -> Any:
    """The acceptance run: generated tasks, an oracle warm start, ``RL_STEPS`` RL steps; FSDP2 when the trainer
    has two GPUs or more; vLLM (NCCL weight sync when it has a GPU of its own) or the built-in engine."""
    from albatross.config import load_config

    ranks, _ = gpu_split(gpus)
    shared = gpus == 1
    engine = (["engine.type=vllm", "engine.dtype=bfloat16", f"engine.gpu_memory_utilization={0.3 if shared else 0.8}",
               "engine.max_model_len=4096", 'engine.extra_args=["--enforce-eager"]',
               f"engine.weight_sync={'filesystem' if shared else 'nccl'}"] if vllm else ["engine.type=builtin"])
    return load_config(None, [
        "name=bench-gpu", f"out={out}", f"model.path={out / 'model'}", "tasks.n_train=16", "tasks.n_heldout=4",
        f"sandbox.type={sandbox}", "warmstart.source=oracle", "warmstart.steps=150", "warmstart.check_every=50",
        "warmstart.check_tasks=8", "warmstart.batch_size=16", "warmstart.lr=3e-4", "warmstart.target_pass_rate=0.1",
        "trainer.device=cuda", f"trainer.gpus={ranks}", "trainer.precision=bf16", "trainer.lr=1e-6",
        f"trainer.micro_batch_tokens={TOKENS}", "trainer.activation_checkpointing=true",
        "orchestrator.group_size=4", "orchestrator.groups_per_step=2", f"orchestrator.max_steps={RL_STEPS}",
        "orchestrator.max_minutes=4", "orchestrator.rollout_workers=16", "orchestrator.checkpoint_every=0",
        "orchestrator.checkpoint_minutes=0", "eval.trials=1", *engine])


def run_figures(out: Path, wall_s: float, params: int, peak: float | None, ranks: int) -> dict[str, Any]:
    """What the run's ``metrics.jsonl`` says: steps, step time, weight sync, rollout tokens/s, the trainer's peak
    memory, and an MFU estimate from 6 x matmul parameters x tokens (the attention term left out)."""
    path = out / "run" / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    if not rows:
        return {"steps": 0, "seconds": wall_s}
    seconds = sum(r.get("seconds", 0.0) for r in rows)
    tokens = sum(r.get("input_tokens", 0.0) for r in rows)
    mfu = 6.0 * params * tokens / seconds / (peak * ranks) if peak and seconds else None
    return {"steps": len(rows), "seconds": wall_s, "trainer_step_seconds": seconds / len(rows),
            "trainer_tokens_per_s": tokens / seconds if seconds else None, "trainer_mfu_6nt": mfu,
            "weight_sync_s": sum(r.get("weight_sync_s", 0.0) for r in rows) / len(rows),
            "rollout_tokens_per_s": rows[-1].get("engine_tokens_per_s"),
            "trainer_peak_memory_gib": max(r.get("peak_memory_gib", 0.0) for r in rows),
            "pass_rate": rows[-1].get("pass_rate"), "mismatch_kl": rows[-1].get("mismatch_kl")}


# ---------------------------------------------------------------------------------------------- 3. sync


def greedy(engine: Any) -> list[list[int]]:
    from albatross.engine.base import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=24)
    return [c.token_ids for c in engine.generate([list(p) for p in PROMPTS], params)]


def sync_figures(engine: Any, model: Any, weights_dir: Path, dtype: str, nccl: Any = None,
                 names: Names = "unique", version: int = 0) -> dict[str, Any]:
    """Push ``model``'s weights (those the engine already serves, as ``version``: the run then starts from it)
    back over the filesystem (in ``dtype``) and, given an ``nccl`` sender, over NCCL; time each and compare the
    greedy tokens before and after each."""
    from albatross.trainer.checkpoint import export_weights

    before = greedy(engine)
    t0 = time.perf_counter()
    path = export_weights(model, weights_dir, version, dtype=dtype, names=names)
    exported = time.perf_counter() - t0
    engine.update_weights(str(path), version)
    out: dict[str, Any] = {"filesystem_export_s": exported, "filesystem_s": time.perf_counter() - t0,
                           "greedy_identical_after_filesystem": greedy(engine) == before}
    if nccl is not None:
        t0 = time.perf_counter()
        engine.update_weights(nccl.send(model, version), version)
        out["nccl_s"] = time.perf_counter() - t0
        out["greedy_identical_after_nccl"] = greedy(engine) == before
    return out


def bench_pipeline(ranks_before_engine: int, results: dict[str, Any], device: str = "cuda:0") -> Any:
    """The run driver, its engine built on the GPUs the bench chose and checked with ``sync_figures`` first (the
    model it pushes back is loaded on ``device``, then freed)."""
    from albatross.pipeline.driver import Pipeline

    class BenchRun(Pipeline):
        def start_engine(self, base_dir: Path) -> Any:
            import torch

            from albatross.engine.launch import make_engine
            from albatross.trainer.model import load_model, to_device
            from albatross.trainer.weights.nccl import NCCLSender
            from albatross.trainer.weights.tensors import declared_dtype

            t0 = time.perf_counter()
            engine = make_engine(self.cfg, base_dir, self.out / "run", self.log, trainer_gpus=ranks_before_engine)
            results["engine_start_s"] = time.perf_counter() - t0
            ec = self.cfg.engine
            model = to_device(load_model(base_dir), device)
            nccl = NCCLSender(ec.type, self.out / "run", dtype="bfloat16", device=device,
                              names="served" if ec.type == "vllm" else "unique") if ec.weight_sync == "nccl" else None
            try:
                results["sync"] = sync_figures(engine, model, self.out / "sync-weights", declared_dtype(base_dir),
                                               nccl, names="served" if ec.type == "vllm" else "unique")
            finally:
                if nccl is not None:
                    nccl.close()
                del model
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            return engine

    return BenchRun


def run(args: argparse.Namespace) -> dict[str, Any]:
    from albatross.bench.engine import want_vllm
    from albatross.pipeline.demo import demo_tokenizer
    from albatross.sandbox import local_available

    t_start = time.perf_counter()
    name, gpus = require_cuda()
    peak = peak_flops(name, float(args.peak_tflops or 0.0))
    vllm = want_vllm(args.vllm)
    keep = args.out
    out = Path(keep).resolve() if keep else Path(tempfile.mkdtemp(prefix="albatross-bench-gpu-"))
    (out / "model").mkdir(parents=True, exist_ok=True)
    save_model(out / "model", demo_tokenizer())
    results: dict[str, Any] = {"gpu": name, "gpus": gpus, "peak_bf16_tflops_per_gpu": peak / 1e12 if peak else None,
                               "model": QWEN3_05B, "matmul_params": matmul_params(QWEN3_05B),
                               "engine": "vllm" if vllm else "builtin"}
    results["trainer"] = trainer_figures(out / "model", 3, peak)
    ranks, before_engine = gpu_split(gpus)
    cfg = run_config(out, gpus, vllm, "local" if local_available() else "process")
    results["weight_sync"] = cfg.engine.weight_sync
    t0 = time.perf_counter()
    bench_pipeline(before_engine, results)(cfg, log=print).run()
    results["run"] = run_figures(out, time.perf_counter() - t0, matmul_params(QWEN3_05B), peak, ranks)
    results["wall_seconds"] = time.perf_counter() - t_start
    results["under_8_minutes"] = results["wall_seconds"] < 480
    _report(results, args.json)
    return results


def _report(results: dict[str, Any], path: str | None) -> None:
    rows = [(k, v) for k, v in results.items() if not isinstance(v, dict)]
    rows += [(f"{k}.{f}", v) for k, figs in results.items() if isinstance(figs, dict) and k != "model"
             for f, v in figs.items()]
    print_table("albatross bench gpu", rows)
    write_json(path, results)
