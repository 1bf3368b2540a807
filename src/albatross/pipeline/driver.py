"""The run driver behind ``albatross train`` (and ``albatross demo``, one recipe of it), for any model.

Stages: tasks -> model (``model.path`` checked, or the demo's tiny model) -> warm start (optional) -> base eval
-> asynchronous RL -> trained eval -> final model, summary and report. Each stage logs progress lines; a resumed
run (``--resume``) keeps what is done and continues.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from albatross.cache import cache_root
from albatross.config import RunConfig
from albatross.errors import UserError
from albatross.pipeline import summary as summ


class Pipeline:
    """One run of a config: ``run()`` returns the summary (also written to ``<out>/summary.json``)."""

    def __init__(self, cfg: RunConfig, log: Callable[[str], None] = print, resume: bool = False,
                 command: str = "train", overwrite: bool = False) -> None:
        self.cfg, self.log, self.resume, self.command, self.overwrite = cfg, log, resume, command, overwrite
        if not cfg.out:
            cfg.out = default_out(cfg.name)
        self.out = Path(cfg.out).resolve()
        self.model_name = cfg.model.path  # as given: a directory or a Hugging Face id (summary.json names it)

    @classmethod
    def resumed(cls, out_dir: str | Path, log: Callable[[str], None] = print) -> Pipeline:
        """Continue a stopped or crashed run from its directory (its config.json and state.json)."""
        path = Path(out_dir) / "config.json"
        if not path.is_file():
            raise UserError(f"{path}: not a run directory (no config.json)")
        marker = Path(out_dir) / "command"
        command = marker.read_text().strip() if marker.is_file() else "train"
        return cls(RunConfig.model_validate_json(path.read_text()), log, resume=True, command=command)

    @property
    def title(self) -> str:
        return f"albatross {self.command}: results"

    def run(self) -> dict[str, Any]:
        import torch

        t0 = time.monotonic()
        torch.manual_seed(self.cfg.seed)
        self._claim_out()
        self._prepare_out()
        train, heldout = self._tasks()
        tokenizer, model_dir = self._model()
        backend = self._backend()
        try:
            results = self._run_with(backend, tokenizer, model_dir, train, heldout)
        finally:
            backend.close()
        out = self._summary(*results, n_heldout=len(heldout), seconds=time.monotonic() - t0)
        self._report()
        return out

    def _run_with(self, backend: Any, tokenizer: Any, model_dir: Path | None, train: list, heldout: list) -> tuple:
        from albatross.harness.agent import build_agent
        from albatross.orchestrator.loop import AsyncLoop
        from albatross.pipeline.model import describe
        from albatross.pipeline.warmstart import warm_start

        cfg = self.cfg
        agent = build_agent(cfg, None, backend, tokenizer)
        base_dir = warm_start(cfg, tokenizer, agent, train, model_dir, self._pass_rate_fn(agent, train),
                              cache_root(), self.log)
        info = describe(self.model_name, base_dir)
        self.log(f"[model] {info.architecture}, {info.parameters / 1e6:.2f}M parameters, from {base_dir}")
        ray_run = self._ray(base_dir, tokenizer) if cfg.orchestrator.backend == "ray" else None
        engine = ray_run.engine if ray_run else self._engine(base_dir)
        agent.engine = engine
        evaluator = build_agent(self._eval_config(), engine, backend, tokenizer)
        try:
            base = self._base_eval(evaluator, heldout)
            loop = AsyncLoop(cfg, agent, engine, train, base_dir, self.out / "run", self.log,
                             resume=self.resume, launcher=ray_run)
            state = loop.run()
            trained = self._trained_eval(evaluator, heldout)
            self.validation_result = self._validation_eval(evaluator)
            version = int(engine.version)
        finally:
            if ray_run is not None:
                ray_run.close()
            else:
                engine.close()
        self._export_final(base_dir, state.version)
        return base, trained, state, loop, info, version

    # ---- stages -------------------------------------------------------------------------------
    def _claim_out(self) -> None:
        """A new run never writes into a directory that holds files: one line (exit 2) unless ``--resume``
        continues it or ``--overwrite`` replaces it (only a run directory, one with config.json)."""
        out = self.out
        if self.resume or not out.is_dir() or not any(out.iterdir()):
            return
        if not self.overwrite:
            hint = (f"`albatross train --resume {out}` continues it, " if (out / "config.json").is_file() else "")
            raise UserError(f"out {str(out)!r} already holds files: {hint}--overwrite replaces it, or choose "
                            "another out (no out: a new runs/<name>-<time> directory)")
        if not (out / "config.json").is_file():
            raise UserError(f"out {str(out)!r}: --overwrite replaces only a run directory (with config.json); "
                            "this one is not: choose another out")
        self.log(f"[out] --overwrite: removing the previous run in {out}")
        for child in out.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()

    def _prepare_out(self) -> None:
        """A fresh run starts from an empty output directory; a resumed one keeps everything."""
        out = self.out
        if out.exists() and not out.is_dir():
            raise UserError(f"out = {str(out)!r}: a file, not a directory")
        if not self.resume:
            for name in ("run", "tasks", "final"):
                shutil.rmtree(out / name, ignore_errors=True)
            for name in ("eval_base.jsonl", "eval_trained.jsonl", "eval_validation.jsonl", "summary.json"):
                (out / name).unlink(missing_ok=True)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(self.cfg.model_dump_json(indent=2))
        (out / "command").write_text(self.command + "\n")  # what `--resume` continues and its title names

    def _tasks(self) -> tuple[list, list]:
        """Training and held-out tasks (``tasks.train`` / ``heldout``, or generated built-in ones); generated
        validation tasks go to ``self.validation``."""
        from albatross.tasks.builtin import generate_tasks
        from albatross.tasks.format import load_tasks

        tc = self.cfg.tasks
        generated = self.out / "tasks"
        self.validation: list = []
        if tc.train:
            train, heldout = load_tasks(tc.train), load_tasks(tc.heldout) if tc.heldout else []
        else:
            if not (self.resume and (generated / "train").is_dir()):
                try:
                    generate_tasks(generated, families=tc.families or None, n_train=tc.n_train,
                                   n_heldout=tc.n_heldout, seed=tc.seed, n_validation=tc.n_validation,
                                   heldout_families=tc.heldout_families)
                except (KeyError, ValueError) as e:
                    raise UserError(f"tasks.families / tasks.heldout_families: {e}") from None
            train, heldout = load_tasks(generated / "train"), load_tasks(generated / "heldout")
            if tc.n_validation:
                self.validation = load_tasks(generated / "validation")
        if not train:
            raise UserError(f"tasks.train {tc.train}: no task directories found")
        self.log(f"[tasks] {len(train)} train, {len(heldout)} held-out"
                 + (f", {len(self.validation)} validation" if self.validation else "") + " tasks"
                 + (f" (held-out families: {', '.join(tc.heldout_families)})" if tc.heldout_families else ""))
        return train, heldout

    def _model(self) -> tuple[Any, Path | None]:
        """The tokenizer and the directory of ``model.path`` (checked), or the demo's tokenizer and None (its
        tiny model is built by the warm start)."""
        from albatross.pipeline.demo import demo_tokenizer
        from albatross.pipeline.model import check_model_dir

        if self.cfg.model.path:
            path = self._resolve_model()
            return check_model_dir(path, self.cfg.harness.action_format), path
        return demo_tokenizer(self.cfg.tasks.families, self.cfg.tasks.heldout_families), None

    def _resolve_model(self) -> Path:
        """``model.path`` as a directory: a Hugging Face id becomes its snapshot in the local cache (downloaded
        where the hub is reachable); the run then uses that directory everywhere (config.json records it)."""
        from albatross.pipeline.model import resolve_model_path

        given = self.cfg.model.path
        path = resolve_model_path(given, self.log)
        if str(path) != given:
            self.log(f"[model] {given}: {path}")
            self.cfg.model.path = str(path)
            (self.out / "config.json").write_text(self.cfg.model_dump_json(indent=2))
        return path

    def _backend(self) -> Any:
        from albatross.sandbox import backend_from_config

        backend = backend_from_config(self.cfg.sandbox, hide_paths=self._hide_paths())
        self.log(f"[sandbox] backend {backend.name} (isolated: {backend.isolated})")
        return backend

    def _hide_paths(self) -> list[str]:
        return [str(self.out), str(cache_root())] + ([self.cfg.model.path] if self.cfg.model.path else [])

    def _engine(self, base_dir: Path) -> Any:
        """The rollout engine of ``[engine]`` (``engine/launch.py``): built-in, or vLLM / SGLang servers launched
        or attached, serving ``base_dir`` at version 0."""
        from albatross.engine.launch import make_engine

        return make_engine(self.cfg, base_dir, self.out / "run", self.log)

    def _ray(self, base_dir: Path, tokenizer: Any) -> Any:
        from albatross.orchestrator.ray_backend import RayRun

        return RayRun(self.cfg, base_dir, self.out / "run", tokenizer, self._hide_paths(), self.log)

    def _eval_config(self) -> RunConfig:
        """The run's config with evaluation's sampling temperature (``eval.temperature``)."""
        sampling = self.cfg.sampling.model_copy(update={"temperature": self.cfg.eval.temperature})
        return self.cfg.model_copy(update={"sampling": sampling})

    def _pass_rate_fn(self, agent: Any, train: list) -> Callable[[Any], float]:
        """The warm start's stopping check: pass@1 of a copy of the model on a sample of training tasks."""
        import copy
        import random

        from albatross.devices import engine_device
        from albatross.engine.builtin import BuiltinEngine
        from albatross.eval.run import evaluate

        rng = random.Random(self.cfg.seed)
        device = str(engine_device(self.cfg.engine.device, self.cfg.trainer.gpus))

        def pass_rate(model: Any) -> float:
            tasks = rng.sample(train, min(self.cfg.warmstart.check_tasks, len(train)))
            engine = BuiltinEngine(copy.deepcopy(model).eval(), device=device,
                                   max_batch_size=self.cfg.engine.max_batch_size)
            try:
                agent.engine = engine
                return evaluate(agent, tasks, 2).pass_at_1
            finally:
                engine.close()
                agent.engine = None

        return pass_rate

    def _base_eval(self, agent: Any, heldout: list) -> Any:
        """Evaluate the starting model; a resumed run only runs the (task, trial) pairs not yet scored."""
        from albatross.eval.run import EvalResult, evaluate, final_records, finished_pairs, load_attempts
        from albatross.records import STATUS_INFRA_ERROR, Trajectory

        if not heldout:
            self.log("[eval] no held-out tasks (tasks.heldout is empty): evaluation skipped")
            return None
        path = self.out / "eval_base.jsonl"
        done = finished_pairs(load_attempts(path))
        if done:
            self.log(f"[resume] base evaluation: {len(done)} attempts already scored")
        evaluate(agent, heldout, self.cfg.eval.trials, out_jsonl=path, skip=done)
        rows = load_attempts(path)
        result = EvalResult([Trajectory.from_dict(r) for r in final_records(rows).values()])
        result.counts["infra_error_attempts"] = sum(r.get("status") == STATUS_INFRA_ERROR for r in rows)
        self.log(f"[eval] base held-out pass@1 {_fmt(result)} ({len(heldout)} tasks x {self.cfg.eval.trials} "
                 f"trials, temperature {self.cfg.eval.temperature})")
        return result

    def _trained_eval(self, agent: Any, heldout: list) -> Any:
        from albatross.eval.run import evaluate

        if not heldout:
            return None
        (self.out / "eval_trained.jsonl").unlink(missing_ok=True)  # a resumed run evaluates anew
        result = evaluate(agent, heldout, self.cfg.eval.trials, out_jsonl=self.out / "eval_trained.jsonl")
        self.log(f"[eval] trained held-out pass@1 {_fmt(result)}")
        return result

    def _validation_eval(self, agent: Any) -> Any:
        """The trained model on the validation split (``tasks.n_validation``): the figure to tune on."""
        from albatross.eval.run import evaluate

        if not self.validation:
            return None
        result = evaluate(agent, self.validation, self.cfg.eval.trials, out_jsonl=self.out / "eval_validation.jsonl")
        self.log(f"[eval] trained validation pass@1 {_fmt(result)}")
        return result

    def _export_final(self, base_dir: Path, version: int) -> None:
        """``<out>/final``: the last trained weights with the model's tokenizer and chat template, a directory
        that loads with transformers (``AutoModelForCausalLM.from_pretrained``) and serves with any engine."""
        from albatross.pipeline.model import copy_tokenizer_files
        from albatross.trainer.checkpoint import version_dir

        src = version_dir(self.out / "run" / "weights", version) if version else base_dir
        if not src.is_dir():  # engine.weight_sync = "nccl" writes no weights: the checkpoints hold them
            self.log(f"[model] no exported weights of version {version} ({src}); see run/checkpoints")
            return
        final = self.out / "final"
        shutil.rmtree(final, ignore_errors=True)
        shutil.copytree(src, final)
        copy_tokenizer_files(base_dir, final)
        self.log(f"[model] final weights (version {version}): {final}")

    def _report(self) -> None:
        from albatross.eval.report import write_report

        path = write_report([self.out], self.out / "report.html")
        self.log(f"[report] {path}")

    def _summary(self, base: Any, trained: Any, state: Any, loop: Any, info: Any, version: int, *, n_heldout: int,
                 seconds: float) -> dict[str, Any]:
        groups = max(1, loop.builder.counts["groups"])
        infra = int(loop.counts["infra_error_attempts"]) + sum(r.infra_errors for r in (base, trained) if r)
        out = {
            **summ.eval_fields("base", base), **summ.eval_fields("trained", trained),
            "heldout_pass_at_1_by_family": summ.by_family(base=base, trained=trained),
            "heldout_tasks": n_heldout,
            **({"validation_pass_at_1": summ.eval_fields("validation", self.validation_result)["validation_pass_at_1"]}
               if self.validation_result is not None else {}),
            "train_steps": state.step,
            "wall_seconds": round(seconds, 1),
            "tokens_per_solve_base": round(base.tokens_per_solve, 2) if base else None,
            "tokens_per_solve_trained": round(trained.tokens_per_solve, 2) if trained else None,
            "zero_signal_group_fraction": round(loop.builder.counts["dropped_zero_signal"] / groups, 4),
            "dropped_stale_tokens": int(loop.counts["dropped_stale_tokens"]),
            "max_staleness_seen": int(state.max_staleness_seen),
            "infra_error_attempts": infra,
            "model": info.as_dict(),
            "engine": self.cfg.engine.type,
            "weight_version_final": version,
            "eval_trials": self.cfg.eval.trials,
            "seed": self.cfg.seed,
        }
        summ.write_summary(self.out, out)
        return out


def default_out(name: str, root: str | Path = "runs") -> str:
    """``runs/<name>-<YYYYmmdd-HHMMSS>`` (``-2``, ``-3``... when that exists already): a new directory per run."""
    base = Path(root) / f"{name or 'run'}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return str(path)


def _fmt(result: Any) -> str:
    se = result.pass_at_1_se
    return f"{result.pass_at_1:.3f}" + (f" +/- {se:.3f}" if se is not None else "")
