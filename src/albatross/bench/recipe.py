"""Recipe: each claim of the recipe (DESIGN.md, "The two systems it implements"), measured in miniature on the
demo's workload, beside the seed's figure.

One warm-started demo model (the demo's recipe, ``configs/demo.toml``; ``--quick``: ``albatross demo --quick``'s
settings, sharing its cached warm start), one sandbox backend, the demo's train and held-out tasks. Measured:

- ``zero_signal_unfiltered`` / ``zero_signal_filtered``: share of zero-signal groups of G attempts (G = the
  training group size) of the base model at training tasks, before the 15-85% filter (all probed tasks) and
  after it (the kept tasks), paired: a first probe decides the filter, a second one with fresh attempts at every
  task is measured (the first probe's own groups at a kept task can never be zero-signal, so reusing them would
  make the filter look perfect);
- ``infra_group_loss_without_retries`` / ``_with_retries``: the same probe on a sandbox whose forks fail at
  ``--fault-rate`` (``sandbox/faults.py``), with ``sandbox.max_infra_retries`` 0 vs the config's; a group is
  lost when it lacks an attempt;
- RL runs (the demo's loop, ``--minutes`` each) per seed with the efficiency reward on, and per seed with
  ``rl.efficiency_lambda = 0``; an SFT control per seed that continues SFT on oracle demonstrations from the same
  warm start for the wall time its RL run took. Each final model is evaluated on the held-out tasks:
  ``rl_pass_at_1``, ``sft_control_pass_at_1`` (means over seeds, standard errors over seeds),
  ``tokens_per_solve_ratio`` (with / without the efficiency reward);
- from the first RL run: ``tis_truncated_token_share`` (token-weighted ``truncated_fraction`` of every RL step),
  ``entropy_by_step`` and ``mismatch_kl_by_step`` (and a plot), and ``logprob_gap_by_staleness``: the run keeps
  its weight versions v0..v6; tokens sampled by version v are scored by the trainer's forward at version v+s;
  mean |trainer log-prob - sampler log-prob| per s;
- ``harness_cost_reduction``: the trained model of the first run evaluates the held-out tasks (greedy) with the
  harness's output redirection and context compression on, and with both off, at the same display limit
  (``harness.max_observation_chars``), cost priced as ``bench harness`` prices it (cached input tokens cheap);
- ``async_vs_sync_steps_per_hour``: ``bench loop`` (its own runs).
"""

from __future__ import annotations

import argparse
import functools
import math
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from albatross.config import RunConfig
    from albatross.engine.base import Engine
    from albatross.engine.builtin import BuiltinEngine
    from albatross.eval.run import EvalResult
    from albatross.orchestrator.loop import StepEvent
    from albatross.pipeline.driver import Pipeline
    from albatross.records import Sample, TrainSample
    from albatross.sandbox.base import Backend
    from albatross.tasks.format import Task
    from albatross.tasks.probe import ProbeRow

# The seeds' figures (DESIGN.md), shown beside ours.
SEED_FIGURES: dict[str, str] = {
    "zero_signal": "48% -> 10.2%",
    "tokens_per_solve_ratio": "0.84x at equal Pass@1",
    "harness_cost_reduction": "about -33%",
    "logprob_gap_by_staleness": "0.065 at 1, 0.08 at 4-6",
    "infra_group_loss": "12% -> 0.5%",
    "tis_truncated_token_share": "1-3%",
    "async_vs_sync_steps_per_hour": "(fully asynchronous; no figure)",
    "rl_vs_sft": "(no SFT control reported)",
    "stability": "bounded entropy and mismatch KL, no KL or entropy term",
}
REQUIRED_KEYS = (
    "zero_signal_unfiltered", "zero_signal_filtered", "tokens_per_solve_ratio", "harness_cost_reduction",
    "logprob_gap_by_staleness", "infra_group_loss_without_retries", "infra_group_loss_with_retries",
    "tis_truncated_token_share", "async_vs_sync_steps_per_hour", "rl_pass_at_1", "sft_control_pass_at_1",
    "rl_pass_at_1_se", "sft_control_pass_at_1_se", "rl_pass_at_1_by_seed", "sft_control_pass_at_1_by_seed",
    "entropy_by_step", "mismatch_kl_by_step", "quick", "seeds", "notes",
)
MAX_STALENESS_MEASURED = 6
HARNESS_CONFIGS = {"off": {"redirect_output": False, "compression": "none"},
                   "on": {"redirect_output": True, "compression": "mask_summary"}}
PARTS_VERSION = 2  # of a saved part's measurement: parts saved by another version are measured anew
GAP_SAMPLES = 256  # samples scored per trainer version (a random subset when the run made more)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="tiny settings (about 10 minutes; 1 seed)")
    p.add_argument("--minutes", type=float, default=None,
                   help="RL budget of each run (default: the demo's orchestrator.max_minutes, as the demo trains; "
                   "--quick: 0.5)")
    p.add_argument("--seeds", type=int, default=None, help="RL / SFT-control seeds (default 3; --quick: 1)")
    p.add_argument("--probe-tasks", type=int, default=None,
                   help="training tasks probed for the zero-signal and fault figures (default 96; --quick: 24)")
    p.add_argument("--fault-rate", type=float, default=0.1, help="share of sandbox forks made to fail")
    p.add_argument("--loop-minutes", type=float, default=None,
                   help="budget per mode of the `bench loop` part (default: bench loop's own; 0: skip that part, "
                   "`albatross bench loop` measures it alone)")
    p.add_argument("--skip-efficiency", action="store_true",
                   help="skip the RL runs without the efficiency reward (a third of the time): the tokens-per-solve "
                   "figure is then not measured")
    p.add_argument("--out", help="keep the run directories here (default: a temporary directory, removed)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field of the demo config, e.g. orchestrator.group_size=8")


# ---- pure parts --------------------------------------------------------------------------------------------


def mean_se(values: list[float]) -> tuple[float | None, float | None]:
    """Mean and standard error of the mean (sample sd / sqrt(n)); se None with fewer than two values."""
    if not values:
        return None, None
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None)


