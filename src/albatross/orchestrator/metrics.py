"""Where a run's metrics go: JSONL in the run directory, TensorBoard, optional W&B, and the console.

TensorBoard tags keep their ``/`` groups (``batch/groups_seen`` sits in the ``batch`` group); besides the trainer
steps, the warm start (``warmstart/...``) and the evaluations (``eval/base/pass_at_1``, ...) are logged too. W&B
(``orchestrator.wandb_project``, the ``wandb`` install extra) names its run after the run directory, groups it by
the run's name, and a resumed run continues the same W&B run (its id is kept in ``wandb_id``). The console shows a
progress bar with elapsed time and ETA on a terminal (step lines above it), plain step lines with the same figures
otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from albatross.errors import UserError
from albatross.progress import Bar, Plan, fmt_duration
from albatross.records import append_jsonl

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

WANDB_ID_FILE = "wandb_id"


class MetricsSink:
    def __init__(self, run_dir: Path, max_steps: int, log: Callable[[str], None] = print,
                 wandb_project: str = "", config: dict[str, Any] | None = None, *, max_minutes: float = 0.0,
                 run_name: str = "", group: str = "", resume: bool = False, plan: Plan | None = None) -> None:
        self.run_dir, self.max_steps, self.log, self.max_minutes = Path(run_dir), max_steps, log, max_minutes
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._tb = _tensorboard(self.run_dir / "tb")
        self._wandb = _wandb(wandb_project, self.run_dir, config or {}, run_name or self.run_dir.name, group,
                             resume)
        self.plan = plan
        self.bar: Bar | None = None
        self._t0 = time.monotonic()
        self._elapsed_before = 0.0
        self._first_step = 0

    # ---- trainer steps ------------------------------------------------------------------------------
    def start_training(self, first_step: int = 0, elapsed_s: float = 0.0) -> None:
        """The RL phase begins (a resumed run at ``first_step``, ``elapsed_s`` of its budget spent)."""
        self._t0, self._elapsed_before, self._first_step = time.monotonic(), elapsed_s, first_step
        self.bar = Bar("train", self.max_steps, self.log, unit="steps", plan=self.plan)
        self.bar.done = first_step

    def step(self, record: dict[str, Any]) -> None:
        append_jsonl(self.run_dir / "metrics.jsonl", record)
        step = int(record["step"])
        self._scalars(record, step)
        eta = self._train_eta(step)
        line = step_line(record, self.max_steps) + f"  elapsed {fmt_duration(self._elapsed())} eta {fmt_duration(eta)}"
        if self.bar is not None and self.bar.tty:
            self.bar.write(line)
            self.bar.update(step, eta_cap_s=self._time_left())
        else:
            self.log(line)

    def _elapsed(self) -> float:
        return self._elapsed_before + time.monotonic() - self._t0

    def _time_left(self) -> float | None:
        return max(0.0, self.max_minutes * 60 - self._elapsed()) if self.max_minutes > 0 else None

    def _train_eta(self, step: int) -> float | None:
        """The sooner of: the steps left at this run's pace, and the time budget left (``max_minutes``)."""
        pace = (time.monotonic() - self._t0) / max(1, step - self._first_step)
        eta = pace * max(0, self.max_steps - step)
        left = self._time_left()
        return min(eta, left) if left is not None else eta

    def status(self, fields: dict[str, Any]) -> None:
        """A live view of the training phase on a terminal: the bar with these figures (nothing otherwise)."""
        if self.bar is None or not self.bar.tty:
            return
        text = "  ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items())
        self.bar.update(self.bar.done, extra=text[:160], eta_cap_s=self._time_left())

    def end_training(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    # ---- other phases -------------------------------------------------------------------------------
    def scalars(self, group: str, values: dict[str, Any], step: int) -> None:
        """Numbers of a phase other than the trainer's steps (``warmstart``, ``eval/base``, ...), under
        ``group/`` in TensorBoard and W&B, and in ``metrics_other.jsonl``."""
        numbers = {f"{group}/{k}": float(v) for k, v in values.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if not numbers:
            return
        append_jsonl(self.run_dir / "metrics_other.jsonl", {"group": group, "step": step, **values})
        self._scalars(numbers, step)

    def _scalars(self, record: dict[str, Any], step: int) -> None:
        numbers = {k: v for k, v in record.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "time")}
        if self._tb is not None:
            for key, value in numbers.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numbers, step=step)

    def close(self) -> None:
        self.end_training()
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def step_line(r: dict[str, Any], max_steps: int) -> str:
    """One step's console line; with routing replay on, the mismatch KL without replay beside ``kl``."""
    return (f"[train] step {r['step']:>3}/{max_steps}  loss {r.get('loss', 0.0):+.4f}  "
            f"reward {r.get('reward_mean', 0.0):.2f}  pass {r['pass_rate']:.2f}  "
            f"stale mean {r.get('staleness_mean', 0.0):.1f} max {r.get('staleness_max', 0):.0f}  "
            f"kl {r.get('mismatch_kl', 0.0):.4f}  "
            + (f"kl no replay {r['mismatch_kl_no_replay']:.4f}  " if "mismatch_kl_no_replay" in r else "") +
            f"queue {r.get('queue_depth', 0)}  "
            f"trainer idle {r.get('trainer_idle_share', 0.0):.0%}  "
            + (f"engine idle {r['engine_idle_share']:.0%}  " if "engine_idle_share" in r else "") +
            f"gen tok/s {r.get('engine_tokens_per_s', 0.0):.0f}  train tok/s {r.get('tokens_per_s', 0.0):.0f}  "
            f"infra {r.get('infra_error_attempts', 0)}")


def _tensorboard(path: Path) -> SummaryWriter | None:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard not installed: JSONL and console only
        return None
    return SummaryWriter(str(path))


def check_wandb(project: str) -> None:
    """``orchestrator.wandb_project`` set without wandb installed is a ``UserError`` (before the run starts)."""
    import importlib.util

    if project and importlib.util.find_spec("wandb") is None:
        raise UserError(f"orchestrator.wandb_project = {project!r} but wandb is not installed: "
                        "pip install 'albatross[wandb]', or leave wandb_project empty")


def wandb_init_args(project: str, run_dir: Path, config: dict[str, Any], name: str, group: str,
                    resume: bool) -> dict[str, Any]:
    """``wandb.init`` arguments: the run named after the run directory, grouped by the run's name; a resumed
    run continues the W&B run whose id ``run_dir/wandb_id`` kept (a new run writes a fresh id there)."""
    import secrets

    id_file = Path(run_dir) / WANDB_ID_FILE
    run_id = id_file.read_text().strip() if resume and id_file.is_file() else ""
    if not run_id:
        run_id = secrets.token_hex(8)
        id_file.write_text(run_id + "\n")
    return {"project": project, "dir": str(run_dir), "config": config, "name": name, "group": group or None,
            "id": run_id, "resume": "allow"}


def _wandb(project: str, run_dir: Path, config: dict[str, Any], name: str, group: str,
           resume: bool) -> Any:  # wandb's Run: wandb is optional and untyped here
    if not project:
        return None
    check_wandb(project)
    import wandb

    return wandb.init(**wandb_init_args(project, run_dir, config, name, group, resume))
