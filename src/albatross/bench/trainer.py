"""Trainer: packed vs padded tokens/s, peak memory vs sequence length, longest sequence that fits.

Throughput. A tiny Qwen2 model (8,192-token vocabulary, hidden 128, 4 layers) trains on a batch of
synthetic agent trajectories whose lengths follow a log-normal law (many short, a long tail up to
4,096 tokens). The same loss (truncated IS) and the same AdamW step run twice, timed after a warm-up:

- ``packed``: the albatross trainer (first-fit-decreasing packing into 4,096-token rows, varlen
  document masking, chunked log-probs); every processed token is a real one;
- ``padded``: the straightforward implementation: batches of 8 trajectories in arrival order, right-
  padded to the longest, a padding mask, full [B, L, V] logits;
- ``padded-sorted``: the same, with the trajectories sorted by length first, so each batch of 8 holds
  similar lengths and wastes little on padding (the fair padded baseline:
  ``packed_vs_sorted_padded_speedup``).

The full run adds ``packed-dense`` (the same packing with a dense [T, T] block mask) to show why the
varlen path matters. Non-padding tokens/s = real tokens / step seconds.

Memory. One sequence of T tokens (4K to 32K, ``--max-seq-len``) through one full training step of a
tiny model at a 151,936-token vocabulary (hidden 64, 4 layers), with and without chunked log-probs and
activation checkpointing. Each configuration runs in a fresh subprocess; its peak is the child's
``VmHWM`` (peak resident set of its own address space, so it includes Python, torch and the model,
listed as ``base``; ``ru_maxrss`` is not used because Linux carries the parent's resident set at
fork into it across exec). A watchdog kills a child whose resident set passes ``--memory-limit-gib``
(default 16), and a length is skipped when the previous point projects it past that limit or past
the remaining time budget.
``max_seq_len_measured`` is the longest context actually run in one step (chunked + checkpointed).
``max_seq_len_projected`` is a projection, not a measurement: a straight line through the chunked +
checkpointed peaks of this hidden-64 model (memory is linear in T there: no [T, T] or [T, V] tensor),
extrapolated to a 24 GiB machine; a real model's activations per token are far larger.

``--study``: the cumulative study of the model-specific trainer options on an 8-layer hybrid MoE
(``bench/study.py``), instead of the above.
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
from typing import TYPE_CHECKING, Any

from albatross.bench import study
from albatross.bench.batches import agent_lengths, padded_step, padded_tokens, synthetic_batch
from albatross.bench.common import GIB, run_watched, status_bytes

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from albatross.records import Batch

THROUGHPUT_MODEL = {"vocab_size": 8192, "hidden_size": 128, "num_layers": 4}
MEMORY_MODEL = {"vocab_size": 151_936, "hidden_size": 64, "num_layers": 4}
MEMORY_CONFIGS = {  # name -> (logprob_chunk, activation_checkpointing)
    "chunked+ckpt": (1024, True),
    "chunked": (1024, False),
    "full-logits+ckpt": (None, True),
    "full-logits": (None, False),
}
FIT_TARGET_GIB = 24.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="a short run: fewer trajectories, 2K-8K tokens")
    p.add_argument("--max-seq-len", type=int, help="longest sequence of the memory sweep "
                   "(default 32768; quick 8192)")
    p.add_argument("--memory-budget-s", type=float, help="wall-time budget of the memory sweep "
                   "(default 600 s; quick 150 s)")
    p.add_argument("--memory-limit-gib", type=float, default=16.0,
                   help="kill a memory child whose resident set passes this (default 16)")
    study.add_arguments(p)


# throughput -----------------------------------------------------------------------------------------


def _timed(fn: Callable[[], dict[str, float]]) -> tuple[float, dict[str, float]]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _measure(step: Callable[[], dict[str, float]]) -> dict[str, float]:
    """Wall and CPU seconds of one call of ``step``, and its loss."""
    cpu0 = _cpu_seconds()
    seconds, metrics = _timed(step)
    return {"seconds": seconds, "cpu_seconds": _cpu_seconds() - cpu0, "loss": metrics["loss"]}


def _variants(batch: Batch, cfg: dict[str, int], quick: bool) -> dict[str, Callable[[], dict[str, float]]]:
    """name -> a function running one full step on ``batch``, each with its own model and optimizer."""
    import torch

    from albatross.config import TrainerConfig
    from albatross.trainer.model import tiny_causal_lm
    from albatross.trainer.step import Trainer

    def model() -> PreTrainedModel:
        lm: PreTrainedModel = tiny_causal_lm(cfg["vocab_size"], cfg["hidden_size"], cfg["num_layers"], seed=0)
        return lm

    steps: dict[str, Any] = {}
    for name, attention in [("packed", "varlen")] + ([] if quick else [("packed-dense", "dense")]):
        trainer = Trainer(model(), TrainerConfig(micro_batch_tokens=4096, attention=attention, lr=1e-4))
        steps[name] = lambda trainer=trainer: trainer.step(batch)
    for name, sort in (("padded", False), ("padded-sorted", True)):
        base = model()
        optimizer = torch.optim.AdamW(base.parameters(), lr=1e-4, betas=(0.9, 0.95))
        steps[name] = lambda base=base, optimizer=optimizer, sort=sort: padded_step(base, optimizer, batch,
                                                                                    sort=sort)
    return steps


def bench_throughput(quick: bool, log: Callable[[str], None] = print) -> dict[str, Any]:
    """One warm-up step per variant, then the best of 1 (quick) or 2 interleaved timed steps."""
    from albatross.trainer.packing import pack

    cfg = THROUGHPUT_MODEL
    lengths = agent_lengths(16 if quick else 32, random.Random(1))
    batch = synthetic_batch(lengths, cfg["vocab_size"])
    real = sum(n - 1 for n in lengths)
    steps = _variants(batch, cfg, quick)
    warm = synthetic_batch(lengths[:3], cfg["vocab_size"], seed=1)
    for name, step in _variants(warm, cfg, quick).items():
        step()
        log(f"[bench trainer] warmed up {name}")
    rows: dict[str, dict[str, float]] = {name: {} for name in steps}
    for rep in range(1 if quick else 2):  # interleaved, so a change in machine load hits both alike
        for name, step in steps.items():
            if rep and name == "packed-dense":  # an illustration: one measurement is enough
                continue
            r = _measure(step)
            rows[name].setdefault("first_loss", r["loss"])  # same fresh model and batch everywhere
            if "seconds" not in rows[name] or r["seconds"] < rows[name]["seconds"]:
                rows[name].update(seconds=r["seconds"], cpu_seconds=r["cpu_seconds"])
    processed = {name: float(sum(mb.num_tokens for mb in pack(batch.samples, 4096))) for name in rows}
    processed["padded"] = float(padded_tokens(lengths))
    processed["padded-sorted"] = float(padded_tokens(lengths, sort=True))
    for name, r in rows.items():
        r.update(processed_tokens=processed[name], real_tokens_per_s=real / r["seconds"],
                 real_token_share=real / processed[name])
        log(f"[bench trainer] {name}: {r['seconds']:.1f}s, {r['real_tokens_per_s']:.0f} real tokens/s")
    losses = [r["first_loss"] for r in rows.values()]
    return {"model": cfg, "trajectories": len(lengths), "real_tokens": real,
            "length_median": sorted(lengths)[len(lengths) // 2], "length_max": max(lengths),
            "same_loss": max(losses) - min(losses) <= 1e-4 * max(1.0, max(abs(x) for x in losses)),
            "rows": rows}


# memory ---------------------------------------------------------------------------------------------


def memory_child(spec: dict[str, Any]) -> dict[str, Any]:
    """One training step on one sequence of ``seq_len`` tokens; runs in a fresh process."""
    import torch

    from albatross.config import TrainerConfig
    from albatross.trainer.model import tiny_causal_lm
    from albatross.trainer.step import Trainer

    cfg = MEMORY_MODEL
    model = tiny_causal_lm(cfg["vocab_size"], cfg["hidden_size"], cfg["num_layers"])
    trainer = Trainer(model, TrainerConfig(micro_batch_tokens=spec["seq_len"], logprob_chunk=spec["chunk"] or 0,
                                           activation_checkpointing=spec["ckpt"]))
    batch = synthetic_batch([spec["seq_len"] + 1], cfg["vocab_size"])
    base = status_bytes(os.getpid(), "VmRSS")
    seconds, metrics = _timed(lambda: trainer.step(batch))
    peak = status_bytes(os.getpid(), "VmHWM")
    assert math.isfinite(metrics["loss"]) and torch.isfinite(next(model.parameters())).all()
    return {"base_gib": base / GIB, "peak_gib": peak / GIB, "seconds": seconds}


def run_child(spec: dict[str, Any], limit_gib: float, timeout_s: float) -> dict[str, Any]:
    """``memory_child`` in a subprocess, killed if its resident set passes ``limit_gib``."""
    return run_watched([sys.executable, "-m", "albatross.bench.trainer", "--child", json.dumps(spec)],
                       limit_gib, timeout_s)


def _project(points: list[dict[str, Any]], seq_len: int) -> tuple[float, float]:
    """(peak GiB, seconds) expected at ``seq_len`` from the last measured point, linear in T."""
    last = points[-1]
    scale = seq_len / last["seq_len"]
    peak = last["base_gib"] + (last["peak_gib"] - last["base_gib"]) * scale
    return peak, last["seconds"] * scale * 1.3 + 20  # attention grows faster than T; process start-up


def sweep_plan(lengths: list[int]) -> list[tuple[str, int]]:
    """(config, length) in priority order: all at the first length, the main curve, then the rest."""
    first, rest = lengths[0], lengths[1:]
    plan = [(name, first) for name in MEMORY_CONFIGS]
    for name in MEMORY_CONFIGS:  # chunked+ckpt first: the curve the fit uses
        plan += [(name, n) for n in rest]
    return plan


def memory_sweep(lengths: list[int], budget_s: float, limit_gib: float,
                 log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Run ``sweep_plan`` while memory and time allow; a configuration stops at its first miss."""
    deadline = time.monotonic() + budget_s
    rows: list[dict[str, Any]] = []
    measured: dict[str, list[dict[str, Any]]] = {name: [] for name in MEMORY_CONFIGS}
    stopped: set[str] = set()
    for name, seq_len in sweep_plan(lengths):
        if name in stopped:
            continue
        chunk, ckpt = MEMORY_CONFIGS[name]
        row: dict[str, Any] = {"config": name, "seq_len": seq_len}
        left = deadline - time.monotonic()
        reason = _skip_reason(measured[name], seq_len, limit_gib, left)
        if reason:
            row["status"] = reason
        else:  # a child may overrun the budget by up to its projected time, not more
            expected = _project(measured[name], seq_len)[1] if measured[name] else 120.0
            row.update(run_child({"seq_len": seq_len, "chunk": chunk, "ckpt": ckpt}, limit_gib,
                                 max(left, 2 * expected)))
        if row["status"] == "ok":
            measured[name].append(row)
        else:
            stopped.add(name)
        log(f"[bench trainer] memory {name} T={seq_len}: " + (
            f"peak {row['peak_gib']:.2f} GiB, {row['seconds']:.0f}s" if row["status"] == "ok"
            else row["status"]))
        rows.append(row)
    return rows


