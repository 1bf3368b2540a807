"""LoRA against full fine-tuning of the same model: optimizer and gradient memory, step time.

Two ``Trainer``s on copies of one model (a random Qwen2 built from a config, or ``--model DIR``), one full and one
with ``[trainer.lora]`` adapters (rank ``--rank``, the default targets: attention and MLP), step on the same
RL batch of random agent-like samples, alternately, so machine load weighs on both alike. Memory is counted, not
sampled: the bytes of the optimizer's state after a step and of the gradients (one fp32 value per trainable
parameter), per parameter of the model. Step time is the median over ``--steps`` steps after one warm-up step.
The same counts for published model shapes (Qwen3-0.6B, Qwen3-8B) are taken on the meta device: the adapters'
share of the parameters is the optimizer's share (AdamW keeps two fp32 moments per trainable parameter either way).
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import time
from pathlib import Path
from typing import Any

from albatross.bench.common import print_table, write_json
from albatross.errors import UserError

SIZES = {"quick": {"hidden_size": 256, "num_layers": 4, "vocab_size": 8192, "tokens": 1024},
         "full": {"hidden_size": 512, "num_layers": 8, "vocab_size": 16384, "tokens": 2048}}


# published shapes (their config.json), counted on the meta device: nothing is allocated or downloaded
SHAPES: dict[str, dict[str, Any]] = {
    "Qwen3-0.6B": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True},
    "Qwen3-8B": {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False},
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="a smaller model and batch (seconds)")
    p.add_argument("--model", metavar="DIR", help="a local causal LM directory (default: a random Qwen2)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (default %(default)s)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per trainer (default %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default %(default)s)")


def _batch(vocab: int, tokens: int, seed: int = 0) -> Any:
    """Samples of 64-512 tokens up to ``tokens``: a prompt, then model turns, advantages +-1."""
    from albatross.records import Batch, Sample, TrainSample

    rng = random.Random(seed)
    samples: list[TrainSample] = []
    total = 0
    while total < tokens:
        n = min(rng.randrange(64, 513), tokens - total)
        if n < 8:
            break
        prompt = n // 4
        ids = [rng.randrange(vocab) for _ in range(n)]
        mask = [0] * prompt + [1] * (n - prompt)
        logprobs = [-rng.uniform(6.0, 9.0) if m else 0.0 for m in mask]
        samples.append(TrainSample(Sample(ids, mask, logprobs, [0 if m else -1 for m in mask]),
                                   1.0 if len(samples) % 2 else -1.0))
        total += n
    return Batch(samples=samples, groups=1, min_version=0)


def state_bytes(optimizer: Any) -> int:
    """Bytes of every tensor in the optimizer's state (AdamW: two moments per trainable parameter, and steps)."""
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if hasattr(v, "numel"))  # torch's optimizer state holds tensors and plain numbers


def _model(args: argparse.Namespace, size: dict[str, int]) -> Any:
    if args.model:
        from albatross.trainer.model import load_model

        if not (Path(args.model) / "config.json").is_file():
            raise UserError(f"bench lora: --model {args.model}: no config.json (not a model directory)")
        return load_model(args.model)
    from albatross.trainer.model import tiny_causal_lm

    return tiny_causal_lm(size["vocab_size"], size["hidden_size"], size["num_layers"], seed=0)