def equal_within_se(a: float, a_se: float | None, b: float, b_se: float | None) -> bool | None:
    """Whether two independent estimates differ by at most one standard error of their difference."""
    if a_se is None or b_se is None:
        return None
    return abs(a - b) <= math.sqrt(a_se**2 + b_se**2) + 1e-12


def group_loss_share(attempts_per_group: list[int], group_size: int) -> float:
    """Share of groups that lack at least one of their ``group_size`` scored attempts."""
    if not attempts_per_group:
        return 0.0
    return sum(n < group_size for n in attempts_per_group) / len(attempts_per_group)


def outcome_zero_signal(rows: list[ProbeRow]) -> float | None:
    """Share of probe groups whose attempts all succeeded or all failed (outcomes only, partial credit aside)."""
    rows = [r for r in rows if r.attempts]
    return round(sum(r.successes in (0, r.attempts) for r in rows) / len(rows), 4) if rows else None


def ratio(num: float | None, den: float | None) -> float | None:
    return round(num / den, 4) if num is not None and den else None


@dataclass
class GapAccumulator:
    """Sums of |trainer - sampler| log-prob gaps by staleness s = trainer version - sampler version."""

    sums: dict[int, float] = field(default_factory=dict)
    counts: dict[int, int] = field(default_factory=dict)

    def add(self, staleness: int, gap_sum: float, tokens: int) -> None:
        if staleness < 0 or tokens <= 0:
            return
        self.sums[staleness] = self.sums.get(staleness, 0.0) + gap_sum
        self.counts[staleness] = self.counts.get(staleness, 0) + tokens

    def means(self, max_staleness: int = MAX_STALENESS_MEASURED) -> dict[str, float | None]:
        return {str(s): (round(self.sums[s] / self.counts[s], 5) if self.counts.get(s) else None)
                for s in range(max_staleness + 1)}


def token_weighted(rows: list[dict[str, Any]], key: str, weight: str = "tokens") -> float | None:
    """Mean of ``key`` over metric rows, weighted by ``weight`` (1 where a row lacks it)."""
    pairs = [(float(r[key]), float(r.get(weight, 1.0))) for r in rows if key in r]
    total = sum(w for _, w in pairs)
    return round(sum(v * w for v, w in pairs) / total, 5) if total > 0 else None


def harness_fairness(settings: dict[str, dict[str, Any]]) -> list[str]:
    """What makes a harness on/off comparison unfair: unequal display limits, policies or prices."""
    problems = []
    for key in ("max_observation_chars", "policy", "prices", "tasks", "trials"):
        if len({repr(s.get(key)) for s in settings.values()}) > 1:
            problems.append(f"{key} differs between configurations")
    if any(s.get("prices", {}).get("cached_input", 1.0) >= 1.0 for s in settings.values()):
        problems.append("cached input tokens are not priced as cached")
    if any(s.get("policy") == "scripted" for s in settings.values()):
        problems.append("a scripted policy never reads its observations")
    return problems


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def _num(x: float | None, fmt: str = ".3f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _times(x: float | None, fmt: str) -> str:
    return "n/a" if x is None else f"{format(x, fmt)}x"


def table_rows(data: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(claim, the seed's figure, ours) rows of the table: printed, in the JSON (``table``, which the HTML
    report renders) and in docs/recipe.md."""
    gap, zero = data.get("logprob_gap_by_staleness") or {}, data.get("zero_signal") or {}
    rl, sft = data.get("rl_pass_at_1"), data.get("sft_control_pass_at_1")
    rows = [
        ("zero-signal groups, unfiltered -> filtered", SEED_FIGURES["zero_signal"],
         f"{_pct(data.get('zero_signal_unfiltered'))} -> {_pct(data.get('zero_signal_filtered'))} (outcomes "
         f"only: {_pct(zero.get('outcome_unfiltered'))} -> {_pct(zero.get('outcome_filtered'))})"),
        ("tokens per solve, efficiency reward on / off", SEED_FIGURES["tokens_per_solve_ratio"],
         f"{_times(data.get('tokens_per_solve_ratio'), '.3f')} (equal Pass@1 within 1 s.e.: "
         f"{data.get('tokens_per_solve_equal_pass_at_1')})"),
        ("harness cost, features on vs off", SEED_FIGURES["harness_cost_reduction"],
         "n/a" if data.get("harness_cost_reduction") is None else f"{0.0 - data['harness_cost_reduction']:+.1%}"),
        ("log-prob gap at staleness 1 / 4-6", SEED_FIGURES["logprob_gap_by_staleness"],
         f"{_num(gap.get('1'), '.4f')} / " + ", ".join(_num(gap.get(str(s)), ".4f") for s in (4, 5, 6))),
        ("groups lost to infra faults, no retries -> retries", SEED_FIGURES["infra_group_loss"],
         f"{_pct(data.get('infra_group_loss_without_retries'))} -> "
         f"{_pct(data.get('infra_group_loss_with_retries'))}"),
        ("tokens truncated by the IS cap", SEED_FIGURES["tis_truncated_token_share"],
         _pct(data.get("tis_truncated_token_share"))),
        ("async vs sync steps per hour", SEED_FIGURES["async_vs_sync_steps_per_hour"],
         _times(data.get("async_vs_sync_steps_per_hour"), ".2f")),
        ("held-out Pass@1, RL vs equal-time SFT", SEED_FIGURES["rl_vs_sft"],
         f"{_num(rl)} +/- {_num(data.get('rl_pass_at_1_se'))} vs {_num(sft)} +/- "
         f"{_num(data.get('sft_control_pass_at_1_se'))} ({data.get('seeds')} seed(s); warm start "
         f"{_num((data.get('base') or {}).get('pass_at_1'))})"),
        *[(f"held-out Pass@1 of the {label} families, RL vs equal-time SFT", SEED_FIGURES["rl_vs_sft"],
           f"{_num(data.get(f'rl_pass_at_1_{part}'))} +/- {_num(data.get(f'rl_pass_at_1_{part}_se'))} vs "
           f"{_num(data.get(f'sft_control_pass_at_1_{part}'))} +/- "
           f"{_num(data.get(f'sft_control_pass_at_1_{part}_se'))} (warm start "
           f"{_num((data.get('base') or {}).get(f'pass_at_1_{part}'))})")
          for part, label in (("reward_only", "reward-only"), ("warm_started", "warm-started"))
          if data.get(f"rl_pass_at_1_{part}") is not None],
        ("entropy / mismatch KL over the run (max)", SEED_FIGURES["stability"],
         f"{_num(max(data.get('entropy_by_step') or [math.nan]))} / "
         f"{_num(max(data.get('mismatch_kl_by_step') or [math.nan]), '.4f')}"),
    ]
    return rows


def missing_keys(data: dict[str, Any]) -> list[str]:
    return [k for k in REQUIRED_KEYS if k not in data]


# ---- the workload ------------------------------------------------------------------------------------------


@dataclass
class Workload:
    """What every measurement shares: the config, the demo's tasks, tokenizer, sandbox and warm start."""

    cfg: RunConfig
    pipe: Pipeline
    train: list[Task]
    heldout: list[Task]
    tokenizer: PreTrainedTokenizerBase
    backend: Backend
    base_dir: Path
    root: Path
    demos: list[Sample] = field(default_factory=list)

    def eval_cfg(self, harness: dict[str, Any] | None = None, temperature: float | None = None) -> RunConfig:
        """The evaluation config (``eval.temperature``), with harness knobs or another temperature."""
        cfg = self.pipe.eval_config()
        update: dict[str, Any] = {"harness": cfg.harness.model_copy(update=harness or {})}
        if temperature is not None:
            update["sampling"] = cfg.sampling.model_copy(update={"temperature": temperature})
        return cfg.model_copy(update=update)

    def engine(self, model_dir: Path) -> BuiltinEngine:
        from albatross.engine.builtin import BuiltinEngine
        from albatross.trainer.model import load_model

        return BuiltinEngine(load_model(model_dir), max_batch_size=self.cfg.engine.max_batch_size)

    def evaluate(self, engine: Engine, harness: dict[str, Any] | None = None, temperature: float | None = None,
                 trials: int | None = None, workers: int = 16) -> EvalResult:
        """Held-out evaluation (``eval.trials`` each unless ``trials``), ``workers`` attempts at a time."""
        from albatross.eval.run import evaluate
        from albatross.harness.agent import build_agent

        agent = build_agent(self.eval_cfg(harness, temperature), engine, self.backend, self.tokenizer)
        return evaluate(agent, self.heldout, trials or self.cfg.eval.trials, workers=workers)


def _log(line: str) -> None:
    print(line, flush=True)


class Parts:
    """The finished parts of a run, each saved as JSON under ``dir`` when it completes (``<out>/parts`` with
    ``--out``). A later run with the same ``--out`` reuses a part whose settings (and ``common``: the format
    version, ``--quick``, ``--set``) are the same, so a stopped run resumes where it stopped and a changed setting
    re-measures only the parts it touches."""

    def __init__(self, dir: Path, common: dict[str, Any]) -> None:
        self.dir, self.common = dir, common

    def get(self, name: str, settings: dict[str, Any], compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        import json

        path, want = self.dir / f"{name}.json", {**self.common, **settings}
        if path.is_file():
            saved = json.loads(path.read_text())
            if saved.get("settings") == want:
                _log(f"[recipe] {name}: reusing the result saved in {path}")
                result: dict[str, Any] = saved["result"]
                return result
        result = compute()
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"settings": want, "result": result}, indent=1))
        tmp.replace(path)
        return result


