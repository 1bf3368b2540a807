"""Where a run's metrics go: JSONL in the run directory, TensorBoard, optional W&B, and the console.

The console view is a live status line on a terminal and plain lines otherwise (CI, pipes, files).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from albatross.records import append_jsonl


class MetricsSink:
    def __init__(self, run_dir: Path, max_steps: int, log: Callable[[str], None] = print,
                 wandb_project: str = "", config: dict[str, Any] | None = None) -> None:
        self.run_dir, self.max_steps, self.log = run_dir, max_steps, log
        self.live = sys.stdout.isatty()
        self._tb = _tensorboard(run_dir / "tb")
        self._wandb = _wandb(wandb_project, run_dir, config or {})
        self._last_status = 0.0

    def step(self, record: dict[str, Any]) -> None:
        append_jsonl(self.run_dir / "metrics.jsonl", record)
        step = int(record["step"])
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key not in ("step", "time"):
                    self._tb.add_scalar(key.replace("/", "_"), value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(record, step=step)
        if self.live:
            sys.stdout.write("\r\033[K")
        self.log(step_line(record, self.max_steps))

    def status(self, fields: dict[str, Any]) -> None:
        """A live one-line view, refreshed at most once a second, only on a terminal."""
        now = time.monotonic()
        if not self.live or now - self._last_status < 1.0:
            return
        self._last_status = now
        text = "  ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in fields.items())
        sys.stdout.write("\r\033[K" + text[:200])
        sys.stdout.flush()

    def close(self) -> None:
        if self.live:
            sys.stdout.write("\r\033[K")
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


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


def _tensorboard(path: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard not installed: JSONL and console only
        return None
    return SummaryWriter(str(path))


def _wandb(project: str, run_dir: Path, config: dict[str, Any]):
    if not project:
        return None
    try:
        import wandb
    except ImportError:
        print("[metrics] orchestrator.wandb_project is set but wandb is not installed; skipping W&B",
              file=sys.stderr)
        return None
    return wandb.init(project=project, dir=str(run_dir), config=config, name=run_dir.name)
