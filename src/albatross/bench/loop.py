"""Loop: synchronous vs asynchronous RL on the demo's workload, with attempt durations that have a long tail.

The demo's recipe (configs/demo.toml: tasks, warm-started tiny model, GRPO, sandbox) runs twice from the same
warm-started base model, for the same wall-time budget and at the same batch size (``group_size`` x
``groups_per_step``):

- ``sync``: ``rl.max_staleness=0``. The loop's admission control then starts a group only while no batch is
  untrained, so it generates one batch, trains on it, loads the new weights, and only then generates the next
  (every trained token has staleness 0);
- ``async``: the demo's ``rl.max_staleness`` (6): attempts keep running while the trainer steps.

Every sandbox command of an attempt sleeps an extra delay drawn from a seeded lognormal distribution
(``--tail-median``, ``--tail-sigma``) standing in for commands whose run time varies a lot (builds, test
suites): most commands are quick, a few take seconds, so a synchronous batch waits for its slowest attempt.

Figures per mode: trainer steps finished within the budget and steps per hour, trainer idle share (time the
trainer waited for a batch / its wall time, from metrics.jsonl), engine idle share (share of the budget in
which the engine ran no forward pass), mean and max staleness of the trained tokens (``max_staleness`` never
exceeds the setting: a group overtaken by later ones and too old by the time its batch is trained is dropped,
``stale_dropped_groups``; ``dropped_stale_tokens``, masked by the loss, stays 0), and held-out pass@1 of the final
model (the weights of the last step finished within the budget; the loop still trains the batches queued when
time runs out, counted in ``steps_total`` but not evaluated). ``wall_seconds`` is the whole ``AsyncLoop.run``
of a mode: trainer start-up, the budget, and the drain of attempts in flight. Attempt durations
(``attempt_seconds_*``) are measured on every attempt of a mode. ``async_vs_sync_steps_per_hour`` is the
headline (target: at least 1.5, with no loss in pass@1).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from albatross.bench.common import percentile

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from albatross.config import RunConfig
    from albatross.engine.builtin import BuiltinEngine
    from albatross.orchestrator.loop import StepEvent
    from albatross.sandbox.base import Attempt, Backend, ExecResult, Limits, VerifierExec, VerifierSpec
    from albatross.tasks.format import Task

MODES = ("sync", "async")

# --quick: a tiny run for tests (about a minute): few training tasks memorised by a short warm start,
# small groups, an 18-second budget per mode, a handful of held-out attempts.
QUICK_OVERRIDES = [
    "tasks.n_train=16", "tasks.n_heldout=4", "warmstart.steps=60", "warmstart.check_every=60",
    "warmstart.check_tasks=8", "warmstart.batch_size=16", "warmstart.target_pass_rate=0.3",
    "orchestrator.group_size=4", "orchestrator.groups_per_step=1", "orchestrator.rollout_workers=8",
    "eval.trials=1",
]
QUICK_MINUTES = 0.3  # 18 s a mode: a sync step (rollouts, then the LoRA trainer's start-up and step) fits under load
QUICK_TAIL_CAP = 3.0  # a short drain after the budget


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=None,
                   help="training wall-time budget of each mode (default 3; --quick: 0.2)")
    p.add_argument("--quick", action="store_true", help="a tiny run for tests (about a minute)")
    p.add_argument("--seed", type=int, default=0, help="seed of the RL runs and of the command delays "
                   "(the warm start keeps the demo's seed, so its cached model is reused)")
    p.add_argument("--max-staleness", type=int, default=None,
                   help="rl.max_staleness of the async mode (default: the demo's)")
    p.add_argument("--tail-median", type=float, default=0.1, help="median extra seconds per sandbox command")
    p.add_argument("--tail-sigma", type=float, default=1.5,
                   help="sigma of the lognormal command delay (larger: a longer tail)")
    p.add_argument("--tail-cap", type=float, default=None,
                   help="largest extra delay of one command in seconds (default 10; --quick: 3)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of: sync,async")
    p.add_argument("--out", help="keep the run directories here (default: a temporary directory, removed)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of the demo config for both modes, e.g. orchestrator.rollout_workers=64")


# ---- long-tail command durations ---------------------------------------------------------------------------


class TailDelay:
    """Seeded lognormal delays (thread-safe): ``median * exp(sigma * N(0, 1))``, capped at ``cap`` seconds."""

    def __init__(self, median: float, sigma: float, cap: float, seed: int = 0) -> None:
        if median < 0 or sigma < 0 or cap < 0:
            raise ValueError("tail median, sigma and cap must be >= 0")
        self.median, self.sigma, self.cap = median, sigma, cap
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.draws: list[float] = []

    def draw(self) -> float:
        if self.median == 0:
            return 0.0
        with self._lock:
            d = min(self.cap, self.median * math.exp(self.sigma * self._rng.gauss(0.0, 1.0)))
            self.draws.append(d)
        return d

    def describe(self) -> dict[str, Any]:
        m, s = self.median, self.sigma
        return {"distribution": "lognormal", "applies_to": "every sandbox exec of an attempt",
                "median_s": m, "sigma": s, "cap_s": self.cap, "mean_s": round(m * math.exp(s * s / 2), 4),
                "p99_s": round(min(self.cap, m * math.exp(2.326 * s)), 3)}


class SlowAttempt:
    """An attempt whose ``exec`` first sleeps a drawn delay; everything else is the real attempt's."""

    def __init__(self, inner: Attempt, delay: TailDelay) -> None:
        self._inner, self._delay = inner, delay

    @property
    def first_output_at(self) -> float | None:
        return self._inner.first_output_at

    def exec(self, command: str, timeout_s: float | None = None) -> ExecResult:
        time.sleep(self._delay.draw())
        return self._inner.exec(command, timeout_s)

    def put_dir(self, host_dir: Path, sandbox_path: str) -> None:
        self._inner.put_dir(host_dir, sandbox_path)

    def read_file(self, sandbox_path: str) -> bytes | None:
        return self._inner.read_file(sandbox_path)

    def kill_all(self) -> None:
        self._inner.kill_all()

    def exec_clean(self, command: str, cwd: str, timeout_s: float | None = None) -> ExecResult:
        return self._inner.exec_clean(command, cwd, timeout_s)

    def verify(self, spec: VerifierSpec) -> VerifierExec:
        return self._inner.verify(spec)

    def refused_hosts(self) -> list[str]:
        return self._inner.refused_hosts()

    def close(self) -> None:
        self._inner.close()


