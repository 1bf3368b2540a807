"""The difficulty filter: keep the probed tasks whose base pass rate lies in a band (default [0.15, 0.85]).

A group of G attempts at a task with pass rate p carries no signal when every attempt succeeds or every
one fails: probability p**G + (1 - p)**G. The filter reports that expectation averaged over the tasks
before and after filtering (using the probe's pass rates and the training group size), and the fraction
of the probe's own groups that were zero-signal (as the training scorer judged them, partial credit
included) before and after.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from albatross.config import default
from albatross.tasks.probe import ProbeRow

DEFAULT_BAND = (0.15, 0.85)


@dataclass
class FilterResult:
    kept: list[ProbeRow]
    dropped: list[ProbeRow]
    low: float
    high: float
    group_size: int

    @property
    def expected_before(self) -> float:
        return expected_zero_signal(self.kept + self.dropped, self.group_size)

    @property
    def expected_after(self) -> float:
        return expected_zero_signal(self.kept, self.group_size)

    @property
    def observed_before(self) -> float:
        return observed_zero_signal(self.kept + self.dropped)

    @property
    def observed_after(self) -> float:
        return observed_zero_signal(self.kept)

    def to_dict(self) -> dict[str, Any]:
        return {"band": [self.low, self.high], "group_size": self.group_size,
                "kept": [r.task for r in self.kept], "dropped": [r.task for r in self.dropped],
                "kept_paths": [r.path for r in self.kept],
                "zero_signal_expected": {"before": round(self.expected_before, 4),
                                         "after": round(self.expected_after, 4)},
                "zero_signal_observed": {"before": round(self.observed_before, 4),
                                         "after": round(self.observed_after, 4)}}


def zero_signal_probability(pass_rate: float, group_size: int) -> float:
    """Probability that G attempts at a task with this pass rate all succeed or all fail."""
    return pass_rate**group_size + (1.0 - pass_rate) ** group_size


def expected_zero_signal(rows: list[ProbeRow], group_size: int) -> float:
    rows = [r for r in rows if r.attempts]
    if not rows:
        return 0.0
    return sum(zero_signal_probability(r.pass_rate, group_size) for r in rows) / len(rows)


def observed_zero_signal(rows: list[ProbeRow]) -> float:
    rows = [r for r in rows if r.attempts]
    return sum(r.zero_signal for r in rows) / len(rows) if rows else 0.0


def filter_rows(rows: list[ProbeRow], low: float = DEFAULT_BAND[0], high: float = DEFAULT_BAND[1],
                group_size: int = default("orchestrator", "group_size")) -> FilterResult:
    """Keep the rows with ``low <= pass rate <= high`` (tasks with no scored attempt are dropped)."""
    if not 0.0 <= low <= high <= 1.0:
        raise ValueError(f"the band must satisfy 0 <= low <= high <= 1, got [{low}, {high}]")
    if group_size < 2:
        raise ValueError(f"group size must be at least 2, got {group_size}")
    kept = [r for r in rows if r.attempts and low <= r.pass_rate <= high]
    dropped = [r for r in rows if r not in kept]
    return FilterResult(kept, dropped, low, high, group_size)


def format_report(result: FilterResult) -> str:
    lines = [f"{'task':<40}  pass_rate  kept"]
    for r in result.kept + result.dropped:
        lines.append(f"{r.task:<40}  {r.pass_rate:>9.3f}  {'yes' if r in result.kept else 'no'}")
    n_all, n_kept = len(result.kept) + len(result.dropped), len(result.kept)
    lines += [
        "",
        f"kept {n_kept} of {n_all} tasks with pass rate in [{result.low:g}, {result.high:g}]",
        f"zero-signal groups of {result.group_size} expected: {result.expected_before:.1%} before, "
        f"{result.expected_after:.1%} after; observed in the probe: {result.observed_before:.1%} before, "
        f"{result.observed_after:.1%} after",
    ]
    return "\n".join(lines)
