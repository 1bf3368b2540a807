"""Trainer study: each optimisation credited in turn on an 8-layer hybrid MoE (``bench trainer --study``).

The model is a ``qwen4_exp`` built from a config (nothing downloaded; ``--model DIR`` takes any family
directory instead): 8 layers (gated delta-net, QSA-indexed attention on layers 4 and 8), 32 experts top-4 plus
a shared expert, two hyper-connection streams, n-gram PLE on two layers, a 16,384-token vocabulary. Every
row trains one step on the same batch of agent-like trajectories (log-normal lengths, median 400 tokens,
a long tail to the cap) from the same fresh weights, so every row's first-step loss must be equal (checked:
``same_first_loss``). Rows are cumulative, each adding one trainer option to the previous row:

0. transformers as shipped: batches of 8 trajectories right-padded to their longest, eager experts (a loop
   over experts), the QSA indexer's Python loop over positions and its dense [B, 1, T, T] masks, full
   [B, T, V] logits, no checkpointing (``bench.batches.padded_step``);
1. exact packing: albatross' trainer, first-fit-decreasing rows, packed-aware layers (``models/``);
2. ``trainer.grouped_experts``; 3. ``trainer.fast_indexer``; 4. ``trainer.fused_hyper``;
5. chunked log-probs at the loss tokens only (``trainer.logprob_chunk``, ``trainer.logprob_loss_only``);
6. ``trainer.activation_checkpointing``;
7. ``trainer.offload_optimizer`` and ``trainer.host_params = ["ngram"]``;
8. frozen parts (``trainer.freeze``): the seed's (``first_layers:2``, ``ngram``, ``indexer``, ``mtp`` when the
   model has one) and the token embedding under them (``embed``). The seed does not say whether its embedding
   trained; frozen, nothing below layer 2 needs a gradient and the backward stops there (the frozen layers
   run once, without a graph). With it trainable the backward still runs through the frozen layers to reach
   it: that variant (the seed's parts alone) is measured in the same run and reported beside the rows
   (``seed_parts_only``);
9. the longest context (one trajectory of T tokens, one step) that fits in a fixed memory budget, for row 0's
   configuration (``context_baseline``) and row 8's (``max_context_measured``): each length runs in a fresh
   child process killed when its resident set passes ``--study-memory-gib`` (on a GPU: a per-process memory
   fraction), its allocator set to return freed tensors to the system (``MEASURED_ALLOCATOR``), so the
   resident set is what the step holds, not what glibc keeps of freed blocks. Row 0 doubles T from 1,024
   until one does not fit; row 8 starts at 4x row 0's, doubles while it fits, else tries 2x and 1x. It runs
   after rows 0-8, within ``--study-budget-s`` (row 0's first length and row 8's 2x and 1x run whatever the
   budget has left, so the row always says something). Measured, not projected.

Each row runs in its own child process (``--quick``: forked from one process that imported torch and transformers
once, ``bench/forked.py``, where a fresh one spends most of a quick row importing them; the context search always
starts fresh processes); its peak is the child's ``VmHWM`` (on a GPU ``max_memory_allocated``,
after a warm-up step of a throwaway copy on two short trajectories), in ``--study-rounds`` rounds (default 3,
each running every row once, in order, timing 2 steps), so each row's steps are spread over the whole
measurement rather than falling in one slow spell of a shared machine. Reported: non-padding tokens/s (real
tokens / step seconds, the best step over all rounds), peak memory, matmul GFLOP/s (the
model's matmuls over the real tokens, counted analytically as 3 x the forward: every linear layer, the k
active experts, routers, the LM head, the QSA indexer's block scores and attention over the keys each query
keeps; the delta rule's internal products and checkpoint recomputation not counted, as MFU counts), and the
ratio to row 0, each also by CPU time (robust to other work on a shared machine). ``--device cuda`` runs the
same rows in bf16 (autocast) on a GPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import sys
import time
from collections.abc import Callable
from typing import Any

from albatross.bench.batches import agent_lengths, padded_step, synthetic_batch
from albatross.bench.common import GIB, run_watched, status_bytes

MEMORY_LIMIT_GIB = 2.0
VOCAB = 16_384
STUDY_MODEL: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 1 << 20, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    "layer_types": ["linear_attention"] * 3 + ["indexed_attention"] + ["linear_attention"] * 3
    + ["indexed_attention"],
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 32, "linear_value_head_dim": 32,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "num_experts": 32, "num_experts_per_tok": 4, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64,
    "hc_count": 2, "hc_lowrank": 16, "ple_layer_ids": [2, 6], "ple_embed_dim": 64, "ngram_size": 3,
    "heads_per_ngram": 2, "ngram_vocab_size_base": 20_000, "make_ngram_vocab_size_divisible_by": 8,
    "split_ngram_parts": 1, "indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 32,
    "indexer_budget": 128, "indexer_compress_ratio": 8,
}
SEED_FREEZE = ("first_layers:2", "ngram", "indexer", "mtp")
BOTTOM_FREEZE = ("embed",)  # the token embedding under the seed's frozen first layers
# (name, trainer options added by the row); every row keeps the previous rows' options
ROWS: list[tuple[str, dict[str, Any]]] = [
    ("0 transformers as shipped (padded)", {}),
    ("1 + exact packing", {"packed": True}),
    ("2 + grouped experts", {"grouped_experts": True}),
    ("3 + vectorised QSA indexer", {"fast_indexer": True}),
    ("4 + fused hyper-connections", {"fused_hyper": True}),
    ("5 + chunked log-probs at loss tokens", {"logprob_chunk": 1024, "logprob_loss_only": True}),
    ("6 + activation checkpointing", {"activation_checkpointing": True}),
    ("7 + host offload (optimizer, n-gram table)", {"offload_optimizer": True, "host_params": ["ngram"]}),
    ("8 + frozen parts (the seed's, and the embedding)", {"freeze": [*SEED_FREEZE, *BOTTOM_FREEZE]}),
]
CONTEXT_ROW = "9 longest context in the memory budget"
# what a row is for where a CPU run cannot show it
CPU_NOTES = {
    2: "CPU: a loop of E small matmuls vs one grouped matmul costs about the same; on a GPU one grouped "
       "kernel replaces E launches and the per-expert gathers (the seed's MoE kernels)",
    4: "CPU: matmuls dominate, the saved elementwise passes are small; on a GPU these are memory-bound kernels "
       "over [T, hc x H] streams, fewer passes pay",
    5: "the head skips the prompt and observation tokens (35% here; most of a real agent trajectory); "
       "chunking pays in memory at 150K vocabularies, little at this 16K one",
    6: "trades compute for memory (recomputes each layer): slower by design, buys context (row 9)",
    7: "CPU: host and device memory are one, nothing moves; on a GPU frees the AdamW state and the n-gram "
       "table (its weights, grads and moments) from device memory",
    8: "frozen parts get no weight gradients and no optimizer state; with the embedding frozen too the backward "
       "stops at layer 2 (the seed's parts alone: seed_parts_only)",
}


STEPS_TIMED = 2  # timed steps per row and round (the best step of all rounds counts)
ROUNDS = 3  # every row runs once per round: a shared 2-core VM's speed drifts by 20-30% over minutes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--study", action="store_true", help="the cumulative study of trainer optimisations on an "
                   "8-layer hybrid MoE (bench/study.py)")
    p.add_argument("--model", metavar="DIR", help="--study: a model directory of any family (default: a qwen4_exp "
                   "built from a config)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="--study: where to train (cuda: bf16)")
    p.add_argument("--study-budget-s", type=float, help="--study: time budget of the context search "
                   "(default 900 s; quick 60 s)")
    p.add_argument("--study-rounds", type=int, help=f"--study: rounds over the rows (default {ROUNDS}; quick 1)")
    p.add_argument("--study-memory-gib", type=float, default=MEMORY_LIMIT_GIB, help="--study: the memory budget "
                   f"of the context search (default {MEMORY_LIMIT_GIB:g} GiB)")


# model and data -------------------------------------------------------------------------------------


def build_model(model_dir: str | None, device: str) -> Any:
    """A fresh model (seed 0, fp32 weights) on ``device``, experts as transformers' eager loop."""
    import torch

    from albatross.trainer.model import to_device

    torch.manual_seed(0)
    if model_dir:
        from albatross.trainer.model import load_model

        model = load_model(model_dir)
    else:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.for_model("qwen4_exp_text", **STUDY_MODEL)
        model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]  # transformers: unannotated
            config, dtype=torch.float32)
    # a transformers model: ``set_experts_implementation`` is in transformers 5 (a version boundary)
    if hasattr(model, "set_experts_implementation") and _has_experts(model):
        model.set_experts_implementation("eager")
    return to_device(model, device).train()


