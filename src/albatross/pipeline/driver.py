"""The run driver behind ``albatross train`` (and ``albatross demo``, one recipe of it), for any model.

Stages: tasks -> model (``model.path`` checked, or the demo's tiny model) -> warm start (optional) -> base eval
-> asynchronous RL -> trained eval -> final model, summary and report. Each stage logs progress lines; a resumed
run (``--resume``) keeps what is done and continues.

The stages that set a run up are public methods of ``Pipeline``, for benchmarks and users' scripts that build
their own run from the same parts: ``prepare_out``, ``load_tasks``, ``load_model``, ``open_backend``
(with ``hide_paths``), ``pass_rate_fn`` (the warm start's check), ``eval_config`` and ``start_engine`` (a subclass
may replace it to start the engine its own way). The loop's steps are watched with ``orchestrator.loop``'s
``StepObserver``.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from albatross.cache import cache_root
from albatross.config import RunConfig
from albatross.errors import UserError
from albatross.pipeline import summary as summ
from albatross.progress import Plan

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from albatross.engine.base import Engine
    from albatross.eval.run import EvalResult
    from albatross.harness.agent import AgentLoop
    from albatross.orchestrator.loop import AsyncLoop
    from albatross.orchestrator.metrics import MetricsSink
    from albatross.orchestrator.ray_backend import RayRun
    from albatross.orchestrator.state import RunState
    from albatross.pipeline.model import ModelInfo
    from albatross.sandbox.base import Backend
    from albatross.tasks.format import Task

    # what ``_run_with`` hands to ``_summary``: base and trained evaluations, the final state, the loop, the model
    RunResults = tuple[EvalResult | None, EvalResult | None, RunState, AsyncLoop, ModelInfo, int]


class Pipeline:
    """One run of a config: ``run()`` returns the summary (also written to ``<out>/summary.json``)."""

    def __init__(self, cfg: RunConfig, log: Callable[[str], None] = print, resume: bool = False,
                 command: str = "train", overwrite: bool = False) -> None:
        self.cfg, self.log, self.resume, self.command, self.overwrite = cfg, log, resume, command, overwrite
        if not cfg.out:
            cfg.out = default_out(cfg.name)
        self.out = Path(cfg.out).resolve()
        self.model_name = cfg.model.path  # as given: a directory or a Hugging Face id (summary.json names it)
        self.sources: dict[str, str] = {}  # task id -> source name (tasks.mix)
        self.weights: dict[str, float] = {}
        self.source_rows: dict[str, list[dict[str, Any]]] = {}  # evaluation -> per-source rows (tasks.mix)

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
        from albatross.orchestrator.metrics import check_wandb

        t0 = time.monotonic()
        from albatross.trainer.lora import check_run, check_tied_output

        check_wandb(self.cfg.orchestrator.wandb_project)
        self._check_agent()
        check_run(self.cfg)
        if self.cfg.orchestrator.backend == "ray":  # before anything slow: what a Ray run cannot do
            from albatross.orchestrator.ray_backend import check_ray_config

            check_ray_config(self.cfg)
        self._claim_out()
        self.plan = self._plan()
        self.plan.announce()  # the phases to come with an estimate each, before anything slow
        import torch

        torch.manual_seed(self.cfg.seed)
        torch.set_num_threads(self.cfg.engine.threads)  # this process runs the built-in engine (and the warm start)
        self.prepare_out()
        with self.plan.phase("tasks") as ph:
            train, heldout = self.load_tasks()
            ph.reason = f"{len(train)} train, {len(heldout)} held-out tasks ready"
        tokenizer, model_dir = self.load_model()
        check_tied_output(self.cfg, model_dir)
        with self.plan.phase("sandbox") as ph:
            backend = self.open_backend()
            ph.reason = f"backend {backend.name} ready"
        self.timings.record("sandbox", self.plan.phases[1].elapsed_s or 0.0, 1)
        self.sink = self._sink()
        try:
            results = self._run_with(backend, tokenizer, model_dir, train, heldout)
        finally:
            backend.close()
            self.sink.close()
        out = self._summary(*results, heldout=heldout, seconds=time.monotonic() - t0)
        with self.plan.phase("report") as ph:
            self._report()
            ph.reason = "written"
        return out

    def _check_agent(self) -> None:
        """An agent of one's own (``harness.agent``) cannot play the oracle warm start (the built-in harness does)."""
        from albatross.pipeline.warmstart import warm_start_source

        if self.cfg.harness.agent and not self.resume and warm_start_source(self.cfg) == "oracle":
            raise UserError("harness.agent: the oracle warm start plays demonstrations through the built-in "
                            "harness; set warmstart.source = \"chats\" or \"off\" (with model.path)")

    def _plan(self) -> Plan:
        """The phases of this run with an estimate each (``progress.py``): from earlier runs of this model and
        sandbox type on this machine, else rough defaults; RL is bounded by ``max_minutes``."""
        from albatross.pipeline.warmstart import warm_start_source
        from albatross.progress import TINY_RATES, Phase, Plan, Timings

        cfg, tc, oc = self.cfg, self.cfg.tasks, self.cfg.orchestrator
        m, h = cfg.model, cfg.harness
        model_key = m.path or f"tiny-{m.hidden_size}x{m.num_layers}-{m.intermediate_size}"
        self.timings = t = Timings(cache_root() / "timings.json",
                                   f"{model_key}|{cfg.sandbox.type}|{h.max_turns}x{h.max_tokens_per_turn}",
                                   TINY_RATES if not m.path else {"tasks": 2.0})
        n_heldout = _count_tasks(tc.heldout) if tc.train else tc.n_heldout
        n_validation = 0 if tc.train else tc.n_validation

        def per(unit: str, n: float) -> float | None:
            rate = t.rate(unit)
            return None if rate is None else rate * n

        rl = per("rl_step", oc.max_steps)
        phases = [Phase("tasks", per("tasks", 1)), Phase("sandbox", t.rate("sandbox"))]
        if warm_start_source(cfg) != "off" and not self.resume:
            phases.append(Phase("warm-start", per("warmstart_step", cfg.warmstart.steps), bound=True))
        if n_heldout:
            phases.append(Phase("base eval", per("eval_attempt", n_heldout * cfg.eval.trials)))
        phases.append(Phase("train", min(rl, oc.max_minutes * 60) if rl is not None else oc.max_minutes * 60,
                            bound=True))
        if n_heldout:
            phases.append(Phase("trained eval", per("eval_attempt", n_heldout * cfg.eval.trials)))
        if n_validation:
            phases.append(Phase("validation eval", per("eval_attempt", n_validation * cfg.eval.trials)))
        phases.append(Phase("report", 5.0))
        return Plan(phases, self.log)

    def _sink(self) -> MetricsSink:
        """The run's metrics sink: trainer steps, warm start and evaluations to JSONL, TensorBoard and W&B."""
        from albatross.orchestrator.metrics import MetricsSink

        oc = self.cfg.orchestrator
        return MetricsSink(self.out / "run", oc.max_steps, self.log, oc.wandb_project, self.cfg.model_dump(),
                           max_minutes=oc.max_minutes, run_name=self.out.name, group=self.cfg.name,
                           resume=self.resume, plan=self.plan)

    def _run_with(self, backend: Backend, tokenizer: PreTrainedTokenizerBase, model_dir: Path | None,
                  train: list[Task], heldout: list[Task]) -> RunResults:
        from albatross.harness.agent import build_agent
        from albatross.orchestrator.loop import AsyncLoop
        from albatross.pipeline.model import describe

        cfg = self.cfg
        agent = build_agent(cfg, None, backend, tokenizer)
        base_dir = self._warm_start(agent, tokenizer, train, model_dir)
        info = describe(self.model_name, base_dir)
        self.log(f"[model] {info.architecture}, {info.parameters / 1e6:.2f}M parameters, from {base_dir}")
        ray_run = self._ray(base_dir, tokenizer) if cfg.orchestrator.backend == "ray" else None
        engine = ray_run.engine if ray_run else self.start_engine(base_dir)
        agent.engine = engine
        evaluator = build_agent(self.eval_config(), engine, backend, tokenizer)
        try:
            base = self._base_eval(evaluator, heldout)
            loop = AsyncLoop(cfg, agent, engine, train, base_dir, self.out / "run", self.log,
                             resume=self.resume, launcher=ray_run, sink=self.sink,
                             sources=self.sources or None, weights=self.weights or None)
            with self.plan.phase("train") as ph:
                first = loop.state.step
                t0 = time.monotonic()
                state = loop.run()
                ph.reason = f"{loop.stop_reason} at step {state.step}/{cfg.orchestrator.max_steps}"
            self.timings.record("rl_step", time.monotonic() - t0, state.step - first)
            trained = self._trained_eval(evaluator, heldout)
            self.validation_result = self._validation_eval(evaluator)
            version = int(engine.version)
        finally:
            if ray_run is not None:
                ray_run.close()
            else:
                engine.close()
        self._export_final(base_dir, state.version, tokenizer, loop.final_adapter)
        return base, trained, state, loop, info, version

    def _warm_start(self, agent: AgentLoop, tokenizer: PreTrainedTokenizerBase, train: list[Task],
                    model_dir: Path | None) -> Path:
        """The warm start as a phase of the plan: a bar over its steps, its metrics logged, why it stopped."""
        import json

        from albatross.pipeline.warmstart import warm_start, warm_start_source
        from albatross.progress import Bar

        if warm_start_source(self.cfg) == "off":
            return warm_start(self.cfg, tokenizer, agent, train, model_dir, self.pass_rate_fn(agent, train),
                              cache_root(), self.log)
        bar = Bar("warm-start", self.cfg.warmstart.steps, self.log, plan=self.plan)
        steps = [0]

        def on_step(step: int, metrics: dict[str, float]) -> None:
            steps[0] = step
            self.sink.scalars("warmstart", {k: v for k, v in metrics.items() if k != "step"}, step)
            if bar.tty or "pass_rate" not in metrics:  # plain lines: warmstart.py prints each check
                bar.update(step)

        with self.plan.phase("warm-start") as ph:
            t0 = time.monotonic()
            try:
                base_dir = warm_start(self.cfg, tokenizer, agent, train, model_dir,
                                      self.pass_rate_fn(agent, train), cache_root(), self.log, on_step)
            finally:
                bar.close()
            info = json.loads((base_dir / "warmstart.json").read_text())
            reason = info.get("stop_reason", "done")
            ph.reason = reason if steps[0] else f"cached model ({reason})"
        if steps[0]:
            self.timings.record("warmstart_step", time.monotonic() - t0, steps[0])
        return base_dir

    # ---- stages (public: see the module's docstring) ----------------------------------------
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

    def prepare_out(self) -> None:
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

    def load_tasks(self) -> tuple[list[Task], list[Task]]:
        """Training and held-out tasks (``tasks.train`` / ``heldout``, or generated built-in ones); generated
        validation tasks go to ``self.validation``."""
        from albatross.tasks.builtin import generate_tasks
        from albatross.tasks.format import load_tasks

        tc = self.cfg.tasks
        generated = self.out / "tasks"
        self.validation: list[Task] = []
        if tc.mix:
            return self._mix_tasks(generated)
        if tc.train:
            train_dirs: list[str | Path] = list(tc.train)
            heldout_dirs: list[str | Path] = list(tc.heldout)
            train, heldout = load_tasks(train_dirs), load_tasks(heldout_dirs) if heldout_dirs else []
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

    def _mix_tasks(self, generated: Path) -> tuple[list[Task], list[Task]]:
        """``tasks.mix``: the training and held-out tasks of every source (``tasks/mix.py``), with their source."""
        from albatross.tasks.builtin import generate_tasks
        from albatross.tasks.format import load_tasks
        from albatross.tasks.mix import describe, load_mix, source_of

        tc = self.cfg.tasks

        def generate(families: list[str]) -> dict[str, list[Task]]:
            if not (self.resume and (generated / "train").is_dir()):
                generate_tasks(generated, families=families, n_train=tc.n_train, n_heldout=tc.n_heldout,
                               seed=tc.seed)
            return {split: load_tasks(generated / split) if (generated / split).is_dir() else []
                    for split in ("train", "heldout")}

        sources = load_mix(tc.mix, generate, tc.heldout)
        self.sources, self.weights = source_of(sources), {s.name: s.weight for s in sources}
        train = [t for s in sources for t in s.train if s.weight > 0]
        heldout = [t for s in sources for t in s.heldout]
        self.log(f"[tasks] mix of {len(sources)} sources: {describe(sources)}")
        return train, heldout

    def load_model(self) -> tuple[PreTrainedTokenizerBase, Path | None]:
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

    def open_backend(self) -> Backend:
        from albatross.sandbox import backend_from_config

        backend = backend_from_config(self.cfg.sandbox, hide_paths=self.hide_paths())
        self.log(f"[sandbox] backend {backend.name} (isolated: {backend.isolated})")
        return backend

    def hide_paths(self) -> list[str]:
        return [str(self.out), str(cache_root())] + ([self.cfg.model.path] if self.cfg.model.path else [])

    def start_engine(self, base_dir: Path) -> Engine:
        """The rollout engine of ``[engine]`` (``engine/launch.py``): built-in, or vLLM / SGLang servers launched
        or attached, serving ``base_dir`` at version 0."""
        from albatross.engine.launch import make_engine

        return make_engine(self.cfg, base_dir, self.out / "run", self.log)

    def _ray(self, base_dir: Path, tokenizer: PreTrainedTokenizerBase) -> RayRun:
        from albatross.orchestrator.ray_backend import RayRun

        return RayRun(self.cfg, base_dir, self.out / "run", tokenizer, self.hide_paths(), self.log)

    def eval_config(self) -> RunConfig:
        """The run's config with evaluation's sampling temperature and seed (``eval.temperature``, ``eval.seed``)."""
        sampling = self.cfg.sampling.model_copy(update={"temperature": self.cfg.eval.temperature,
                                                        "seed": self.cfg.eval.seed})
        return self.cfg.model_copy(update={"sampling": sampling})

    def pass_rate_fn(self, agent: AgentLoop, train: list[Task]) -> Callable[[torch.nn.Module], float]:
        """The warm start's stopping check: pass@1 of a copy of the model on a sample of the training tasks it
        has demonstrations of."""
        import copy
        import random

        from albatross.devices import engine_device
        from albatross.engine.builtin import BuiltinEngine
        from albatross.eval.run import evaluate
        from albatross.pipeline.warmstart import demonstrated

        rng = random.Random(self.cfg.seed)
        device = str(engine_device(self.cfg.engine.device, self.cfg.trainer.gpus))

        def pass_rate(model: torch.nn.Module) -> float:
            pool = demonstrated(train, self.cfg.tasks.reward_only_families)
            tasks = rng.sample(pool, min(self.cfg.warmstart.check_tasks, len(pool)))
            engine = BuiltinEngine(copy.deepcopy(model).eval(), device=device,
                                   max_batch_size=self.cfg.engine.max_batch_size)
            try:
                agent.engine = engine
                return evaluate(agent, tasks, 2).pass_at_1
            finally:
                engine.close()
                agent.engine = None

        return pass_rate

    def _base_eval(self, agent: AgentLoop, heldout: list[Task]) -> EvalResult | None:
        """Evaluate the starting model; a resumed run only runs the (task, trial) pairs not yet scored."""
        from albatross.eval.run import EvalResult, final_records, finished_pairs, load_attempts
        from albatross.records import STATUS_INFRA_ERROR, Trajectory

        if not heldout:
            self.log("[eval] no held-out tasks (tasks.heldout is empty): evaluation skipped")
            return None
        path = self.out / "eval_base.jsonl"
        done = finished_pairs(load_attempts(path))
        if done:
            self.log(f"[resume] base evaluation: {len(done)} attempts already scored")
        self._evaluate("base eval", agent, heldout, path, skip=done)
        rows = load_attempts(path)
        result = EvalResult([Trajectory.from_dict(r) for r in final_records(rows).values()])
        result.counts["infra_error_attempts"] = sum(r.get("status") == STATUS_INFRA_ERROR for r in rows)
        self.log(f"[eval] base held-out pass@1 {_fmt(result)} ({len(heldout)} tasks x {self.cfg.eval.trials} "
                 f"trials, temperature {self.cfg.eval.temperature})")
        self._log_sources("base", list(final_records(rows).values()))
        self._log_eval("base", result)
        return result

    def _trained_eval(self, agent: AgentLoop, heldout: list[Task]) -> EvalResult | None:
        if not heldout:
            return None
        (self.out / "eval_trained.jsonl").unlink(missing_ok=True)  # a resumed run evaluates anew
        result = self._evaluate("trained eval", agent, heldout, self.out / "eval_trained.jsonl")
        self.log(f"[eval] trained held-out pass@1 {_fmt(result)}")
        self._log_sources("trained", [t.to_dict() for t in result.trajectories])
        self._log_eval("trained", result)
        return result

    def _validation_eval(self, agent: AgentLoop) -> EvalResult | None:
        """The trained model on the validation split (``tasks.n_validation``): the figure to tune on."""
        if not self.validation:
            return None
        result = self._evaluate("validation eval", agent, self.validation, self.out / "eval_validation.jsonl")
        self.log(f"[eval] trained validation pass@1 {_fmt(result)}")
        self._log_eval("validation", result)
        return result

    def _evaluate(self, phase: str, agent: AgentLoop, tasks: list[Task], path: Path,
                  skip: set[tuple[str, int]] | None = None) -> EvalResult:
        """One evaluation as a phase of the plan: a bar over its attempts, and how it ended."""
        from albatross.eval.run import evaluate
        from albatross.progress import Bar

        todo = len(tasks) * self.cfg.eval.trials - len(skip or ())
        bar = Bar(phase, todo, self.log, unit="attempts", plan=self.plan)
        with self.plan.phase(phase) as ph:
            t0 = time.monotonic()
            try:
                result = evaluate(agent, tasks, self.cfg.eval.trials, out_jsonl=path, skip=skip or (),
                                  progress=lambda done, _total: bar.update(done), sources=self.sources or None)
            finally:
                bar.close()
            ph.reason = f"all {todo} attempts scored ({len(tasks)} tasks x {self.cfg.eval.trials} trials)"
        self.timings.record("eval_attempt", time.monotonic() - t0, todo)
        return result

    def _log_eval(self, name: str, result: EvalResult) -> None:
        """An evaluation's Pass@1 (and its standard error over tasks) to TensorBoard / W&B as ``eval/<name>``."""
        step = self.sink.max_steps if name != "base" else 0
        self.sink.scalars(f"eval/{name}", {"pass_at_1": result.pass_at_1,
                                           **({"pass_at_1_se": result.pass_at_1_se}
                                              if result.pass_at_1_se is not None else {})}, step)

    def _log_sources(self, name: str, records: list[dict[str, Any]]) -> None:
        """With a task mix: the evaluation's Pass@1 (and share of FAIL_TO_PASS tests fixed) per source."""
        if not self.sources:
            return
        from albatross.eval.run import by_source

        rows = by_source(records, self.sources)
        for row in rows:
            fixed = row["fail_to_pass_fixed"]
            self.log(f"[eval] {name} held-out {row['source']}: pass@1 {row['pass_at_1']:.3f} ({row['tasks']} tasks)"
                     + (f", FAIL_TO_PASS fixed {fixed:.3f}" if fixed is not None else ""))
        self.sink.scalars(f"eval/{name}", {f"{r['source']}/pass_at_1": r["pass_at_1"] for r in rows},
                          self.sink.max_steps if name != "base" else 0)
        self.source_rows[name] = rows

    def _export_final(self, base_dir: Path, version: int, tokenizer: PreTrainedTokenizerBase,
                      adapter: str = "") -> None:
        """``<out>/final``: the last trained weights with the model's tokenizer, chat template and a generation
        config that stops at the end of a turn, a directory that loads with transformers
        (``AutoModelForCausalLM.from_pretrained``) and serves with any engine. With ``[trainer.lora]``: the adapter
        in PEFT's format (its base: ``base_dir``), and with ``merge`` the merged model in ``final/merged``."""
        from albatross.pipeline.model import copy_tokenizer_files, write_generation_config
        from albatross.trainer.checkpoint import version_dir

        final = self.out / "final"
        shutil.rmtree(final, ignore_errors=True)
        lora = self.cfg.trainer.lora
        if lora.on:
            self._export_adapter(base_dir, version, adapter, final)
            if not lora.merge:
                return
        src = version_dir(self.out / "run" / "weights", version) if version else base_dir
        if not src.is_dir():  # engine.weight_sync = "nccl" writes no weights: the checkpoints hold them
            self.log(f"[model] no exported weights of version {version} ({src}); see run/checkpoints")
            return
        merged = final / "merged" if lora.on else final
        shutil.copytree(src, merged)
        copy_tokenizer_files(base_dir, merged)
        write_generation_config(base_dir, merged, tokenizer)
        self.log(f"[model] final {'merged ' if lora.on else ''}weights (version {version}): {merged}")

    def _export_adapter(self, base_dir: Path, version: int, adapter: str, final: Path) -> None:
        """The run's last LoRA adapter to ``final`` (PEFT format, ``base_model_name_or_path`` = ``base_dir``), with
        the tokenizer: ``PeftModel.from_pretrained(base, final)`` and transformers' ``from_pretrained(final)``
        load it."""
        import json

        from albatross.pipeline.model import copy_tokenizer_files

        if not adapter or not Path(adapter).is_dir():
            self.log("[model] no LoRA adapter was written (the trainer did not finish); see run/checkpoints")
            return
        shutil.copytree(adapter, final)
        path = final / "adapter_config.json"
        config = json.loads(path.read_text())
        config["base_model_name_or_path"] = str(Path(base_dir).resolve())
        path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        copy_tokenizer_files(base_dir, final)
        self.log(f"[model] final LoRA adapter (version {version}): {final}")

    def _report(self) -> None:
        from albatross.eval.report import write_report

        path = write_report([self.out], self.out / "report.html")
        self.log(f"[report] {path}")

    def _summary(self, base: EvalResult | None, trained: EvalResult | None, state: RunState, loop: AsyncLoop,
                 info: ModelInfo, version: int, *, heldout: list[Task], seconds: float) -> dict[str, Any]:
        groups = max(1, loop.builder.counts["groups"])
        infra = int(loop.counts["infra_error_attempts"]) + sum(r.infra_errors for r in (base, trained) if r)
        out = {
            **summ.eval_fields("base", base), **summ.eval_fields("trained", trained),
            **summ.difference_fields(base, trained),
            **summ.split_fields(heldout, self.cfg.tasks.reward_only_families, base=base, trained=trained),
            "heldout_pass_at_1_by_family": summ.by_family(heldout, base=base, trained=trained),
            "heldout_tasks": len(heldout),
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
            "parameters": loop.parameter_counts.get("parameters"),
            "trainable_parameters": loop.parameter_counts.get("trainable_parameters"),
            "engine": self.cfg.engine.type,
            "weight_version_final": version,
            "eval_trials": self.cfg.eval.trials,
            "seed": self.cfg.seed,
            **({"heldout_by_source": self.source_rows} if self.sources else {}),
        }
        summ.write_summary(self.out, out)
        return out


def _count_tasks(dirs: list[str]) -> int:
    """Task directories (with task.toml) under ``dirs``, counted without loading them (for the plan)."""
    return sum(1 for d in dirs for _ in Path(d).glob("**/task.toml")) if dirs else 0


def default_out(name: str, root: str | Path = "runs") -> str:
    """``runs/<name>-<YYYYmmdd-HHMMSS>`` (``-2``, ``-3``... when that exists already): a new directory per run."""
    base = Path(root) / f"{name or 'run'}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return str(path)


def _fmt(result: EvalResult) -> str:
    se = result.pass_at_1_se
    return f"{result.pass_at_1:.3f}" + (f" +/- {se:.3f}" if se is not None else "")
