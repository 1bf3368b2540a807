"""Rewards: calibrated partial credit, the final score, and the efficiency adjustment.

DESIGN.md: s_i = 1 if the attempt succeeded (all tests pass), else c * p_i, where p_i is the weighted
fraction of tests passed and tests that the untouched environment already passes have weight 0. With
c < 1 every success outranks every failure. For successes only, the efficiency term
lambda * (T_i - T_min) / (T_max - T_min + eps) over the group's successes is subtracted. Optional isotonic
calibration maps raw credit p_i to observed solve rates from probes (``fit_isotonic``, ``calibrate``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence


def partial_credit(metrics: dict[str, float], weights: dict[str, float] | None = None) -> float:
    """Weighted fraction of tests passed, in [0, 1].

    ``metrics`` maps test name -> result (1.0 pass, 0.0 fail; values are clipped to [0, 1]).
    ``weights`` maps test name -> weight; tests missing from it weigh 1, and the no-op gate gives
    weight 0 to tests that pass untouched. With no weighted test at all the credit is 0.
    """
    weights = weights or {}
    total = 0.0
    passed = 0.0
    for name, value in metrics.items():
        w = float(weights.get(name, 1.0))
        if w < 0:
            raise ValueError(f"test weight must be >= 0, got {w} for {name!r}")
        total += w
        passed += w * min(max(float(value), 0.0), 1.0)
    return passed / total if total > 0 else 0.0


def score(success: bool, partial: float, c: float = 0.5) -> float:
    """Final score s_i: 1 for a success, else c * partial (c < 1 keeps failures below successes)."""
    if not 0.0 <= c < 1.0:
        raise ValueError(f"partial-credit scale c must be in [0, 1), got {c}")
    return 1.0 if success else c * min(max(partial, 0.0), 1.0)


def efficiency_penalties(
    successes: Sequence[bool], tokens: Sequence[int], lam: float = 0.1, eps: float = 1e-6
) -> list[float]:
    """Per-attempt efficiency term: lam * (T_i - T_min) / (T_max - T_min + eps) for successes, 0 else.

    T_min and T_max are taken over the group's successes only.
    """
    if len(successes) != len(tokens):
        raise ValueError(f"successes ({len(successes)}) and tokens ({len(tokens)}) differ in length")
    solved = [t for t, y in zip(tokens, successes, strict=True) if y]
    if not solved:
        return [0.0] * len(tokens)
    t_min, t_max = min(solved), max(solved)
    return [
        lam * (t - t_min) / (t_max - t_min + eps) if y else 0.0
        for t, y in zip(tokens, successes, strict=True)
    ]


def efficiency_adjust(
    scores: Sequence[float],
    successes: Sequence[bool],
    tokens: Sequence[int],
    lam: float = 0.1,
    eps: float = 1e-6,
) -> tuple[list[float], dict[str, float]]:
    """Subtract the efficiency term from the scores of successes; failures are unchanged."""
    if len(scores) != len(successes):
        raise ValueError(f"scores ({len(scores)}) and successes ({len(successes)}) differ in length")
    penalties = efficiency_penalties(successes, tokens, lam, eps)
    adjusted = [s - p for s, p in zip(scores, penalties, strict=True)]
    n_solved = sum(1 for y in successes if y)
    metrics = {
        "efficiency/successes": float(n_solved),
        "efficiency/mean_penalty": sum(penalties) / n_solved if n_solved else 0.0,
        "efficiency/max_penalty": max(penalties, default=0.0),
    }
    return adjusted, metrics


def fit_isotonic(
    xs: Sequence[float], ys: Sequence[float], weights: Sequence[float] | None = None
) -> list[tuple[float, float]]:
    """Non-decreasing least-squares fit of ``ys`` on ``xs`` (pool adjacent violators); returns knots (x, y).

    For calibrating partial credit: ``xs`` raw credits p_i seen in probes, ``ys`` whether the task was
    then solved (or its observed solve rate). Equal x values are pooled first; knots are sorted by x.
    """
    if not (len(xs) == len(ys) and (weights is None or len(weights) == len(xs))):
        raise ValueError("xs, ys and weights differ in length")
    if not xs:
        raise ValueError("isotonic fit needs at least one point")
    pooled: dict[float, list[float]] = {}
    for x, y, w in zip(xs, ys, weights or [1.0] * len(xs), strict=True):
        acc = pooled.setdefault(float(x), [0.0, 0.0])
        acc[0] += w * y
        acc[1] += w
    blocks: list[list[float]] = []  # [first x, last x, weighted sum, weight]
    for x in sorted(pooled):
        blocks.append([x, x, *pooled[x]])
        while len(blocks) > 1 and blocks[-2][2] / blocks[-2][3] > blocks[-1][2] / blocks[-1][3]:
            _, hi, total, weight = blocks.pop()
            blocks[-1][1:] = [hi, blocks[-1][2] + total, blocks[-1][3] + weight]
    knots = []
    for lo, hi, total, weight in blocks:
        knots += [(lo, total / weight)] + ([(hi, total / weight)] if hi != lo else [])
    return knots


def calibrate(p: float, knots: Sequence[tuple[float, float]]) -> float:
    """Calibrated credit: ``knots`` from ``fit_isotonic`` interpolated linearly, constant beyond the ends."""
    if p <= knots[0][0]:
        return knots[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(knots):
        if p <= x1:
            return y0 + (y1 - y0) * (p - x0) / (x1 - x0)
    return knots[-1][1]