class SlowBackend:
    """A sandbox backend whose attempts are ``SlowAttempt``s. It does not own the real backend: ``close``
    is a no-op and whoever created the real backend closes it."""

    def __init__(self, inner: Backend, delay: TailDelay) -> None:
        self._inner, self._delay = inner, delay
        self.name, self.isolated, self.faults = inner.name, inner.isolated, inner.faults

    @property
    def restarts(self) -> int:
        return self._inner.restarts

    @restarts.setter
    def restarts(self, value: int) -> None:  # ``Backend.restarts`` is a plain attribute: the real backend's
        self._inner.restarts = value

    def prepare(self, env_dir: Path | None, network: str = "none", build_timeout_s: float | None = None) -> Any:
        return self._inner.prepare(env_dir, network, build_timeout_s)

    def pids(self) -> dict[str, int]:
        return self._inner.pids()

    def fork(self, env_dir: Path | None, workdir: str = "/app", limits: Limits | None = None) -> SlowAttempt:
        return SlowAttempt(self._inner.fork(env_dir, workdir, limits), self._delay)

    def close(self) -> None:
        pass


# ---- measuring the engine ----------------------------------------------------------------------------------


class EngineBusy:
    """Seconds the engine spent in forward passes (prefill and decode) inside a window: its own counter
    (``BuiltinEngine.busy_seconds``) read when the window opens and when it closes (a timer), or when ``stop``
    is called first. A pass that straddles an edge counts where it ended (passes last milliseconds)."""

    def __init__(self, engine: BuiltinEngine) -> None:
        self.engine = engine
        self._start: float | None = None
        self._end: float | None = None
        self._timer: threading.Timer | None = None

    def open_window(self, seconds: float) -> None:
        self._start = self.engine.busy_seconds
        self._timer = threading.Timer(seconds, self.stop)
        self._timer.daemon = True
        self._timer.start()

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._start is not None and self._end is None:
            self._end = self.engine.busy_seconds

    @property
    def busy(self) -> float:
        if self._start is None:
            return 0.0
        end = self._end if self._end is not None else self.engine.busy_seconds
        return max(0.0, end - self._start)