def recipe_config(args: argparse.Namespace, out_dir: Path) -> RunConfig:
    """The demo's config (``--quick``: ``albatross demo --quick``'s, so the two share the cached warm start),
    then the ``--set`` overrides."""
    from albatross.pipeline.demo import demo_config

    return demo_config(None, bool(args.quick), str(out_dir), list(args.set or []))


def prepare(args: argparse.Namespace, root: Path) -> Workload:
    import torch

    from albatross.cache import cache_root
    from albatross.harness.agent import build_agent
    from albatross.pipeline.driver import Pipeline
    from albatross.pipeline.warmstart import warm_start

    cfg = recipe_config(args, root / "demo")
    pipe = Pipeline(cfg, _log, command="bench recipe")
    pipe.prepare_out()
    train, heldout = pipe.load_tasks()
    tokenizer, model_dir = pipe.load_model()
    backend = pipe.open_backend()
    try:
        torch.manual_seed(cfg.seed)
        torch.set_num_threads(cfg.engine.threads)
        agent = build_agent(cfg, None, backend, tokenizer)
        base_dir = warm_start(cfg, tokenizer, agent, train, model_dir, pipe.pass_rate_fn(agent, train),
                              cache_root(), _log)
    except BaseException:
        backend.close()
        raise
    return Workload(cfg, pipe, train, heldout, tokenizer, backend, base_dir, root)


# ---- probes: zero-signal groups and infrastructure faults -------------------------------------------------


def _group_size(cfg: RunConfig) -> int:
    from albatross.tasks.probe import MIN_ATTEMPTS

    return max(MIN_ATTEMPTS, cfg.orchestrator.group_size)


def _probe(w: Workload, engine: Engine, tasks: list[Task], backend: Backend, retries: int) -> list[ProbeRow]:
    from albatross.harness.agent import build_agent
    from albatross.orchestrator.loop import rl_test_weights
    from albatross.pipeline.probe import probe
    from albatross.rl.scoring import GroupScorer

    agent = build_agent(w.cfg, engine, backend, w.tokenizer)
    scorer = GroupScorer(w.cfg.rl, rl_test_weights(w.cfg.rl.test_weights))
    return probe(agent, tasks, _group_size(w.cfg), scorer, retries=retries,
                 workers=w.cfg.orchestrator.rollout_workers)


def _probe_tasks(w: Workload, n: int) -> list[Task]:
    return random.Random(w.cfg.seed).sample(w.train, min(n, len(w.train)))