def _has_experts(model: Any) -> bool:
    from albatross.models.experts import expert_modules

    return bool(expert_modules(model))


def vocab_of(model: Any) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


def study_lengths(quick: bool) -> list[int]:
    """Agent-like trajectory lengths (``bench.batches.agent_lengths``: log-normal, median 400, clipped)."""
    return agent_lengths(6 if quick else 8, random.Random(1), cap=512 if quick else 2048)


def batch_of(lengths: list[int], vocab: int, seed: int = 0) -> Any:
    """Random trajectories with prompts, model turns and observations; ids avoid the special tokens."""
    batch = synthetic_batch(lengths, vocab - 3, seed)
    for ts in batch.samples:  # ids 3.. so no document holds an EOS (the n-gram hashes reset on it)
        ts.sample.token_ids[:] = [t + 3 for t in ts.sample.token_ids]
    return batch


# rows -----------------------------------------------------------------------------------------------


def row_options(index: int) -> dict[str, Any]:
    """Trainer options of row ``index``: the union of rows 1..index (row 0: none, padded)."""
    options: dict[str, Any] = {}
    for _, added in ROWS[1 : index + 1]:
        options.update(added)
    return options


def applicable(model: Any, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` less those the model has nothing for (``--model`` of another family), and the freeze
    entries it lacks."""
    from albatross.models.experts import expert_modules
    from albatross.models.hyper import LAYER_CLASSES
    from albatross.models.indexer import ATTENTION_CLASSES
    from albatross.models.parts import embedding_tied, part_sizes

    names = {type(m).__name__ for m in model.modules()}
    parts = part_sizes(model)
    keep = dict(options)
    if not expert_modules(model):
        keep.pop("grouped_experts", None)
    if not names & set(ATTENTION_CLASSES):
        keep.pop("fast_indexer", None)
    if not names & set(LAYER_CLASSES):
        keep.pop("fused_hyper", None)
    if "ngram" not in parts:
        keep.pop("host_params", None)
    if "freeze" in keep:
        keep["freeze"] = [f for f in keep["freeze"] if f.startswith("first_layers:") or f in parts
                          or (f == "embed" and not embedding_tied(model))]
        if "mtp" in keep["freeze"]:  # a loaded MTP head: kept, frozen (the trainer's default "off" drops it)
            keep["mtp"] = "frozen"
    return keep


def _trainer(model: Any, options: dict[str, Any], tokens: int, device: str) -> Any:
    from albatross.config import TrainerConfig
    from albatross.trainer.step import Trainer

    opts = {k: v for k, v in options.items() if k != "packed"}
    opts.setdefault("logprob_chunk", 0)  # one chunk: full logits
    opts.setdefault("logprob_loss_only", False)
    return Trainer(model, TrainerConfig(micro_batch_tokens=tokens, lr=1e-4, attention="varlen",
                                        precision="bf16" if device == "cuda" else "fp32", **opts))


def _padded(model: Any, device: str, batch_size: int) -> Any:
    """Row 0's step: ``bench.batches.padded_step`` (bf16 autocast on a GPU); ``batch_size`` 1: each trajectory
    alone, no padding."""
    import contextlib

    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95))
    cast = (torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else contextlib.nullcontext())

    def step(batch: Any) -> dict[str, float]:
        with cast:
            return padded_step(model, optimizer, batch, batch_size=batch_size)

    return step


def make_step(spec: dict[str, Any]) -> Any:
    """A fresh model and the step function of the row ``spec`` describes."""
    model = build_model(spec.get("model"), spec["device"])
    options = applicable(model, spec["options"])
    if not options.get("packed"):
        return _padded(model, spec["device"], spec.get("padded_batch", 8)), model
    trainer = _trainer(model, options, spec["micro_batch_tokens"], spec["device"])
    return trainer.step, model


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def row_child(spec: dict[str, Any]) -> dict[str, Any]:
    """Warm up a throwaway copy, then time ``spec['steps']`` steps of a fresh model on the study batch."""
    import torch

    device = spec["device"]
    lengths = spec["lengths"]
    if spec.get("warmup", device == "cuda"):  # CPU one-time costs are negligible next to a step
        warm, model = make_step(spec)
        warm(batch_of([64, 96], vocab_of(model), seed=1))
        del warm, model
    step, model = make_step(spec)
    batch = batch_of(lengths, vocab_of(model))
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base = _rss() if device == "cpu" else torch.cuda.memory_allocated()
    times, cpu_times, losses = [], [], []
    for _ in range(spec["steps"]):
        _sync(device)
        t0, c0 = time.perf_counter(), _cpu_seconds()
        losses.append(float(step(batch)["loss"]))
        _sync(device)
        times.append(time.perf_counter() - t0)
        cpu_times.append(_cpu_seconds() - c0)
    peak = _status_bytes("VmHWM") if device == "cpu" else torch.cuda.max_memory_allocated()
    if not all(math.isfinite(x) for x in losses):
        raise FloatingPointError(f"non-finite loss {losses}")
    return {"seconds": min(times), "all_seconds": times, "cpu_seconds": min(cpu_times), "first_loss": losses[0],
            "peak_gib": peak / GIB,
            "base_gib": base / GIB, "flops": matmul_flops(model, lengths)}


def _status_bytes(field: str) -> int:
    return status_bytes(os.getpid(), field)


def _cpu_seconds() -> float:
    """CPU seconds of this process (all threads): the work a step did, whatever else the machine runs."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _rss() -> int:
    return _status_bytes("VmRSS")


# FLOPs ----------------------------------------------------------------------------------------------


def _attention_keys(n: int, indexer: Any) -> tuple[int, int]:
    """(keys attended, block scores computed) summed over the queries of one n-token document."""
    if indexer is None:
        return n * (n + 1) // 2, 0
    r, k = indexer.compress_ratio, indexer.block_topk
    keys = scored = 0
    for i in range(n):
        blocks = (i + 1) // r
        scored += blocks
        keys += i + 1 if blocks <= k else k * r + (i + 1) % r
    return keys, scored


def matmul_flops(model: Any, lengths: list[int]) -> float:
    """Training FLOPs (3 x forward) of the model's matmuls over the real tokens of ``lengths``."""
    from torch import nn

    tokens = sum(n - 1 for n in lengths)
    per_token = 0
    attention = 0
    for module in model.modules():  # transformers' modules: their parts are found by name (any architecture)
        name = type(module).__name__
        if isinstance(module, nn.Linear):
            per_token += 2 * module.in_features * module.out_features
        elif name.endswith("Experts") and hasattr(module, "gate_up_proj"):
            k = model.config.get_text_config().num_experts_per_tok
            per_token += 2 * k * (module.gate_up_proj[0].numel() + module.down_proj[0].numel())
        elif name.endswith("TopKRouter"):
            per_token += 2 * module.weight.numel()
        if hasattr(module, "q_proj") and hasattr(module, "o_proj") and hasattr(module, "head_dim"):
            indexer = getattr(module, "indexer", None)
            heads = module.o_proj.in_features // module.head_dim
            for n in lengths:
                keys, scored = _attention_keys(n - 1, indexer)
                attention += 4 * heads * module.head_dim * keys
                if indexer is not None:
                    attention += 2 * indexer.index_n_heads * indexer.index_head_dim * scored
    return 3.0 * (per_token * tokens + attention)


# child processes ------------------------------------------------------------------------------------


# A memory-budget child on the CPU: glibc returns every block of 128 KiB or more to the system when it is
# freed. By default it raises that threshold as blocks are freed and then keeps freed tensors in its heap, so
# the resident set carried 0.3-1 GiB of freed memory that varied from run to run (1.72-2.16 GiB for one row-8
# step at 8,192 tokens, 1.13-1.19 GiB with this setting). Slower (each large tensor is fresh pages).
MEASURED_ALLOCATOR = {"MALLOC_MMAP_THRESHOLD_": str(128 << 10)}


def run_child(spec: dict[str, Any], limit_gib: float | None, timeout_s: float) -> dict[str, Any]:
    """``row_child`` in a fresh process; killed when its resident set passes ``limit_gib`` (CPU) or when it
    asks for more device memory than that (GPU: a per-process memory fraction). Under a limit on the CPU its
    allocator returns freed tensors (``MEASURED_ALLOCATOR``), so the resident set is what it holds."""
    cpu = spec["device"] == "cpu"
    return run_watched([sys.executable, "-m", "albatross.bench.study", "--child",
                        json.dumps({**spec, "limit_gib": limit_gib})],
                       limit_gib, timeout_s, watch_rss=cpu, poll_s=0.05, oom_marker="OutOfMemoryError", tail_chars=300,
                       env=MEASURED_ALLOCATOR if cpu and limit_gib else None)


def _child_main(spec: dict[str, Any]) -> None:
    if spec["device"] == "cuda" and spec.get("limit_gib"):
        import torch

        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(spec["limit_gib"] * GIB / total, 1.0))
    print(json.dumps(row_child(spec)))


# the study ------------------------------------------------------------------------------------------


# what a forked row child needs imported (``--quick``: rows fork from a process that imported these once)
FORK_PRELOAD = ["torch", "transformers", "transformers.models.qwen4_exp.modeling_qwen4_exp", "albatross.bench.study",
                "albatross.trainer.step"]


def _child_result(base: dict[str, Any], name: str, options: dict[str, Any], lengths: list[int],
                  steps: int, fork: bool = False) -> dict[str, Any]:
    """One row's child: a fresh ``python``, or (``fork``) a child forked from the fork server (``bench/forked.py``)."""
    spec = {**base, "options": options, "lengths": lengths, "steps": steps}
    if fork:
        from albatross.bench.forked import run_forked

        r = run_forked(row_child, spec, 1800, FORK_PRELOAD, tail_chars=300)
    else:
        r = run_child(spec, None, 1800)
    if r["status"] != "ok":
        raise RuntimeError(f"study row {name!r}: {r['status']}")
    return r


def _row(name: str, options: dict[str, Any], lengths: list[int], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A row from its child runs (one per round): the fastest step over all of them counts."""
    real = sum(n - 1 for n in lengths)
    best = min(runs, key=lambda r: r["seconds"])
    cpu = min(r["cpu_seconds"] for r in runs)
    return {"name": name, "options": options, "tokens_per_s": real / best["seconds"], "tokens_per_cpu_s": real / cpu,
            "cpu_seconds": cpu, "peak_gib": max(r["peak_gib"] for r in runs), "base_gib": best["base_gib"],
            "matmul_gflops": best["flops"] / best["seconds"] / 1e9, "seconds": best["seconds"],
            "all_seconds": [t for r in runs for t in r["all_seconds"]], "first_loss": runs[0]["first_loss"],
            "first_losses": [r["first_loss"] for r in runs]}


SEED_PARTS_ONLY = "8 with the seed's frozen parts only (embedding trained)"


def throughput_rows(base: dict[str, Any], lengths: list[int], steps: int, rounds: int = 1,
                    log: Callable[[str], None] = print,
                    fork: bool = False) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows 0-8 and row 8 with the seed's frozen parts only (``SEED_PARTS_ONLY``), each in a fresh child process
    (``fork``: forked from the fork server, as ``--quick`` runs them).

    With ``rounds`` > 1 every row runs once per round, rows in order within a round, so each row's steps are
    spread over the whole measurement and a slow spell of a shared machine does not fall on one row alone.
    """
    specs = [(name, row_options(i)) for i, (name, _) in enumerate(ROWS)]
    specs.append((SEED_PARTS_ONLY, {**row_options(len(ROWS) - 1), "freeze": list(SEED_FREEZE)}))
    runs: list[list[dict[str, Any]]] = [[] for _ in specs]
    for k in range(rounds):
        for i, (name, options) in enumerate(specs):
            r = _child_result(base, name, options, lengths, steps, fork)
            runs[i].append(r)
            log(f"[study] round {k + 1}/{rounds} {name}: {r['seconds']:.2f}s, "
                f"{sum(n - 1 for n in lengths) / r['seconds']:.0f} tokens/s, peak {r['peak_gib']:.2f} GiB, "
                f"loss {r['first_loss']:.6f}")
    rows = [_row(name, options, lengths, r) for (name, options), r in zip(specs, runs, strict=True)]
    for i, row in enumerate(rows):
        if i in CPU_NOTES:
            row["note"] = CPU_NOTES[i]
        row["ratio"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
        row["ratio_cpu_time"] = row["tokens_per_cpu_s"] / rows[0]["tokens_per_cpu_s"]
    return rows[:-1], rows[-1]


GRACE_S = 600.0  # what a length that runs whatever the budget has left may take beyond it


def longest_context(base: dict[str, Any], row: int, lengths: list[int], limit_gib: float, deadline: float,
                    log: Callable[[str], None] = print, sure: bool = False) -> dict[str, Any]:
    """Try one-trajectory contexts in order; the longest that trained one step under ``limit_gib``. ``sure``: the
    first length runs whatever time is left before ``deadline`` (``GRACE_S`` more), so the search says something."""
    best: dict[str, Any] = {"context": 0}
    tried = []
    for i, n in enumerate(lengths):
        left = deadline - time.monotonic()
        first = sure and i == 0
        if left < 10 and not first:
            tried.append({"context": n, "status": "no time left"})
            break
        spec = {**base, "options": row_options(row), "lengths": [n + 1], "steps": 1, "warmup": False,
                "micro_batch_tokens": n}
        r = run_child(spec, limit_gib, max(left, 0.0) + GRACE_S if first else left)
        tried.append({"context": n, **{k: v for k, v in r.items() if k in ("status", "peak_gib", "seconds")}})
        log(f"[study] context row {row} T={n}: {r['status']}"
            + (f", peak {r['peak_gib']:.2f} GiB, {r['seconds']:.0f}s" if r["status"] == "ok" else ""))
        if r["status"] != "ok":
            break
        best = {"context": n, "peak_gib": r["peak_gib"], "seconds": r["seconds"], "tokens_per_s": n / r["seconds"],
                "matmul_gflops": r["flops"] / r["seconds"] / 1e9}
    return {**best, "tried": tried}


def context_rows(base: dict[str, Any], quick: bool, limit_gib: float, budget_s: float, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Row 9: the longest context of row 0's and of row 8's configuration under one memory limit."""
    deadline = time.monotonic() + budget_s
    start = 256 if quick else 1024
    ladder = [start << i for i in range(10)]
    # row 0's first length runs whatever the budget, so the baseline always says something
    baseline = longest_context(base, 0, ladder, limit_gib, deadline, log, sure=True)
    first = max(baseline["context"], start)
    # the target first (4x the baseline), then doubling; below it, 2x and 1x so the row always says something
    final = longest_context(base, len(ROWS) - 1, [first << i for i in range(2, 8)], limit_gib, deadline, log)
    for factor in (2, 1):
        if final["context"]:
            break
        final = longest_context(base, len(ROWS) - 1, [first * factor], limit_gib, deadline, log, sure=True)
    return {"baseline": baseline, "final": final, "limit_gib": limit_gib}


def _agree(losses: list[float], device: str) -> bool:
    tol = 2e-2 if device == "cuda" else 1e-4
    return max(losses) - min(losses) <= tol * max(1.0, max(abs(x) for x in losses))


def first_loss_check(packed: list[float], padded: list[float], alone: Any, device: str) -> dict[str, Any]:
    """Every row computes the same first-step loss. The packed rows (1-8) must agree with each other; row 0's
    padded batch may not, where the family's shipped forward changes under padding (glm_moe_dsa: the DSA
    indexer's top-k over a padded sequence): then the packed rows must equal the shipped model run on each
    trajectory alone (``alone()``, no padding), and ``same_first_loss`` is false with both losses reported."""
    if not _agree(packed, device):
        raise AssertionError(f"study rows 1-8 disagree on the first-step loss: {packed}")
    out: dict[str, Any] = {"same_first_loss": _agree(packed + padded, device), "packed": packed[0],
                           "padded": padded[0]}
    if not out["same_first_loss"]:
        out["documents_alone"] = alone()
        if not _agree([*packed, out["documents_alone"]], device):
            raise AssertionError(f"study rows 1-8 ({packed[0]}) differ from the shipped model on each trajectory alone "
                                 f"({out['documents_alone']})")
        out["note"] = ("row 0's padded batch differs from the model on each trajectory alone (the shipped forward "
                       "changes under padding); rows 1-8 equal the latter")
        print(f"[study] note: {out['note']}: padded {padded[0]:.6f}, alone {out['documents_alone']:.6f}")
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from albatross.bench.common import print_table, write_json

    quick = bool(args.quick)
    device = args.device or "cpu"
    limit = args.study_memory_gib or MEMORY_LIMIT_GIB
    lengths = study_lengths(quick)
    # the whole batch in one packed micro-batch, as row 0 runs it in one padded batch
    base = {"device": device, "model": args.model, "micro_batch_tokens": max(4096, sum(lengths))}
    rounds = 1 if quick else max(1, int(args.study_rounds or ROUNDS))
    rows, seed_only = throughput_rows(base, lengths, 1 if quick else STEPS_TIMED, rounds, fork=quick)
    alone = {**base, "padded_batch": 1}  # row 0's model on each trajectory alone: only asked for if row 0 differs
    losses = first_loss_check([x for r in [*rows[1:], seed_only] for x in r["first_losses"]], rows[0]["first_losses"],
                              lambda: _child_result(alone, "0 with each trajectory alone", {}, lengths, 1,
                                                    quick)["first_loss"], device)
    same = losses["same_first_loss"]
    budget = args.study_budget_s or (60.0 if quick else 900.0)
    ctx = context_rows(base, quick, limit, budget)  # after the rows, so no row shares the CPU with it
    ctx_row = {"name": CONTEXT_ROW, "context_baseline": ctx["baseline"]["context"],
               "max_context": ctx["final"]["context"], "tokens_per_s": ctx["final"].get("tokens_per_s"),
               "peak_gib": ctx["final"].get("peak_gib"), "matmul_gflops": ctx["final"].get("matmul_gflops"),
               "ratio": ctx["final"]["context"] / max(ctx["baseline"]["context"], 1), "ratio_of": "context",
               "memory_limit_gib": limit}
    result = {
        "study": [*rows, ctx_row],
        "cumulative_speedup": rows[-1]["tokens_per_s"] / rows[0]["tokens_per_s"],
        "cumulative_speedup_cpu_time": rows[-1]["ratio_cpu_time"],
        "seed_parts_only": seed_only,
        "context_baseline": ctx["baseline"]["context"],
        "max_context_measured": ctx["final"]["context"],
        "same_first_loss": same, "first_losses": losses,
        "device": device, "quick": quick, "rounds": rounds, "steps_per_round": 1 if quick else STEPS_TIMED,
        "real_tokens": sum(n - 1 for n in lengths),
        "trajectories": len(lengths), "length_median": sorted(lengths)[len(lengths) // 2],
        "length_max": max(lengths), "model": args.model or {"qwen4_exp": STUDY_MODEL},
        "context": ctx,
    }
    table = [(r["name"], f"{r['tokens_per_s']:.0f} tok/s  {r['peak_gib']:.2f} GiB  {r['matmul_gflops']:.2f} "
              f"GFLOP/s  x{r['ratio']:.2f} (CPU time x{r['ratio_cpu_time']:.2f})") for r in rows]
    table += [(SEED_PARTS_ONLY, f"{seed_only['tokens_per_s']:.0f} tok/s  {seed_only['peak_gib']:.2f} GiB  "
               f"x{seed_only['ratio']:.2f} (CPU time x{seed_only['ratio_cpu_time']:.2f})")]
    table += [(CONTEXT_ROW, f"{ctx_row['context_baseline']} -> {ctx_row['max_context']} tokens under "
               f"{limit:g} GiB (x{ctx_row['ratio']:.1f})"),
              ("cumulative speedup (row 8 / row 0)", round(result["cumulative_speedup"], 2))]
    print_table(f"albatross bench trainer --study ({device})", table)
    write_json(args.json, result)
    return result


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--child":
    _child_main(json.loads(sys.argv[2]))