class BudgetWatch:
    """A step observer of the real loop (``StepObserver``): when its scheduling loop (and so its time budget)
    starts, and a copy of the weights of the last step finished within the budget (batches already queued when
    the time is up are still trained by the loop; the model evaluated is the one the budget bought)."""

    def __init__(self, budget_s: float, dest: Path, on_start: Callable[[], None] = lambda: None) -> None:
        self.budget_s, self.dest, self._on_start = budget_s, dest, on_start
        self.drive_start = 0.0  # time.time() when the budget started
        self.budget_version = 0
        self.budget_weights: Path | None = None

    def on_start(self) -> None:
        self.drive_start = time.time()
        self._on_start()

    def on_step(self, event: StepEvent) -> None:
        if event.record["time"] > self.drive_start + self.budget_s:  # outside the budget, as mode_figures
            return
        tmp = self.dest.with_name(self.dest.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(event.weights, tmp)
        shutil.rmtree(self.dest, ignore_errors=True)
        tmp.rename(self.dest)
        self.budget_version, self.budget_weights = event.version, self.dest


# ---- one mode ----------------------------------------------------------------------------------------------


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _quantile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank (``percentile``); 0.0 of nothing."""
    return percentile(values, q * 100) if values else 0.0


def mode_figures(run_dir: Path, drive_start: float, budget_s: float, busy_s: float) -> dict[str, Any]:
    """Figures of one mode's run directory, counting only the steps finished within the budget."""
    rows = _read_jsonl(run_dir / "metrics.jsonl")
    inside = [r for r in rows if r["time"] <= drive_start + budget_s]
    wait = sum(r.get("trainer_wait_s", 0.0) for r in inside)
    train = sum(r.get("seconds", 0.0) for r in inside)
    hist: dict[int, float] = {}
    for r in inside:
        for key, value in r.items():
            if key.startswith("staleness_hist/"):
                k = int(key.split("/", 1)[1])
                hist[k] = hist.get(k, 0.0) + value
    tokens = sum(hist.values())
    attempts = _read_jsonl(run_dir / "trajectories.jsonl")
    durations = [a["wall_seconds"] for a in attempts if "wall_seconds" in a]
    return {
        "steps": len(inside),
        "steps_total": len(rows),
        "steps_per_hour": round(len(inside) / budget_s * 3600, 1),
        "trainer_idle_share": round(wait / (wait + train), 4) if wait + train > 0 else 1.0,
        "trainer_busy_share_of_budget": round(train / budget_s, 4),
        "engine_idle_share": round(max(0.0, 1.0 - busy_s / budget_s), 4),
        "mean_staleness": round(sum(k * n for k, n in hist.items()) / tokens, 4) if tokens else 0.0,
        "max_staleness": int(max((r.get("staleness_max", 0) for r in inside), default=0)),
        "dropped_stale_tokens": int(sum(r.get("stale_tokens_dropped", 0) for r in inside)),
        "trained_tokens": int(tokens),
        "attempts": len(attempts),
        "attempt_seconds_p50": round(_quantile(durations, 0.5), 3),
        "attempt_seconds_p90": round(_quantile(durations, 0.9), 3),
        "attempt_seconds_max": round(max(durations, default=0.0), 3),
        "attempt_seconds_mean": round(statistics.mean(durations), 3) if durations else 0.0,
    }


def run_mode(name: str, cfg: RunConfig, base_dir: Path, train: list[Task], heldout: list[Task],
             tokenizer: PreTrainedTokenizerBase, backend: Backend, delay: TailDelay, run_dir: Path,
             log: Callable[[str], None], base_eval: bool = False) -> dict[str, Any]:
    """Train from ``base_dir`` for ``cfg.orchestrator.max_minutes`` with slow commands, then evaluate."""
    import torch

    from albatross.engine.builtin import BuiltinEngine
    from albatross.eval.run import evaluate
    from albatross.harness.agent import build_agent as make_agent
    from albatross.orchestrator.loop import AsyncLoop
    from albatross.trainer.model import load_model

    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.engine.threads)
    engine = BuiltinEngine(load_model(base_dir), max_batch_size=cfg.engine.max_batch_size)
    budget_s = cfg.orchestrator.max_minutes * 60
    out: dict[str, Any] = {"max_staleness_setting": cfg.rl.max_staleness}
    try:
        plain = make_agent(cfg, engine, backend, tokenizer)  # evaluation: real command durations
        if base_eval:
            out["base_pass_at_1"] = round(evaluate(plain, heldout, cfg.eval.trials).pass_at_1, 4)
            log(f"[bench] base held-out pass@1 {out['base_pass_at_1']:.3f}")
        meter = EngineBusy(engine)
        slow = make_agent(cfg, engine, SlowBackend(backend, delay), tokenizer)
        watch = BudgetWatch(budget_s, run_dir.parent / "budget_weights", lambda: meter.open_window(budget_s))
        loop = AsyncLoop(cfg, slow, engine, train, base_dir, run_dir, log, observers=[watch])
        load0 = os.getloadavg()[0]
        t0 = time.monotonic()
        try:
            state = loop.run()
        finally:
            meter.stop()
        out["wall_seconds"] = round(time.monotonic() - t0, 1)
        out["load_avg_1m"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
        out.update(mode_figures(run_dir, watch.drive_start, budget_s, meter.busy))
        out["steps_total"] = int(state.step)
        groups = max(1, loop.builder.counts["groups"])
        out["zero_signal_group_share"] = round(loop.builder.counts["dropped_zero_signal"] / groups, 4)
        out["stale_dropped_groups"] = int(loop.builder.counts["dropped_stale"])
        out["train_version_mismatches"] = int(loop.counts["train_version_mismatches"])
        out["infra_error_attempts"] = int(loop.counts["infra_error_attempts"])
        draws = sorted(delay.draws)
        out["command_delays"] = {"n": len(draws), "p50_s": round(_quantile(draws, 0.5), 3),
                                 "p99_s": round(_quantile(draws, 0.99), 3),
                                 "max_s": round(max(draws, default=0.0), 3)}
        if engine.version != watch.budget_version:  # steps trained after the budget do not count
            weights = watch.budget_weights or base_dir  # no step within the budget: the base model
            engine.update_weights(str(weights), watch.budget_version)
        out["evaluated_version"] = int(engine.version)
        log(f"[bench] {name}: {out['steps']} steps in {budget_s:.0f}s ({out['steps_total']} with the batches "
            f"queued by then), evaluating version {engine.version}")
        out["heldout_pass_at_1"] = round(evaluate(plain, heldout, cfg.eval.trials).pass_at_1, 4)
    finally:
        engine.close()
    log(f"[bench] {name}: {out['steps_per_hour']:.0f} steps/h, trainer idle {out['trainer_idle_share']:.0%}, "
        f"engine idle {out['engine_idle_share']:.0%}, staleness {out['mean_staleness']:.2f}, "
        f"held-out pass@1 {out['heldout_pass_at_1']:.3f}")
    return out


# ---- the benchmark -----------------------------------------------------------------------------------------


def bench_config(args: argparse.Namespace, out_dir: Path) -> RunConfig:
    """The demo's config (quick: tiny) with the bench's budget; max_steps is never what stops a mode."""
    from albatross.pipeline.demo import demo_config

    minutes = args.minutes if args.minutes is not None else (QUICK_MINUTES if args.quick else 3.0)
    extra = (QUICK_OVERRIDES if args.quick else []) + list(args.set or [])
    extra += [f"orchestrator.max_minutes={minutes}", "orchestrator.max_steps=1000000"]
    return demo_config(None, False, str(out_dir), extra)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from albatross.bench.common import print_table, write_json

    modes = [m.strip() for m in str(args.modes).split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise SystemExit(f"--modes: choose from {','.join(MODES)}")
    keep = args.out
    root = Path(keep).resolve() if keep else Path(tempfile.mkdtemp(prefix="albatross-bench-loop-"))
    try:
        results, meta = _run(args, root, modes)
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    return _report(args, results, meta, print_table, write_json)


def _log(line: str) -> None:
    print(line, flush=True)


def _run(args: argparse.Namespace, root: Path,
         modes: list[str]) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    import torch

    from albatross.cache import cache_root
    from albatross.harness.agent import build_agent as make_agent
    from albatross.pipeline.driver import Pipeline
    from albatross.pipeline.warmstart import warm_start

    cfg = bench_config(args, root)
    tail_cap = args.tail_cap if args.tail_cap is not None else (QUICK_TAIL_CAP if args.quick else 10.0)
    demo = Pipeline(cfg, _log, command="bench loop")
    demo.prepare_out()
    t0 = time.monotonic()
    train, heldout = demo.load_tasks()
    tokenizer, model_dir = demo.load_model()
    backend = demo.open_backend()
    results: dict[str, dict[str, Any]] = {}
    try:
        torch.manual_seed(cfg.seed)
        torch.set_num_threads(cfg.engine.threads)
        agent = make_agent(cfg, None, backend, tokenizer)
        base_dir = warm_start(cfg, tokenizer, agent, train, model_dir, demo.pass_rate_fn(agent, train),
                              cache_root(), _log)
        _log(f"[bench] base model {base_dir} ({time.monotonic() - t0:.0f}s)")
        async_staleness = cfg.rl.max_staleness if args.max_staleness is None else args.max_staleness
        for i, mode in enumerate(modes):
            staleness = 0 if mode == "sync" else async_staleness
            mcfg = cfg.model_copy(update={"seed": args.seed,
                                          "rl": cfg.rl.model_copy(update={"max_staleness": staleness})})
            delay = TailDelay(args.tail_median, args.tail_sigma, tail_cap, seed=args.seed)
            _log(f"[bench] {mode}: rl.max_staleness={staleness}, {cfg.orchestrator.max_minutes:g} min budget, "
                 f"batch {cfg.orchestrator.groups_per_step} groups x {cfg.orchestrator.group_size} attempts")
            results[mode] = run_mode(mode, mcfg, base_dir, train, heldout, tokenizer, backend, delay,
                                     root / mode / "run", _log, base_eval=i == 0)
    finally:
        backend.close()
    oc = cfg.orchestrator
    meta = {"minutes_per_mode": oc.max_minutes, "group_size": oc.group_size, "groups_per_step": oc.groups_per_step,
            "rollout_workers": oc.rollout_workers, "queue_size": oc.queue_size,
            "async_max_staleness": async_staleness, "heldout_tasks": len(heldout), "train_tasks": len(train),
            "eval_trials": cfg.eval.trials, "sandbox": backend.name, "seed": args.seed, "quick": bool(args.quick),
            "overrides": list(args.set or []),
            "tail": TailDelay(args.tail_median, args.tail_sigma, tail_cap).describe(),
            "total_seconds": round(time.monotonic() - t0, 1)}
    return results, meta


def _report(args: argparse.Namespace, results: dict[str, dict[str, Any]], meta: dict[str, Any],
            print_table: Callable[[str, list[tuple[str, Any]]], None],
            write_json: Callable[[str | Path | None, dict[str, Any]], None]) -> dict[str, Any]:
    data: dict[str, Any] = {}
    if "sync" in results and "async" in results:
        s, a = results["sync"], results["async"]
        data["async_vs_sync_steps_per_hour"] = (round(a["steps_per_hour"] / s["steps_per_hour"], 3)
                                                if s["steps_per_hour"] else None)
        data["pass_at_1_async_minus_sync"] = round(a["heldout_pass_at_1"] - s["heldout_pass_at_1"], 4)
    base = next((r["base_pass_at_1"] for r in results.values() if "base_pass_at_1" in r), None)
    data.update({"base_pass_at_1": base, **results, "config": meta})
    rows: list[tuple[str, Any]] = []
    for key in ("steps", "steps_per_hour", "trainer_idle_share", "engine_idle_share", "mean_staleness",
                "heldout_pass_at_1", "attempt_seconds_p50", "attempt_seconds_max", "wall_seconds"):
        for mode, r in results.items():
            rows.append((f"{mode}: {key}", r[key]))
    if base is not None:
        rows.append(("base held-out pass@1", base))
    if "async_vs_sync_steps_per_hour" in data:
        rows.append(("async_vs_sync_steps_per_hour", data["async_vs_sync_steps_per_hour"]))
    print_table(f"albatross bench loop: sync vs async, {meta['minutes_per_mode']:g} min per mode, "
                f"batch {meta['groups_per_step']}x{meta['group_size']}", rows)
    write_json(args.json, data)
    return data
