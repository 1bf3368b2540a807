"""Probe tasks under exactly the training configuration: N >= 4 attempts each, one group per task.

The attempts go through the training harness (``build_agent``: the same chat format, turn and token budgets,
sampling and sandbox limits) and ``run_with_retries`` (infrastructure errors retried, never scored); each task's
group is scored as training scores groups (``tasks/probe.py`` ``score_row``). The model is served by the engine
of the config's ``[engine]`` (``model_agent``): vLLM / SGLang servers launched or attached, with their tensor
parallelism and replicas, or the built-in engine on the GPU when there is one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from albatross.harness.agent import AgentLoop, AttemptSpec
from albatross.harness.retry import run_with_retries
from albatross.rl.scoring import GroupScorer
from albatross.tasks.format import Task
from albatross.tasks.probe import MIN_ATTEMPTS, ProbeRow, score_row


def probe(agent: AgentLoop, tasks: list[Task], attempts: int, scorer: GroupScorer, retries: int = 3, workers: int = 8,
          progress: Callable[[ProbeRow], None] | None = None) -> list[ProbeRow]:
    """Run ``attempts`` attempts at every task with ``agent`` and score each task's group with
    ``scorer`` (a ``GroupScorer``). Rows come back in task order."""
    if attempts < MIN_ATTEMPTS:
        raise ValueError(f"attempts must be at least {MIN_ATTEMPTS} (DESIGN.md: probe each task >= 4 times)")
    counts: dict[str, Counter[str]] = {t.id: Counter() for t in tasks}
    specs = [AttemptSpec(t, f"probe-{t.id}", i) for t in tasks for i in range(attempts)]
    with ThreadPoolExecutor(max(1, workers), thread_name_prefix="probe") as pool:
        futures = [pool.submit(run_with_retries, agent, s, retries, counts[s.task.id]) for s in specs]
        rows = []
        for i, task in enumerate(tasks):
            trajs = [f.result() for f in futures[i * attempts:(i + 1) * attempts]]
            rows.append(score_row(task, trajs, scorer, counts[task.id]["infra_error_attempts"]))
            if progress is not None:
                progress(rows[-1])
    return rows


def model_agent(cfg: Any, backend: Any, model_dir: Path, tokenizer_dir: Path, run_dir: Path,
                log: Callable[[str], None] = print, adapter: Path | None = None) -> tuple[Any, Any]:
    """The training harness around ``model_dir`` served by ``[engine]`` (``make_engine``, with no trainer holding
    GPUs: servers from GPU 0 on; logs in ``run_dir/logs``), and that engine, which the caller closes. ``adapter``:
    a LoRA adapter directory (PEFT format) on ``model_dir``, served as weight version 1 (vLLM loads it hot, the
    built-in engine merges it)."""
    import torch

    from albatross.engine.launch import make_engine
    from albatross.engine.tokenizer import load_tokenizer
    from albatross.harness.agent import build_agent

    tokenizer = load_tokenizer(tokenizer_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir / 'config.json'}: missing (--model must be a model directory)")
    torch.set_num_threads(cfg.engine.threads)
    rank = None
    if adapter is not None:
        from albatross.engine.adapter import adapter_rank

        rank = adapter_rank(adapter)
    engine = make_engine(cfg, model_dir, run_dir, log, trainer_gpus=0, adapter_rank=rank)
    try:
        if adapter is not None:
            engine.update_weights(str(adapter), 1)
            log(f"[engine] LoRA adapter {adapter} (rank {rank}) on {model_dir}")
        return build_agent(cfg, engine, backend, tokenizer), engine
    except BaseException:
        engine.close()
        raise