def measure_zero_signal(w: Workload, engine: Engine, n_tasks: int) -> dict[str, Any]:
    """Zero-signal share of the base model's groups before and after the 15-85% filter, paired: a first probe
    decides the filter; a second, independent probe of every task gives both figures (all tasks: unfiltered;
    the kept ones: filtered), so the two differ only by the filter's choice of tasks. The first probe's own
    groups at a kept task can never be zero-signal (its pass rate is strictly between 0 and 1): reusing them
    would make the filter look perfect."""
    from albatross.tasks.filter import filter_rows, observed_zero_signal

    tasks = _probe_tasks(w, n_tasks)
    g = _group_size(w.cfg)
    rows = _probe(w, engine, tasks, w.backend, w.cfg.sandbox.max_infra_retries)
    result = filter_rows(rows, group_size=g)
    kept = {r.task for r in result.kept}
    fresh = _probe(w, engine, tasks, w.backend, w.cfg.sandbox.max_infra_retries)
    fresh_kept = [r for r in fresh if r.task in kept]
    out: dict[str, Any] = {"zero_signal_unfiltered": round(observed_zero_signal(fresh), 4),
           "zero_signal_filtered": round(observed_zero_signal(fresh_kept), 4) if fresh_kept else None,
           "zero_signal": {"group_size": g, "tasks_probed": len(rows), "tasks_kept": len(kept),
                           "band": [result.low, result.high],
                           "rule": "all scores of the group equal (the training scorer's, partial credit included)",
                           "design": "probe 1 decides the filter; probe 2 (fresh attempts at every task) is "
                                     "measured: all tasks (unfiltered) vs the kept tasks (filtered)",
                           "first_probe_unfiltered": round(observed_zero_signal(rows), 4),
                           "groups_unfiltered": sum(r.zero_signal for r in fresh if r.attempts),
                           "groups_filtered": sum(r.zero_signal for r in fresh_kept if r.attempts),
                           "outcome_unfiltered": outcome_zero_signal(fresh),
                           "outcome_filtered": outcome_zero_signal(fresh_kept),
                           "expected_unfiltered": round(result.expected_before, 4),
                           "expected_filtered": round(result.expected_after, 4)}}
    _log(f"[recipe] zero-signal groups {out['zero_signal_unfiltered']:.1%} at all {len(fresh)} probed tasks, "
         f"{_pct(out['zero_signal_filtered'])} at the {len(kept)} kept tasks (second probe)")
    return out


def measure_infra(w: Workload, engine: Engine, n_tasks: int, rate: float) -> dict[str, Any]:
    """Groups lost when ``rate`` of forks fail, with no retries and with ``sandbox.max_infra_retries``."""
    from albatross.sandbox import make_backend

    sc, g = w.cfg.sandbox, _group_size(w.cfg)
    kw: dict[str, Any] = {"hide_paths": w.pipe.hide_paths(), "fail_rate": rate, "fault_seed": w.cfg.seed}
    if sc.type == "local":
        kw.update(base=sc.base, warm=sc.warm)
    tasks = _probe_tasks(w, n_tasks)
    out: dict[str, Any] = {}
    for name, retries in (("without", 0), ("with", sc.max_infra_retries)):
        faulty = make_backend(sc.type, **kw)
        try:
            rows = _probe(w, engine, tasks, faulty, retries)
            forks = dict(faulty.faults.counts)
        finally:
            faulty.close()
        out[f"infra_group_loss_{name}_retries"] = round(group_loss_share([r.attempts for r in rows], g), 4)
        out.setdefault("infra", {})[name] = {"retries": retries, "groups": len(rows), "faults": forks}
    out["infra"].update(fault_rate=rate, group_size=g)
    _log(f"[recipe] groups lost to {rate:.0%} failing forks: {out['infra_group_loss_without_retries']:.1%} "
         f"without retries, {out['infra_group_loss_with_retries']:.1%} with {sc.max_infra_retries}")
    return out


# ---- RL runs and the SFT control ---------------------------------------------------------------------------


class VersionKeeper:
    """A step observer of the real loop (``StepObserver``): a copy of the weights of versions 1..``upto`` as the
    trainer exports them (the run directory keeps only the newest few)."""

    def __init__(self, dest: Path, upto: int) -> None:
        self.dest, self.upto = dest, upto

    def on_start(self) -> None:
        pass

    def on_step(self, event: StepEvent) -> None:
        if event.version <= self.upto:
            try:
                shutil.copytree(event.weights, self.dest / f"v{event.version}", dirs_exist_ok=True)
            except FileNotFoundError:  # pruned already: that version is not scored
                pass


def rl_run(w: Workload, name: str, seed: int, minutes: float, efficiency_lambda: float,
           keep_versions: bool = False) -> dict[str, Any]:
    """One run of the demo's RL loop from the warm start, then its held-out evaluation."""
    import torch

    from albatross.harness.agent import build_agent
    from albatross.orchestrator.loop import AsyncLoop

    cfg = w.cfg.model_copy(update={
        "seed": seed, "rl": w.cfg.rl.model_copy(update={"efficiency_lambda": efficiency_lambda}),
        "orchestrator": w.cfg.orchestrator.model_copy(update={"max_minutes": minutes, "max_steps": 1000000})})
    torch.manual_seed(seed)
    run_dir = w.root / name / "run"
    engine = w.engine(w.base_dir)
    try:
        observers = [VersionKeeper(w.root / name / "versions", MAX_STALENESS_MEASURED)] if keep_versions else []
        loop = AsyncLoop(cfg, build_agent(cfg, engine, w.backend, w.tokenizer), engine, w.train, w.base_dir,
                         run_dir, _log, observers=observers)
        t0 = time.monotonic()
        state = loop.run()
        wall = time.monotonic() - t0
        result = w.evaluate(engine)
    finally:
        engine.close()
    out = {"run_dir": str(run_dir), "wall_seconds": round(wall, 1), "steps": int(state.step),
           "efficiency_lambda": efficiency_lambda, **_eval_fields(w, result)}
    _log(f"[recipe] {name}: {out['steps']} steps in {wall:.0f}s, held-out pass@1 {out['pass_at_1']:.3f}")
    return out


