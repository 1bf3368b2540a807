"""Warm start: supervised learning on oracle demonstrations, run through the real harness and sandbox.

Each demonstration is an attempt whose actions are the task's oracle steps (``solution/demo.json``),
played by a scripted engine, so the observations are the sandbox's real outputs and the sample has
exactly the token layout the policy will see in RL.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from albatross.config import RunConfig
from albatross.engine.scripted import ScriptedEngine
from albatross.harness.agent import Agent, AttemptSpec
from albatross.harness.chat import TinyTokenizer
from albatross.records import Sample
from albatross.tasks.format import Task

CACHE_VERSION = 1  # bump when the demo's tasks, tokenizer or model layout change


def collect_demonstrations(agent: Agent, tasks: list[Task], workers: int = 8) -> list[Sample]:
    """One demonstration per task with oracle steps; a demonstration that fails verification is skipped."""

    def one(task: Task) -> Sample | None:
        if not task.demo_steps:
            return None
        actions = [f"```bash\n{step}\n```" for step in task.demo_steps]
        engine = ScriptedEngine(actions, agent.fmt.action)
        traj = agent.run(AttemptSpec(task, "demo", 0), engine=engine)
        return traj.samples[0] if traj.success and traj.samples else None

    with ThreadPoolExecutor(workers) as pool:
        samples = [s for s in pool.map(one, tasks) if s is not None]
    return samples


def cache_key(cfg: RunConfig, tokenizer: TinyTokenizer, task_ids: list[str]) -> str:
    blob = json.dumps({"v": CACHE_VERSION, "model": cfg.model.model_dump(),
                       "warm": cfg.warmstart.model_dump(), "harness": cfg.harness.model_dump(),
                       "vocab": tokenizer.vocab, "tasks": sorted(task_ids), "seed": cfg.seed},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def warm_start(cfg: RunConfig, tokenizer: TinyTokenizer, agent: Agent, tasks: list[Task],
               pass_rate: Callable[[object], float], cache_root: Path,
               log: Callable[[str], None] = print) -> Path:
    """Build the tiny model and train it on demonstrations until its sampled train pass rate reaches the
    target (or the step budget ends). Cached under ``cache_root``; returns the model directory."""
    import torch

    from albatross.trainer.model import build_tiny, save_model
    from albatross.trainer.step import Trainer

    out = cache_root / f"demo-base-{cache_key(cfg, tokenizer, [t.id for t in tasks])}"
    if (out / "warmstart.json").is_file():
        log(f"[warm-start] using cached base model {out}")
        return out
    t0 = time.monotonic()
    demos = collect_demonstrations(agent, tasks)
    if not demos:
        raise RuntimeError("no oracle demonstration succeeded: check the tasks and the sandbox")
    log(f"[warm-start] {len(demos)} oracle demonstrations collected in {time.monotonic() - t0:.0f}s")
    torch.manual_seed(cfg.seed)
    model = build_tiny(cfg.model, tokenizer, seed=cfg.seed)
    trainer = Trainer(model, lr=cfg.warmstart.lr, micro_batch_tokens=cfg.trainer.micro_batch_tokens,
                      seed=cfg.seed)
    rng = random.Random(cfg.seed)
    history: list[dict] = []
    ws = cfg.warmstart
    for step in range(1, ws.steps + 1):
        metrics = trainer.sft_step(rng.sample(demos, min(ws.batch_size, len(demos))))
        if step % ws.check_every == 0 or step == ws.steps:
            rate = pass_rate(model)
            history.append({"step": step, "loss": float(metrics["loss"]), "pass_rate": rate})
            log(f"[warm-start] step {step:>4}/{ws.steps}  loss {metrics['loss']:.3f}  "
                f"train pass@1 {rate:.2f}  ({time.monotonic() - t0:.0f}s)")
            if rate >= ws.target_pass_rate:
                break
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(model, tokenizer, tmp)
    (tmp / "warmstart.json").write_text(json.dumps({"history": history, "demos": len(demos),
                                                   "seconds": time.monotonic() - t0}, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