def measure(model: Any, rank: int, steps: int, tokens: int, vocab: int) -> dict[str, dict[str, float]]:
    """Full and LoRA trainers on copies of ``model``: parameters, trainable parameters, optimizer and gradient
    bytes (per model parameter too), median step seconds."""
    from albatross.config import LoRAConfig, TrainerConfig
    from albatross.trainer.step import Trainer

    batch = _batch(vocab, tokens)
    params = sum(p.numel() for p in model.parameters())
    full = TrainerConfig(lr=1e-5, micro_batch_tokens=tokens)
    trainers = {"full": Trainer(copy.deepcopy(model), full),
                "lora": Trainer(copy.deepcopy(model), full.model_copy(update={"lora": LoRAConfig(rank=rank)}))}
    times: dict[str, list[float]] = {k: [] for k in trainers}
    for i in range(steps + 1):
        for name, trainer in trainers.items():  # alternately: load on the machine weighs on both alike
            t0 = time.perf_counter()
            trainer.step(batch)
            if i:
                times[name].append(time.perf_counter() - t0)
    out = {}
    for name, trainer in trainers.items():
        counts = trainer.parameter_counts()
        opt = state_bytes(trainer.optimizer)
        grads = 4 * counts["trainable_parameters"]
        out[name] = {**counts, "optimizer_bytes": opt, "gradient_bytes": grads,
                     "optimizer_bytes_per_parameter": opt / params, "gradient_bytes_per_parameter": grads / params,
                     "step_s": statistics.median(times[name])}
    out["lora"]["optimizer_share_of_full"] = out["lora"]["optimizer_bytes"] / out["full"]["optimizer_bytes"]
    out["lora"]["step_time_share_of_full"] = out["lora"]["step_s"] / out["full"]["step_s"]
    return out


def shape_shares(rank: int) -> dict[str, dict[str, float]]:
    """For each of ``SHAPES``: parameters, adapter parameters at ``rank`` (default targets) and their share, which
    is LoRA's optimizer memory as a share of a full fine-tune's."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from albatross.config import LoRAConfig
    from albatross.trainer.lora import apply_lora, parameter_counts

    out = {}
    for name, fields in SHAPES.items():
        with torch.device("meta"):
            model = Qwen3ForCausalLM(Qwen3Config(**fields))
        full = sum(p.numel() for p in model.parameters())
        apply_lora(model, LoRAConfig(rank=rank))
        trainable = parameter_counts(model)["trainable_parameters"]
        out[name] = {"parameters": full, "trainable_parameters": trainable, "optimizer_share_of_full": trainable / full}
    return out


def _table(r: dict[str, Any]) -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = []
    for name in ("full", "lora"):
        m = r[name]
        rows += [(f"{name}: trainable / all parameters", f"{m['trainable_parameters']:,} / {m['parameters']:,}"),
                 (f"{name}: optimizer state", f"{m['optimizer_bytes'] / 2**20:.2f} MiB "
                  f"({m['optimizer_bytes_per_parameter']:.3f} B per model parameter)"),
                 (f"{name}: gradients", f"{m['gradient_bytes'] / 2**20:.2f} MiB"),
                 (f"{name}: step", f"{m['step_s']:.3f} s")]
    rows += [("lora / full: optimizer memory", f"{r['lora']['optimizer_share_of_full']:.2%}"),
             ("lora / full: step time", f"{r['lora']['step_time_share_of_full']:.2f}x")]
    rows += [(f"{name} (meta device): lora / full optimizer memory",
              f"{m['optimizer_share_of_full']:.2%} ({m['trainable_parameters']:,} of {m['parameters']:,})")
             for name, m in r.get("shapes", {}).items()]
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    rank, steps = int(args.rank), int(args.steps)
    if rank < 1 or steps < 1:
        raise UserError(f"bench lora: --rank {rank} / --steps {steps}: expected both >= 1")
    torch.set_num_threads(int(args.threads))
    size = SIZES["quick" if args.quick else "full"]
    model = _model(args, size)
    vocab = min(model.config.vocab_size, size["vocab_size"])
    result: dict[str, Any] = measure(model, rank, steps, size["tokens"], vocab)
    result["shapes"] = shape_shares(rank)
    where = args.model or (f"random Qwen2, hidden {size['hidden_size']}, {size['num_layers']} "
                           f"layers, vocab {size['vocab_size']}")
    print_table(f"albatross bench lora ({where}; rank {rank}; {size['tokens']} tokens per step; CPU fp32)",
                _table(result))
    out = {"model": where, "rank": rank, "tokens_per_step": size["tokens"], "steps": steps, **result}
    write_json(args.json, out)
    return out