def _eval_fields(w: Workload, result: EvalResult) -> dict[str, Any]:
    """Held-out Pass@1 with its s.e., and (with ``tasks.reward_only_families``) the same over the reward-only
    families' tasks and over the others (``pass_at_1_reward_only``, ``pass_at_1_warm_started``)."""
    from albatross.pipeline.summary import split_fields

    se = result.pass_at_1_se
    split = split_fields(w.heldout, w.cfg.tasks.reward_only_families, held=result)
    return {"pass_at_1": round(result.pass_at_1, 4), "pass_at_1_se": None if se is None else round(se, 4),
            **{k.removeprefix("held_"): v for k, v in split.items()},
            "tokens_per_solve": round(result.tokens_per_solve, 2), "attempts": len(result.trajectories)}


def sft_control(w: Workload, name: str, seed: int, seconds: float) -> dict[str, Any]:
    """Continue SFT on oracle demonstrations from the warm start for ``seconds`` of wall time, then evaluate."""
    import torch

    from albatross.devices import trainer_device
    from albatross.engine.builtin import BuiltinEngine
    from albatross.trainer.model import load_model, to_device
    from albatross.trainer.step import Trainer

    torch.manual_seed(seed)
    model = to_device(load_model(w.base_dir), trainer_device(w.cfg.trainer.device))
    trainer = Trainer.from_config(model, w.cfg, lr=w.cfg.warmstart.lr, lora=False)
    rng, bs, steps = random.Random(seed), w.cfg.warmstart.batch_size, 0
    t0 = time.monotonic()
    while time.monotonic() - t0 < seconds:
        trainer.sft_step(rng.sample(w.demos, min(bs, len(w.demos))))
        steps += 1
    wall = time.monotonic() - t0
    engine = BuiltinEngine(model.cpu().train(False), max_batch_size=w.cfg.engine.max_batch_size)
    try:
        result = w.evaluate(engine)
    finally:
        engine.close()
    out = {"wall_seconds": round(wall, 1), "sft_steps": steps, **_eval_fields(w, result)}
    _log(f"[recipe] {name}: {steps} SFT steps in {wall:.0f}s, held-out pass@1 {out['pass_at_1']:.3f}")
    return out


def seed_runs(w: Workload, parts: Parts, seeds: int, minutes: float,
              efficiency: bool = True) -> dict[str, list[dict[str, Any]]]:
    """Per seed: RL with the efficiency reward (the first keeps its versions), the SFT control, RL without the
    efficiency reward (unless not ``efficiency``); each seed one part (saved when its runs are done)."""
    runs: dict[str, list[dict[str, Any]]] = {"rl": [], "rl_no_efficiency": [], "sft_control": []}
    for s in range(seeds):
        seed = w.cfg.seed + s
        settings = {"minutes": minutes, "keeps_versions": s == 0, **({} if efficiency else {"efficiency": False})}
        one = parts.get(f"seed{seed}", settings, functools.partial(_one_seed, w, seed, minutes, s == 0, efficiency))
        for key, run in one.items():
            runs[key].append(run)
    return runs


def _one_seed(w: Workload, seed: int, minutes: float, keep_versions: bool,
              efficiency: bool = True) -> dict[str, dict[str, Any]]:
    from albatross.harness.agent import builtin_agent
    from albatross.pipeline.warmstart import collect_demonstrations, demonstrated

    if not w.demos:  # the demonstrations the warm start had: none of a reward-only family
        demonstrable = demonstrated(w.train, w.cfg.tasks.reward_only_families)
        w.demos = collect_demonstrations(builtin_agent(w.cfg, None, w.backend, w.tokenizer), demonstrable)
    names = (f"rl-seed{seed}", f"sft-seed{seed}", f"rl-noeff-seed{seed}")
    for name in names:  # a run measured anew starts from nothing (not from a stopped run's directory)
        shutil.rmtree(w.root / name, ignore_errors=True)
    lam = w.cfg.rl.efficiency_lambda or 0.1
    rl = rl_run(w, names[0], seed, minutes, lam, keep_versions=keep_versions)
    sft = sft_control(w, names[1], seed, rl["wall_seconds"])
    out = {"rl": {"seed": seed, **rl}, "sft_control": {"seed": seed, **sft}}
    if efficiency:
        out["rl_no_efficiency"] = {"seed": seed, **rl_run(w, names[2], seed, minutes, 0.0)}
    return out