def _skip_reason(points: list[dict[str, Any]], seq_len: int, limit_gib: float, left_s: float) -> str:
    if not points:
        return "" if left_s > 0 else "no time left"
    peak, seconds = _project(points, seq_len)
    if peak > limit_gib:
        return f"skipped: projected {peak:.1f} GiB > {limit_gib:g}"
    if seconds > left_s:
        return f"skipped: projected {seconds:.0f}s > {max(left_s, 0):.0f}s left"
    return ""


def fit_line(points: list[dict[str, Any]]) -> tuple[float, float] | None:
    """Least-squares (intercept GiB, slope GiB per token) of peak vs length; None under two points."""
    if len(points) < 2:
        return None
    xs, ys = [p["seq_len"] for p in points], [p["peak_gib"] for p in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def fit_max_len(points: list[dict[str, Any]], target_gib: float = FIT_TARGET_GIB) -> int | None:
    """Longest T (a multiple of 1024) whose fitted peak stays under ``target_gib``."""
    line = fit_line(points)
    if line is None or line[1] <= 0:
        return None
    intercept, slope = line
    return int((target_gib - intercept) / slope) // 1024 * 1024


# report ---------------------------------------------------------------------------------------------


def _memory_result(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if r["config"] == "chunked+ckpt" and r["status"] == "ok"]
    line = fit_line(ok)
    return {"model": MEMORY_MODEL, "rows": rows, "max_seq_len_measured": max((r["seq_len"] for r in ok), default=0),
            "max_seq_len_projected": fit_max_len(ok),
            "bytes_per_token": None if line is None else line[1] * GIB,
            "max_seq_len_projected_method": "a projection, not a measurement: least-squares line through the "
            f"chunked+ckpt peaks (VmHWM) of the hidden-{MEMORY_MODEL['hidden_size']} memory model, "
            f"extrapolated to {FIT_TARGET_GIB:g} GiB"}


def _table_rows(tp: dict[str, Any], mem: dict[str, Any]) -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = []
    for name, r in tp["rows"].items():
        rows.append((f"{name}: real tokens/s", round(r["real_tokens_per_s"], 1)))
        rows.append((f"{name}: real-token share", round(r["real_token_share"], 3)))
    for r in mem["rows"]:
        shown = (f"{r['peak_gib']:.2f} GiB peak ({r['base_gib']:.2f} base), {r['seconds']:.0f}s"
                 if r["status"] == "ok" else r["status"])
        rows.append((f"memory {r['config']} T={r['seq_len']}", shown))
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    from albatross.bench.common import print_table, write_json

    if args.study:
        return study.run(args)

    quick = bool(args.quick)
    max_len = args.max_seq_len or (8192 if quick else 32768)
    budget = args.memory_budget_s or (150.0 if quick else 600.0)
    lengths = [n for n in (2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144)
               if n <= max_len and (quick or n >= 4096)]
    tp = bench_throughput(quick)
    mem = _memory_result(memory_sweep(lengths, budget, args.memory_limit_gib))
    rows = tp["rows"]
    result = {
        "packed_vs_padded_speedup": rows["packed"]["real_tokens_per_s"] / rows["padded"]["real_tokens_per_s"],
        "packed_vs_padded_speedup_cpu_time": rows["padded"]["cpu_seconds"] / rows["packed"]["cpu_seconds"],
        "packed_vs_sorted_padded_speedup": (rows["packed"]["real_tokens_per_s"]
                                            / rows["padded-sorted"]["real_tokens_per_s"]),
        "packed_vs_sorted_padded_speedup_cpu_time": (rows["padded-sorted"]["cpu_seconds"]
                                                     / rows["packed"]["cpu_seconds"]),
        "real_token_share": rows["packed"]["real_token_share"],
        "padded_real_token_share": rows["padded"]["real_token_share"],
        "sorted_padded_real_token_share": rows["padded-sorted"]["real_token_share"],
        "max_seq_len_projected": mem["max_seq_len_projected"],
        "max_seq_len_measured": mem["max_seq_len_measured"],
        "quick": quick, "throughput": tp, "memory": mem,
    }
    table = [("packed vs padded speedup", round(result["packed_vs_padded_speedup"], 2)),
             ("  same, by CPU time", round(result["packed_vs_padded_speedup_cpu_time"], 2)),
             ("packed vs length-sorted padded speedup", round(result["packed_vs_sorted_padded_speedup"], 2)),
             ("  same, by CPU time", round(result["packed_vs_sorted_padded_speedup_cpu_time"], 2)),
             *_table_rows(tp, mem), ("max seq len measured", result["max_seq_len_measured"]),
             ("chunked+ckpt bytes per token (fit)", round(mem["bytes_per_token"] or 0)),
             ("max seq len projected (24 GiB, straight line from a hidden-64 model)",
              result["max_seq_len_projected"])]
    print_table("albatross bench trainer", table)
    write_json(args.json, result)
    return result


if __name__ == "__main__" and len(sys.argv) == 3 and sys.argv[1] == "--child":
    print(json.dumps(memory_child(json.loads(sys.argv[2]))))
