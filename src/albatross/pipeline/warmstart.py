"""Warm start: supervised learning before RL, on oracle demonstrations or on a JSONL of chats.

``oracle``: each demonstration is an attempt whose actions are the task's oracle steps (``solution/demo.json``),
played by a scripted engine through the real harness and sandbox, so the observations are the sandbox's real
outputs and the sample has exactly the token layout the policy will see in RL (the model's own chat template).
``chats``: each line ``{"messages": [...]}`` rendered with the model's chat template; assistant messages are
trained on. Either trains until the sampled train pass rate reaches ``warmstart.target_pass_rate`` or the step
budget ends; the result is cached under the cache root by a key over the model, the settings and the tasks'
contents.
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
from typing import TYPE_CHECKING, Any

from albatross.config import RunConfig
from albatross.errors import UserError
from albatross.records import Sample
from albatross.tasks.format import Task

if TYPE_CHECKING:
    from albatross.harness.agent import Agent

CACHE_VERSION = 4  # bump when the demo's tasks, tokenizer or model layout change


def warm_start_source(cfg: RunConfig) -> str:
    """``warmstart.source`` resolved: ``auto`` is ``oracle`` for the demo's tiny model, ``off`` for ``model.path``."""
    source = cfg.warmstart.source
    if source == "auto":
        return "off" if cfg.model.path else "oracle"
    if source == "chats" and not cfg.warmstart.chats:
        raise UserError("warmstart.source = \"chats\" needs warmstart.chats (a JSONL file of chats)")
    return source


def demonstrated(tasks: list[Task], reward_only: list[str]) -> list[Task]:
    """The tasks whose demonstrations the warm start may use: those of families not in ``reward_only``
    (``tasks.reward_only_families``). None left is a ``UserError``."""
    from albatross.tasks.format import family_of

    kept = [t for t in tasks if family_of(t) not in set(reward_only)]
    if tasks and not kept:
        raise UserError(f"tasks.reward_only_families = {reward_only}: every training task is reward-only, so the "
                        "warm start has no demonstration to learn from (set warmstart.source = \"off\")")
    return kept


def collect_demonstrations(agent: Agent, tasks: list[Task], workers: int = 8) -> list[Sample]:
    """One demonstration per task with oracle steps; a demonstration that fails verification is skipped. None
    succeeding is a ``UserError`` naming the first task and how its demonstration ended."""
    from albatross.engine.scripted import ScriptedEngine
    from albatross.harness.agent import AttemptSpec
    from albatross.harness.parsers import write_command

    ended: dict[str, str] = {}

    def one(task: Task) -> Sample | None:
        if not task.demo_steps:
            ended.setdefault(task.id, "no oracle steps (solution/demo.json)")
            return None
        actions = [write_command(step, agent.tool_calls) for step in task.demo_steps]
        engine = ScriptedEngine(actions, agent.fmt.action)
        traj = agent.run(AttemptSpec(task, "demo", 0), engine=engine)
        if traj.success and traj.samples:
            return traj.samples[0]
        ended.setdefault(task.id, f"status {traj.status}, score {traj.reward.score:.2f}")
        return None

    with ThreadPoolExecutor(workers) as pool:
        samples = [s for s in pool.map(one, tasks) if s is not None]
    if not samples and tasks:
        first = sorted(ended)[0] if ended else tasks[0].id
        raise UserError(f"warm start: no oracle demonstration of the {len(tasks)} training tasks succeeded "
                        f"({first}: {ended.get(first, '?')}; a prompt over harness.max_context_tokens ends as "
                        "max_context)")
    return samples


def chat_samples(path: str | Path, tokenizer: Any) -> list[Sample]:
    """Samples of a JSONL of chats, rendered with the tokenizer's chat template: each assistant message's tokens
    are trained on, everything else is context. A chat whose rendering is not append-only is refused."""
    samples = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            messages = json.loads(line)["messages"]
            samples.append(_chat_sample(messages, tokenizer))
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"{path}:{n}: not a chat this model's template can render: {e}") from None
    if not samples:
        raise UserError(f"{path}: no chats")
    return samples


def _render(tokenizer: Any, messages: list[dict[str, Any]], generation: bool) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation)
    ids = out["input_ids"] if hasattr(out, "keys") else out  # transformers 5 returns a BatchEncoding, 4 a list
    return list(ids)


def _chat_sample(messages: list[dict[str, Any]], tokenizer: Any) -> Sample:
    sample = Sample([], [], [], [])
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        prompt = _render(tokenizer, messages[:i], generation=True)
        full = _render(tokenizer, messages[: i + 1], generation=False)
        if prompt[: len(sample.token_ids)] != sample.token_ids or full[: len(prompt)] != prompt:
            raise ValueError(f"message {i}: the template re-renders earlier turns (not append-only)")
        sample.extend(prompt[len(sample.token_ids):], model=False)
        sample.extend(full[len(prompt):], model=True, logprobs=[0.0] * (len(full) - len(prompt)),
                      versions=[0] * (len(full) - len(prompt)))
    if not sample.num_model_tokens:
        raise ValueError("no assistant message")
    return sample