def rl_figures(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Pass@1 of RL and of the SFT control (mean, s.e. over seeds) and the efficiency reward's token ratio."""
    out: dict[str, Any] = {}
    for key, name in (("rl", "rl_pass_at_1"), ("sft_control", "sft_control_pass_at_1")):
        for part in ("", "_reward_only", "_warm_started"):
            values = [r[f"pass_at_1{part}"] for r in runs[key] if r.get(f"pass_at_1{part}") is not None]
            if not values:
                continue
            mean, se = mean_se(values)
            out.update({f"{name}{part}": _round(mean), f"{name}{part}_se": _round(se), f"{name}{part}_by_seed": values})
    on, off = runs["rl"], runs["rl_no_efficiency"]
    if not off:  # --skip-efficiency: the key stays, unmeasured
        return {**out, "tokens_per_solve_ratio": None}
    tps_on, _ = mean_se([r["tokens_per_solve"] for r in on if r["tokens_per_solve"]])
    tps_off, _ = mean_se([r["tokens_per_solve"] for r in off if r["tokens_per_solve"]])
    p_on, p_off = _pass_with_se(on), _pass_with_se(off)
    out.update({"tokens_per_solve_ratio": ratio(tps_on, tps_off),
                "tokens_per_solve_with_efficiency": _round(tps_on), "tokens_per_solve_without_efficiency":
                _round(tps_off), "pass_at_1_with_efficiency": p_on[0], "pass_at_1_with_efficiency_se": p_on[1],
                "pass_at_1_without_efficiency": p_off[0], "pass_at_1_without_efficiency_se": p_off[1],
                "tokens_per_solve_equal_pass_at_1": equal_within_se(p_on[0], p_on[1], p_off[0], p_off[1])})
    return out


def _pass_with_se(runs: list[dict[str, Any]]) -> tuple[float, float | None]:
    """Pass@1 over seeds with its s.e. over seeds; one seed: that run's s.e. over tasks."""
    mean, se = mean_se([r["pass_at_1"] for r in runs])
    assert mean is not None  # seeds >= 1: every setting has a run
    if len(runs) == 1:
        se = runs[0]["pass_at_1_se"]
    return round(mean, 4), _round(se)


def _round(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


# ---- figures of the first RL run ---------------------------------------------------------------------------


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    import json

    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _gap_samples(run_dir: Path, seed: int) -> list[TrainSample]:
    """Trained-on samples of the run (token ids, sampler log-probs and versions), a random subset."""
    from albatross.records import STATUS_INFRA_ERROR, TrainSample, Trajectory

    samples: list[TrainSample] = []
    for row in _read_jsonl(run_dir / "trajectories.jsonl"):
        traj = Trajectory.from_dict(row)
        if traj.status != STATUS_INFRA_ERROR:
            samples += [TrainSample(s, 0.0) for s in traj.samples
                        if s.num_model_tokens and min(s.versions) <= MAX_STALENESS_MEASURED]
    rng = random.Random(seed)
    return rng.sample(samples, GAP_SAMPLES) if len(samples) > GAP_SAMPLES else samples


def _version_dirs(w: Workload, keep_dir: Path) -> dict[int, Path]:
    dirs = {0: w.base_dir}
    for v in range(1, MAX_STALENESS_MEASURED + 1):
        if (keep_dir / f"v{v}").is_dir():
            dirs[v] = keep_dir / f"v{v}"
    return dirs


def _load_version(path: Path, base_dir: Path) -> Any:
    """A kept version as a model: a full checkpoint, or (a LoRA run's) adapter merged into the base it trained on,
    its output layer untied from the input embedding when the adapter moves it (as the built-in engine does)."""
    import torch

    from albatross.engine.adapter import is_adapter_dir, merged_weights, read_adapter
    from albatross.engine.builtin.runner import untie_changed
    from albatross.trainer.model import load_model

    if not is_adapter_dir(path):
        return load_model(path)
    model = load_model(base_dir)
    pairs, scale = read_adapter(path)
    current = model.state_dict()
    merged = merged_weights(current, pairs, scale, path)
    untie_changed(model, {**current, **merged})
    with torch.no_grad():
        for name, tensor in merged.items():
            model.get_parameter(name).copy_(tensor)
    return model


def logprob_gaps(w: Workload, run_dir: Path, keep_dir: Path) -> dict[str, Any]:
    """Mean |trainer log-prob at version v+s - sampler log-prob at v| over model tokens, by s (0..6)."""
    import torch

    from albatross.trainer.packing import pack
    from albatross.trainer.step import Trainer

    samples, acc = _gap_samples(run_dir, w.cfg.seed), GapAccumulator()
    versions = _version_dirs(w, keep_dir)
    for trainer_version, path in sorted(versions.items()):
        trainer = Trainer.from_config(_load_version(path, w.base_dir), w.cfg, lora=False)  # merged: no adapters
        for mb in pack(samples, trainer.micro_batch_tokens):
            with torch.no_grad():
                logprobs, _ = trainer.forward_logprobs(mb)
            gap = (logprobs.float().cpu() - mb.logprobs).abs()
            mask = mb.loss_mask > 0
            for v in torch.unique(mb.versions[mask]).tolist():
                sel = mask & (mb.versions == v)
                acc.add(trainer_version - int(v), float(gap[sel].sum()), int(sel.sum()))
    return {"logprob_gap_by_staleness": acc.means(),
            "logprob_gap_tokens_by_staleness": {str(s): acc.counts.get(s, 0)
                                                for s in range(MAX_STALENESS_MEASURED + 1)},
            "logprob_gap_versions_kept": sorted(versions)}


def run_metrics(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Truncated-token share over every RL run's steps; entropy and mismatch KL by step of the first run."""
    rows = [r for run in runs for r in _read_jsonl(Path(run["run_dir"]) / "metrics.jsonl")]
    first = _read_jsonl(Path(runs[0]["run_dir"]) / "metrics.jsonl") if runs else []
    return {"tis_truncated_token_share": token_weighted(rows, "truncated_fraction"),
            "entropy_by_step": [round(float(r["entropy"]), 5) for r in first if "entropy" in r],
            "mismatch_kl_by_step": [round(float(r["mismatch_kl"]), 6) for r in first if "mismatch_kl" in r],
            "rl_steps_measured": len(rows)}


def harness_cost(w: Workload, model_dir: Path) -> dict[str, Any]:
    """The trained model on the held-out tasks with redirection + compression off and on, equal display limit;
    cost per attempt with cached input tokens priced as cached (``bench harness``'s prices). Decoding is greedy
    and one attempt runs at a time (one trial per task: greedy trials repeat), so where the harness shows the
    model the same observations both configurations run the same attempts."""
    from albatross.bench.harness import attempt_cost, prices

    price = prices(argparse.Namespace(price_cached=0.1, price_output=5.0))
    engine = w.engine(model_dir)
    results, settings = {}, {}
    try:
        for name, knobs in HARNESS_CONFIGS.items():
            # greedy, one attempt at a time (a batch's make-up can flip a near-tie): only the harness differs
            result = w.evaluate(engine, knobs, temperature=0.0, trials=1, workers=1)
            costs = [attempt_cost(t, price)[1] for t in result.trajectories]
            cost, cost_se = mean_se(costs)
            assert cost is not None  # one attempt per held-out task, and there are held-out tasks
            results[name] = {**_eval_fields(w, result), "cost_per_attempt": round(cost, 2),
                             "cost_per_attempt_se": _round(cost_se, 2),
                             "compressions_per_attempt": statistics.fmean(len(t.compressions)
                                                                          for t in result.trajectories), **knobs}
            settings[name] = {"max_observation_chars": w.cfg.harness.max_observation_chars, "prices": price,
                              "policy": f"trained demo model {model_dir.name}, greedy", "tasks": len(w.heldout),
                              "trials": 1}
    finally:
        engine.close()
    off, on = results["off"], results["on"]
    reduction = round(1 - on["cost_per_attempt"] / off["cost_per_attempt"], 4) if off["cost_per_attempt"] else None
    return {"harness_cost_reduction": reduction, "harness": {
        "configs": results, "prices": price, "display_limit_chars": w.cfg.harness.max_observation_chars,
        "unfair": harness_fairness(settings),
        "equal_success_within_se": equal_within_se(on["pass_at_1"], on["pass_at_1_se"], off["pass_at_1"],
                                                   off["pass_at_1_se"])}}


def loop_figure(args: argparse.Namespace) -> dict[str, Any]:
    """``bench loop`` (its own runs, quick when this is quick): the async / sync steps-per-hour ratio."""
    from albatross.bench import loop

    p = argparse.ArgumentParser()
    loop.add_arguments(p)
    argv = (["--quick"] if args.quick else []) + (
        ["--minutes", str(args.loop_minutes)] if args.loop_minutes is not None else [])
    ns = p.parse_args(argv)
    ns.json = None
    data = loop.run(ns)
    keep = ("steps", "steps_per_hour", "heldout_pass_at_1", "mean_staleness", "max_staleness")
    return {"async_vs_sync_steps_per_hour": data.get("async_vs_sync_steps_per_hour"),
            "loop": {m: {k: data[m].get(k) for k in keep} for m in ("sync", "async") if m in data}}


# ---- the benchmark -----------------------------------------------------------------------------------------


def _check_args(args: argparse.Namespace) -> tuple[float, int]:
    from albatross.errors import UserError
    from albatross.pipeline.demo import demo_config

    minutes = args.minutes if args.minutes is not None else (
        0.5 if args.quick else demo_config(None, False, None, list(args.set or [])).orchestrator.max_minutes)
    seeds = args.seeds if args.seeds is not None else (1 if args.quick else 3)
    if not minutes > 0:
        raise UserError(f"bench recipe --minutes {minutes}: must be > 0")
    if seeds < 1:
        raise UserError(f"bench recipe --seeds {seeds}: must be at least 1")
    if not 0.0 <= args.fault_rate < 1.0:
        raise UserError(f"bench recipe --fault-rate {args.fault_rate}: must be in [0, 1)")
    if args.probe_tasks is None:
        args.probe_tasks = 24 if args.quick else 96
    if args.probe_tasks < 1:
        raise UserError(f"bench recipe --probe-tasks {args.probe_tasks}: must be at least 1")
    return minutes, seeds


def run(args: argparse.Namespace) -> dict[str, Any]:
    from albatross.bench.common import print_table, write_json

    minutes, seeds = _check_args(args)
    keep = args.out
    root = Path(keep).resolve() if keep else Path(tempfile.mkdtemp(prefix="albatross-bench-recipe-"))
    t0 = time.monotonic()
    try:
        data = measure(args, root, minutes, seeds)
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    data["total_seconds"] = round(time.monotonic() - t0, 1)
    json_path = args.json
    if json_path:
        plot = write_plot(data, Path(json_path).with_name(Path(json_path).stem + "_stability.png"))
        data["stability_plot"] = Path(plot).name if plot else None  # beside the JSON
    data["table"] = [list(row) for row in table_rows(data)]
    print_table(f"albatross bench recipe{' --quick' if args.quick else ''}: the seed's figure | ours",
                [(claim, f"seed: {seed} | ours: {ours}") for claim, seed, ours in data["table"]])
    write_json(json_path, data)
    return data


def measure(args: argparse.Namespace, root: Path, minutes: float, seeds: int) -> dict[str, Any]:
    """Every figure: probes of the base model, the per-seed runs, the first run's figures, then bench loop; each
    part saved under ``root/parts`` as it completes, and reused by a later run with the same ``--out``."""
    w = prepare(args, root)
    parts = Parts(root / "parts", {"version": PARTS_VERSION, "quick": bool(args.quick),
                                    "set": sorted(args.set or [])})
    data: dict[str, Any] = {"quick": bool(args.quick), "seeds": seeds, "minutes_per_run": minutes}
    try:
        data.update(base_figures(w, parts, args))
        runs = seed_runs(w, parts, seeds, minutes, not args.skip_efficiency)
        data.update(rl_figures(runs))
        first = Path(runs["rl"][0]["run_dir"])
        data.update(run_metrics(runs["rl"] + runs["rl_no_efficiency"]))
        first_run = {"minutes": minutes, "run_dir": str(first)}
        data.update(parts.get("logprob_gaps", first_run, lambda: logprob_gaps(w, first, first.parent / "versions")))
        data.update(parts.get("harness", first_run, lambda: _first_run_harness(w, first)))
        data["runs"] = runs
        data["config"] = _config_meta(w)
    finally:
        w.backend.close()
    if args.loop_minutes != 0:
        data.update(parts.get("loop", {"loop_minutes": args.loop_minutes}, lambda: loop_figure(args)))
    else:
        data.update(async_vs_sync_steps_per_hour=None, loop={})
    data["notes"] = notes(data)
    return data


def base_figures(w: Workload, parts: Parts, args: argparse.Namespace) -> dict[str, Any]:
    """The probes (zero-signal groups, infrastructure faults) and the held-out evaluation of the warm start every
    run begins from; the base model's engine is started only for a part not saved already."""
    engines: list[BuiltinEngine] = []

    def with_engine(fn: Callable[[Engine], dict[str, Any]]) -> Callable[[], dict[str, Any]]:
        def compute() -> dict[str, Any]:
            if not engines:
                engines.append(w.engine(w.base_dir))
            return fn(engines[0])
        return compute

    n, out = args.probe_tasks, dict[str, Any]()
    try:
        out.update(parts.get("zero_signal", {"probe_tasks": n},
                             with_engine(lambda e: measure_zero_signal(w, e, n))))
        out.update(parts.get("infra", {"probe_tasks": n, "fault_rate": args.fault_rate},
                             with_engine(lambda e: measure_infra(w, e, n, args.fault_rate))))
        out["base"] = parts.get("base", {}, with_engine(lambda e: _eval_fields(w, w.evaluate(e))))
    finally:
        for engine in engines:
            engine.close()
    _log(f"[recipe] base held-out pass@1 {out['base']['pass_at_1']:.3f}")
    return out


def _first_run_harness(w: Workload, first: Path) -> dict[str, Any]:
    trained = first.parent / "versions" / "final"
    _export_final(first, trained)
    return harness_cost(w, trained if trained.is_dir() else w.base_dir)


def _export_final(run_dir: Path, dest: Path) -> None:
    """The newest weights of a run (the model its held-out evaluation used), copied to ``dest``."""
    from albatross.trainer.checkpoint import exported_versions, version_dir

    versions = exported_versions(run_dir / "weights")
    if versions:
        shutil.copytree(version_dir(run_dir / "weights", versions[-1]), dest, dirs_exist_ok=True)


def _config_meta(w: Workload) -> dict[str, Any]:
    oc = w.cfg.orchestrator
    return {"train_tasks": len(w.train), "heldout_tasks": len(w.heldout), "eval_trials": w.cfg.eval.trials,
            "group_size": oc.group_size, "groups_per_step": oc.groups_per_step, "seed": w.cfg.seed,
            "efficiency_lambda": w.cfg.rl.efficiency_lambda or 0.1, "is_cap": w.cfg.rl.is_cap,
            "max_staleness": w.cfg.rl.max_staleness, "sandbox": w.backend.name, "demonstrations": len(w.demos),
            "display_limit_chars": w.cfg.harness.max_observation_chars}


def notes(data: dict[str, Any]) -> list[str]:
    """Plain statements of what the figures do and do not show."""
    out = []
    cfg = data.get("config", {})
    if data.get("quick"):
        out.append(f"quick: a smoke test ({data.get('seeds')} seed(s), {cfg.get('heldout_tasks')} held-out tasks x "
                   f"{cfg.get('eval_trials')} trials, {data.get('minutes_per_run')} min per RL run); the full "
                   "mode's figures are the ones to quote")
    zs = data.get("zero_signal", {})
    out.append(f"zero-signal, paired: a first probe chose the tasks; a second probe with fresh attempts at all "
               f"{zs.get('tasks_probed')} tasks is measured, {zs.get('groups_unfiltered')} zero-signal groups in all, "
               f"{zs.get('groups_filtered')} at the {zs.get('tasks_kept')} kept tasks (the first probe's groups at a "
               "kept task are never zero-signal by construction)")
    if data.get("zero_signal_filtered") is None:
        out.append("no probed task had a pass rate in the band: zero_signal_filtered is not measured")
    rl, sft = data.get("rl_pass_at_1"), data.get("sft_control_pass_at_1")
    if rl is not None and sft is not None and rl <= sft:
        out.append(f"RL is NOT ahead of the equal-wall-time SFT control ({rl:.3f} vs {sft:.3f})")
    rl_ro, sft_ro = data.get("rl_pass_at_1_reward_only"), data.get("sft_control_pass_at_1_reward_only")
    if rl_ro is not None and sft_ro is not None:
        out.append(f"reward-only families (no demonstration ever shown; the SFT control trains on the other "
                   f"families' demonstrations): RL {rl_ro:.3f} vs SFT {sft_ro:.3f}, "
                   + ("RL ahead" if rl_ro > sft_ro else "RL NOT ahead"))
    out.append("SFT control: the same wall time as its RL run, which includes the trainer process's start-up "
               "and the training of batches queued when the budget ran out")
    if not data.get("runs", {}).get("rl_no_efficiency", True):
        out.append("tokens_per_solve_ratio: not measured (--skip-efficiency)")
    elif data.get("tokens_per_solve_ratio") is None:
        out.append("tokens_per_solve_ratio: n/a, the runs with or without the efficiency reward solved no held-out "
                   "task")
    elif data.get("tokens_per_solve_equal_pass_at_1") is not True:
        out.append("tokens_per_solve_ratio: Pass@1 with and without the efficiency reward is not equal within one "
                   "standard error (or has no standard error), so the ratio is not at equal accuracy")
    out += _harness_notes(data.get("harness", {}))
    gaps = data.get("logprob_gap_by_staleness") or {}
    missing = [s for s, v in gaps.items() if v is None]
    if missing:
        out.append(f"log-prob gap at staleness {', '.join(missing)}: the run did not reach those versions")
    infra = data.get("infra", {}).get("with", {})
    if infra.get("groups"):
        out.append(f"infra group loss: {infra['groups']} groups per setting (resolution {1 / infra['groups']:.1%})")
    if data.get("loop"):
        out.append("async_vs_sync_steps_per_hour: bench loop's own runs (long-tail command delays), see bench loop")
    else:
        out.append("async_vs_sync_steps_per_hour: not measured here (--loop-minutes 0): run albatross bench loop")
    return out


def _harness_notes(h: dict[str, Any]) -> list[str]:
    out = [f"harness comparison not fair: {p}" for p in h.get("unfair", [])]
    off, on = h.get("configs", {}).get("off", {}), h.get("configs", {}).get("on", {})
    if on and not on.get("compressions_per_attempt"):
        out.append("harness: the demo's short attempts never reach the context budget, so compression never "
                   "triggers; the cost difference comes from output redirection only")
    out.append("harness: the demo's commands finish in well under a second, so background jobs have nothing to "
               "overlap and are not in this figure (bench harness measures them with a scripted policy)")
    costs = [c.get(k) for c in (on, off) for k in ("cost_per_attempt", "cost_per_attempt_se")]
    if None not in costs and costs[0] == costs[2]:
        out.append("harness: with and without the features every attempt costs the same: on this workload they "
                   "change nothing the model sees (every output fits the display limit)")
    elif None not in costs and equal_within_se(*costs):
        out.append("harness: the cost with and without the features differs by less than one standard error "
                   "(within noise)")
    if h.get("equal_success_within_se") is False:
        out.append("harness: Pass@1 with and without the features differs by more than one standard error")
    return out


def write_plot(data: dict[str, Any], path: Path) -> str | None:
    """Entropy and mismatch KL by trainer step of the first RL run, as a PNG; its path (None: no steps)."""
    entropy, kl = data.get("entropy_by_step") or [], data.get("mismatch_kl_by_step") or []
    if not entropy and not kl:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for ax, ys, title in ((axes[0], entropy, "entropy"), (axes[1], kl, "mismatch KL (r - log r - 1)")):
        ax.plot(range(1, len(ys) + 1), ys, marker="o", markersize=3)
        ax.set_title(title)
        ax.set_xlabel("trainer step")
        ax.set_ylim(bottom=0)
    fig.suptitle("no KL or entropy term: entropy and trainer-sampler mismatch over the run")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)
