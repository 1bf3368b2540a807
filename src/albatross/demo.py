"""`albatross demo`: the whole loop on a laptop, end to end.

Tasks -> sandbox -> warm-started tiny model -> base eval -> async GRPO -> trained eval -> summary.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from albatross.config import RunConfig, load_config

QUICK_OVERRIDES = [
    "tasks.n_train=240", "tasks.n_heldout=8", "warmstart.steps=300", "warmstart.check_every=25",
    "orchestrator.max_steps=8", "orchestrator.max_minutes=1.0", "orchestrator.groups_per_step=2",
    "eval.trials=3",
]

SUMMARY_KEYS = (
    "base_pass_at_1", "trained_pass_at_1", "heldout_tasks", "train_steps", "wall_seconds",
    "tokens_per_solve_base", "tokens_per_solve_trained", "zero_signal_group_fraction",
    "dropped_stale_tokens", "max_staleness_seen", "infra_error_attempts",
)


def cache_root() -> Path:
    return Path(os.environ.get("ALBATROSS_CACHE", Path.home() / ".cache" / "albatross"))


def demo_config(config_path: str | None, quick: bool, out: str | None, overrides: list[str]) -> RunConfig:
    path = config_path
    if path is None:  # the repo's recipe (configs/demo.toml) when run from a checkout, else the defaults
        repo_cfg = Path(__file__).resolve().parents[2] / "configs" / "demo.toml"
        path = str(repo_cfg) if repo_cfg.is_file() else None
    extra = (QUICK_OVERRIDES if quick else []) + list(overrides)
    if out:
        extra.append(f"out={json.dumps(out)}")
    return load_config(path, extra)


class Demo:
    """Runs the demo pipeline; each stage logs progress lines."""

    def __init__(self, cfg: RunConfig, log: Callable[[str], None] = print, resume: bool = False) -> None:
        self.cfg, self.log, self.resume = cfg, log, resume
        self.out = Path(cfg.out).resolve()

    @classmethod
    def resumed(cls, out_dir: str | Path, log: Callable[[str], None] = print) -> Demo:
        """Continue a stopped or crashed run from its directory (its config.json and state.json)."""
        path = Path(out_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: not a run directory (no config.json)")
        return cls(RunConfig.model_validate_json(path.read_text()), log, resume=True)

    def run(self) -> dict[str, Any]:
        import torch

        from albatross.eval.run import evaluate
        from albatross.orchestrator.loop import AsyncLoop
        from albatross.trainer.model import load_model, num_parameters
        from albatross.trainer.sft import warm_start

        t0 = time.monotonic()
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        self._prepare_out()
        train, heldout, tokenizer = self._tasks()
        backend = self._backend()
        try:
            agent = make_agent(cfg, None, backend, tokenizer)
            torch.set_num_threads(cfg.engine.threads)
            base_dir = warm_start(cfg, tokenizer, agent, train, self._pass_rate_fn(agent, train),
                                  cache_root(), self.log)
            torch.set_num_threads(cfg.engine.threads)
            model = load_model(base_dir)
            self.log(f"[model] {num_parameters(model) / 1e6:.2f}M parameters, vocab {tokenizer.vocab_size}")
            ray_run = self._ray(base_dir, tokenizer) if cfg.orchestrator.backend == "ray" else None
            agent.engine = engine = ray_run.engine if ray_run else self._engine(model, base_dir)
            try:
                base = self._base_eval(agent, heldout)
                self.log(f"[eval] base held-out pass@1 {base.pass_at_1:.3f} ({len(heldout)} tasks "
                         f"x {cfg.eval.trials} trials)")
                loop = AsyncLoop(cfg, agent, engine, train, base_dir, self.out / "run", self.log,
                                 resume=self.resume, launcher=ray_run)
                state = loop.run()
                (self.out / "eval_trained.jsonl").unlink(missing_ok=True)  # a resumed run evaluates anew
                trained = evaluate(agent, heldout, cfg.eval.trials, out_jsonl=self.out / "eval_trained.jsonl")
                self.log(f"[eval] trained held-out pass@1 {trained.pass_at_1:.3f}")
            finally:
                if ray_run is not None:
                    ray_run.close()
                else:
                    engine.close()
        finally:
            backend.close()
        summary = self._summary(base, trained, state, loop, len(heldout), time.monotonic() - t0)
        self._report()
        return summary

    def _engine(self, model, base_dir: Path):
        """One in-process engine, or a pool of replicas (in-process, or `albatross serve` processes)."""
        import copy

        from albatross.engine.builtin import BuiltinEngine
        from albatross.engine.pool import EnginePool, LocalReplica

        ec = self.cfg.engine
        if ec.process:
            return EnginePool.of_processes(base_dir, ec.replicas, self.out / "logs", threads=ec.threads,
                                           max_batch_size=ec.max_batch_size, log=self.log)
        if ec.replicas == 1:
            return BuiltinEngine(model, max_batch_size=ec.max_batch_size)
        return EnginePool([LocalReplica(BuiltinEngine(copy.deepcopy(model), max_batch_size=ec.max_batch_size))
                           for _ in range(ec.replicas)], log=self.log)

    def _ray(self, base_dir: Path, tokenizer):
        from albatross.orchestrator.ray_backend import RayRun

        return RayRun(self.cfg, base_dir, self.out / "run", tokenizer, self._hide_paths(), self.log)

    def _report(self) -> None:
        from albatross.eval.report import write_report

        path = write_report([self.out], self.out / "report.html")
        self.log(f"[report] {path}")

    def _prepare_out(self) -> None:
        """A fresh run starts from an empty output directory; a resumed one keeps everything."""
        import shutil

        if not self.resume:
            for name in ("run", "tasks"):
                shutil.rmtree(self.out / name, ignore_errors=True)
            for name in ("eval_base.jsonl", "eval_trained.jsonl", "summary.json"):
                (self.out / name).unlink(missing_ok=True)
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.json").write_text(self.cfg.model_dump_json(indent=2))

    def _base_eval(self, agent, heldout):
        """Evaluate the base model; a resumed run only runs the (task, trial) pairs not yet scored."""
        from albatross.eval.run import EvalResult, evaluate, final_records, finished_pairs, load_attempts
        from albatross.records import STATUS_INFRA_ERROR, Trajectory

        path = self.out / "eval_base.jsonl"
        if not self.resume:
            path.unlink(missing_ok=True)
        done = finished_pairs(load_attempts(path))
        if done:
            self.log(f"[resume] base evaluation: {len(done)} attempts already scored")
        evaluate(agent, heldout, self.cfg.eval.trials, out_jsonl=path, skip=done)
        rows = load_attempts(path)
        result = EvalResult([Trajectory.from_dict(r) for r in final_records(rows).values()])
        result.counts["infra_error_attempts"] = sum(r.get("status") == STATUS_INFRA_ERROR for r in rows)
        return result

    def _tasks(self):
        from albatross.tasks.builtin import generate_tasks
        from albatross.tasks.format import load_tasks

        tc = self.cfg.tasks
        generated = self.out / "tasks"
        if tc.train:
            train, heldout = load_tasks(tc.train), load_tasks(tc.heldout)
        elif self.resume and (generated / "train").is_dir():
            train, heldout = load_tasks(generated / "train"), load_tasks(generated / "heldout")
        else:
            paths = generate_tasks(self.out / "tasks", families=tc.families or None, n_train=tc.n_train,
                                   n_heldout=tc.n_heldout, seed=tc.seed)
            train, heldout = load_tasks(paths["train"]), load_tasks(paths["heldout"])
        self.log(f"[tasks] {len(train)} train, {len(heldout)} held-out tasks")
        return train, heldout, demo_tokenizer(tc.families)

    def _backend(self):
        from albatross.sandbox import backend_from_config

        backend = backend_from_config(self.cfg.sandbox, hide_paths=self._hide_paths())
        self.log(f"[sandbox] backend {backend.name} (isolated: {backend.isolated})")
        return backend

    def _hide_paths(self) -> list[str]:
        return [str(self.out), str(cache_root())]

    def _pass_rate_fn(self, agent, train) -> Callable[[Any], float]:
        import copy
        import random

        from albatross.engine.builtin import BuiltinEngine
        from albatross.eval.run import evaluate

        rng = random.Random(self.cfg.seed)

        def pass_rate(model) -> float:
            tasks = rng.sample(train, min(self.cfg.warmstart.check_tasks, len(train)))
            engine = BuiltinEngine(copy.deepcopy(model).eval(), max_batch_size=self.cfg.engine.max_batch_size)
            try:
                agent.engine = engine
                return evaluate(agent, tasks, 2).pass_at_1
            finally:
                engine.close()
                agent.engine = None

        return pass_rate

    def _summary(self, base, trained, state, loop, n_heldout: int, seconds: float) -> dict[str, Any]:
        groups = max(1, loop.builder.counts["groups"])
        summary = {
            "base_pass_at_1": round(base.pass_at_1, 4),
            "trained_pass_at_1": round(trained.pass_at_1, 4),
            "heldout_tasks": n_heldout,
            "train_steps": state.step,
            "wall_seconds": round(seconds, 1),
            "tokens_per_solve_base": round(base.tokens_per_solve, 2),
            "tokens_per_solve_trained": round(trained.tokens_per_solve, 2),
            "zero_signal_group_fraction": round(loop.builder.counts["dropped_zero_signal"] / groups, 4),
            "dropped_stale_tokens": int(loop.counts["dropped_stale_tokens"]),
            "max_staleness_seen": int(state.max_staleness_seen),
            "infra_error_attempts": int(loop.counts["infra_error_attempts"] + base.infra_errors
                                        + trained.infra_errors),
            "eval_trials": self.cfg.eval.trials,
            "seed": self.cfg.seed,
        }
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary


def demo_tokenizer(families: list[str] | None = None):
    """The tiny model's tokenizer: the corpus of the built-in families it trains on (the demo's three by
    default), so that adding families elsewhere never changes the demo model's vocabulary."""
    from albatross.harness.chat import TinyTokenizer
    from albatross.tasks.builtin import DEMO_FAMILIES, corpus_strings

    return TinyTokenizer.from_corpus(corpus_strings(families or DEMO_FAMILIES))


def make_agent(cfg: RunConfig, engine, backend, tokenizer):
    """The agent of a run config: the one constructor that `train`, `eval` and the demo share."""
    from albatross.harness.agent import build_agent

    return build_agent(cfg, engine, backend, tokenizer)


def format_table(summary: dict[str, Any]) -> str:
    width = max(len(k) for k in summary)
    lines = ["", "albatross demo: results", "-" * (width + 14)]
    lines += [f"{k:<{width}}  {v}" for k, v in summary.items()]
    return "\n".join(lines)
