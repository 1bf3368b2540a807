"""The one confidence interval of Pass@1 that every figure of albatross uses (summary.json, `albatross eval`, the
report, the printed tables).

Pass@1 is the mean over tasks of each task's pass rate, the pass rate being the mean over that task's trials
(trials nested in tasks). Its uncertainty is the spread over tasks: the standard error is the sample standard
deviation of the per-task pass rates over sqrt(number of tasks), and the 95% interval is Pass@1 +/- t * s.e. with
Student's t at (tasks - 1) degrees of freedom. It says how much Pass@1 would move on another draw of tasks of the
same kind, which dominates with few tasks; trials only sharpen each task's rate. The difference of two evaluations
on the same tasks (trained - base) is paired: the same interval over the per-task differences.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

CONFIDENCE = 0.95
DEFINITION = ("95% confidence intervals over tasks (each task's pass rate is the mean over its trials; "
              "mean +/- t x standard error of the task rates; differences paired by task)")

# Student's t, two-sided 95%, by degrees of freedom (1..30); above 30 the normal 1.96 is within 4%.
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t95(df: int) -> float:
    """Two-sided 95% quantile of Student's t with ``df`` degrees of freedom."""
    if df < 1:
        return math.inf
    return _T95[df - 1] if df <= len(_T95) else 1.96 + 2.4 / df  # 1.96 + ~2.4/df matches t within 0.3% past 30


@dataclass(frozen=True)
class Interval:
    """A mean with its standard error and 95% interval over ``n`` tasks (``se`` None with fewer than 2 tasks)."""

    mean: float
    se: float | None
    n: int
    bounds: tuple[float, float] = (0.0, 1.0)  # what the quantity can be: a pass rate, or (-1, 1) a difference

    @property
    def half_width(self) -> float | None:
        return None if self.se is None else t95(self.n - 1) * self.se

    @property
    def low(self) -> float | None:
        return None if self.half_width is None else max(self.bounds[0], self.mean - self.half_width)

    @property
    def high(self) -> float | None:
        return None if self.half_width is None else min(self.bounds[1], self.mean + self.half_width)

    def covers_zero(self) -> bool:
        return self.low is None or self.low <= 0.0 <= (self.high or 0.0)

    def text(self, signed: bool = False) -> str:
        """``0.344 (95% CI 0.210 to 0.478)``."""
        mean = f"{self.mean:+.3f}" if signed else f"{self.mean:.3f}"
        if self.low is None:
            return f"{mean} (one task: no interval)"
        fmt = "{:+.3f}" if signed else "{:.3f}"
        return f"{mean} (95% CI {fmt.format(self.low)} to {fmt.format(self.high)})"

    def as_dict(self) -> dict[str, float | int | None]:
        return {"mean": _round(self.mean), "se": _round(self.se), "ci95_low": _round(self.low),
                "ci95_high": _round(self.high), "tasks": self.n}


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def task_interval(rates: list[float], bounds: tuple[float, float] = (0.0, 1.0)) -> Interval:
    """Pass@1 and its interval from per-task pass rates (each the mean over that task's trials), the interval
    clipped to ``bounds``."""
    if not rates:
        return Interval(0.0, None, 0, bounds)
    mean = sum(rates) / len(rates)
    se = statistics.stdev(rates) / math.sqrt(len(rates)) if len(rates) >= 2 else None
    return Interval(mean, se, len(rates), bounds)


def outcome_rates(outcomes: dict[str, list[bool]]) -> dict[str, float]:
    """Task id -> pass rate over its trials (tasks without a scored trial left out)."""
    return {task: sum(v) / len(v) for task, v in outcomes.items() if v}


def paired_difference(base: dict[str, float], trained: dict[str, float]) -> Interval:
    """Trained - base over the tasks both evaluated, paired by task."""
    common = sorted(set(base) & set(trained))
    return task_interval([trained[t] - base[t] for t in common], bounds=(-1.0, 1.0))


def verdict(diff: Interval) -> str:
    """A plain reading of a difference: no significant change while the interval covers 0."""
    if diff.n < 2:
        return "too few tasks to tell"
    if diff.covers_zero():
        return "no significant change"
    return "training helped" if diff.mean > 0 else "training hurt"