def cache_key(cfg: RunConfig, source: str, tokenizer: Any, tasks: list[Task], model_dir: Path | None) -> str:
    """Over everything that changes the warm-started model: the model (its files' sizes and times, or the tiny
    model's fields and vocabulary), the warm-start, harness and sampling settings, and the tasks' contents."""
    h = hashlib.sha256()
    blob = {"v": CACHE_VERSION, "source": source, "model": cfg.model.model_dump(), "warm": cfg.warmstart.model_dump(),
            "harness": cfg.harness.model_dump(), "seed": cfg.seed,
            # transformers: a fast tokenizer has ``vocab``, others only ``get_vocab()`` (the key keeps its form)
            "vocab": getattr(tokenizer, "vocab", None) or sorted(tokenizer.get_vocab().items())}
    h.update(json.dumps(blob, sort_keys=True, default=str).encode())
    if model_dir is not None:
        for f in sorted(model_dir.iterdir()):
            h.update(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}".encode())
    for task in sorted(tasks, key=lambda t: t.id):
        _hash_tree(h, task.path)
    if source == "chats":
        h.update(Path(cfg.warmstart.chats).read_bytes())
    return h.hexdigest()[:16]


def _hash_tree(h: Any, root: Path) -> None:
    for f in sorted(p for p in Path(root).rglob("*") if p.is_file()):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())


def warm_start(cfg: RunConfig, tokenizer: Any, agent: Any, tasks: list[Task], model_dir: Path | None,
               pass_rate: Callable[[Any], float], cache_root: Path, log: Callable[[str], None] = print,
               on_step: Callable[[int, dict[str, float]], None] | None = None) -> Path:
    """The model directory RL starts from: ``model_dir`` itself when the warm start is off, else the
    warm-started copy (``model_dir`` None: the demo's tiny model, built here), cached under ``cache_root``.
    ``on_step(step, metrics)`` after each SFT step (progress and metrics logging); ``warmstart.json`` of the
    result says why it stopped (``stop_reason``)."""
    source = warm_start_source(cfg)
    if source == "off":
        if model_dir is None:
            raise UserError("warmstart.source = \"off\" needs model.path (the demo's tiny model starts untrained)")
        return model_dir
    tasks = demonstrated(tasks, cfg.tasks.reward_only_families)
    out = cache_root / f"warm-{cache_key(cfg, source, tokenizer, tasks, model_dir)}"
    if (out / "warmstart.json").is_file():
        log(f"[warm-start] using cached model {out}")
        return out
    t0 = time.monotonic()
    if source == "chats":
        demos = chat_samples(cfg.warmstart.chats, tokenizer)
        log(f"[warm-start] {len(demos)} chats from {cfg.warmstart.chats}")
    else:
        demos = collect_demonstrations(agent, tasks)
        log(f"[warm-start] {len(demos)} oracle demonstrations collected in {time.monotonic() - t0:.0f}s")
    model, history, reason = _train(cfg, tokenizer, demos, model_dir, pass_rate, log, t0, on_step)
    _save(model, tokenizer, model_dir, out, {"history": history, "demos": len(demos), "source": source,
                                              "seconds": time.monotonic() - t0, "stop_reason": reason})
    return out


def _train(cfg: RunConfig, tokenizer: Any, demos: list[Sample], model_dir: Path | None,
           pass_rate: Callable[[Any], float], log: Callable[[str], None], t0: float,
           on_step: Callable[[int, dict[str, float]], None] | None = None) -> tuple[Any, list[dict[str, Any]], str]:
    import torch

    from albatross.devices import trainer_device
    from albatross.pipeline.demo import build_tiny
    from albatross.trainer.model import load_model, to_device
    from albatross.trainer.step import Trainer

    torch.manual_seed(cfg.seed)
    model = build_tiny(cfg.model, tokenizer, seed=cfg.seed) if model_dir is None else load_model(model_dir)
    trainer = Trainer.from_config(to_device(model, trainer_device(cfg.trainer.device)), cfg, lr=cfg.warmstart.lr, lora=False)
    rng = random.Random(cfg.seed)
    history: list[dict[str, Any]] = []
    ws = cfg.warmstart
    reason = f"warmstart.steps ({ws.steps}) done"  # why it stopped, said by the run's progress line
    for step in range(1, ws.steps + 1):
        metrics = trainer.sft_step(rng.sample(demos, min(ws.batch_size, len(demos))))
        checked = step % ws.check_every == 0 or step == ws.steps
        if checked:
            rate = pass_rate(model)
            history.append({"step": step, "loss": float(metrics["loss"]), "pass_rate": rate})
            log(f"[warm-start] step {step:>4}/{ws.steps}  loss {metrics['loss']:.3f}  "
                f"train pass@1 {rate:.2f}  ({time.monotonic() - t0:.0f}s)")
        if on_step is not None:
            on_step(step, history[-1] if checked else {"step": step, "loss": float(metrics["loss"])})
        if checked and rate >= ws.target_pass_rate:
            reason = (f"target reached at step {step} (train pass@1 {rate:.2f} >= warmstart.target_pass_rate "
                      f"{ws.target_pass_rate:g})")
            break
    return model.cpu(), history, reason


def _save(model: Any, tokenizer: Any, model_dir: Path | None, out: Path, info: dict[str, Any]) -> None:
    from albatross.pipeline.demo import save_model
    from albatross.pipeline.model import copy_tokenizer_files

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model(model, tokenizer, tmp)
    if model_dir is not None:
        copy_tokenizer_files(model_dir, tmp)  # the directory's own files, chat template included
    (tmp / "warmstart.json").write_text(json.dumps(info, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
