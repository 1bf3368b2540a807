"""Group advantages: ``grpo``, ``rloo`` and ``topk`` centering, with the recipe's shared knobs.

Every function takes a group's scores s_i and successes y_i and returns ``(advantages, metrics)``:
1. a baseline is subtracted (the variant), optionally divided by the group's score std
   (population std, plus ``STD_EPS``);
2. the success offset delta * (y_i - mean y) is added;
3. with ``cap_failures`` a failure's advantage is capped at 0.
The variant is picked once at start-up with ``get_advantage_fn(name, **knobs)``.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Protocol

STD_EPS = 1e-6
ZERO_SIGNAL_TOL = 1e-9


class AdvantageFn(Protocol):
    def __call__(
        self, scores: Sequence[float], successes: Sequence[bool]
    ) -> tuple[list[float], dict[str, float]]: ...


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _std(xs: Sequence[float]) -> float:
    m = _mean(xs)
    return math.sqrt(_mean([(x - m) ** 2 for x in xs]))


def _check(scores: Sequence[float], successes: Sequence[bool]) -> None:
    if len(scores) != len(successes):
        raise ValueError(f"scores ({len(scores)}) and successes ({len(successes)}) differ in length")
    if not scores:
        raise ValueError("empty group")


def _finish(
    base: list[float],
    scores: Sequence[float],
    successes: Sequence[bool],
    std_normalize: bool,
    success_offset: float,
    cap_failures: bool,
) -> tuple[list[float], dict[str, float]]:
    """Apply the shared knobs (std normalisation, success offset, failure cap) to centred scores."""
    if std_normalize:
        std = _std(scores)
        base = [a / (std + STD_EPS) for a in base]
    y_mean = _mean([float(y) for y in successes])
    adv = [a + success_offset * (float(y) - y_mean) for a, y in zip(base, successes, strict=True)]
    capped = 0
    if cap_failures:
        capped = sum(1 for a, y in zip(adv, successes, strict=True) if not y and a > 0)
        adv = [a if y else min(a, 0.0) for a, y in zip(adv, successes, strict=True)]
    metrics = {
        "adv/mean": _mean(adv),
        "adv/std": _std(adv),
        "adv/min": min(adv),
        "adv/max": max(adv),
        "adv/capped_failures": float(capped),
        "adv/zero_signal": float(is_zero_signal(scores, successes)),
    }
    return adv, metrics


def grpo(
    scores: Sequence[float],
    successes: Sequence[bool],
    *,
    std_normalize: bool = False,
    success_offset: float = 0.0,
    cap_failures: bool = False,
) -> tuple[list[float], dict[str, float]]:
    """A_i = s_i - mean(s)."""
    _check(scores, successes)
    m = _mean(scores)
    return _finish([s - m for s in scores], scores, successes, std_normalize, success_offset, cap_failures)


def rloo(
    scores: Sequence[float],
    successes: Sequence[bool],
    *,
    std_normalize: bool = False,
    success_offset: float = 0.0,
    cap_failures: bool = False,
) -> tuple[list[float], dict[str, float]]:
    """Leave-one-out: A_i = s_i - mean of the other attempts' scores (0 for a group of one)."""
    _check(scores, successes)
    g, total = len(scores), sum(scores)
    base = [s - (total - s) / (g - 1) if g > 1 else 0.0 for s in scores]
    return _finish(base, scores, successes, std_normalize, success_offset, cap_failures)


def topk(
    scores: Sequence[float],
    successes: Sequence[bool],
    *,
    k: int = 4,
    std_normalize: bool = False,
    success_offset: float = 0.0,
    cap_failures: bool = False,
) -> tuple[list[float], dict[str, float]]:
    """Top-k centering: A_i = s_i - mean of the k highest scores among the other attempts.

    k is capped at G - 1; a group of one gets advantage 0.
    """
    _check(scores, successes)
    if k < 1:
        raise ValueError(f"topk needs k >= 1, got {k}")
    base = []
    for i, s in enumerate(scores):
        others = sorted((x for j, x in enumerate(scores) if j != i), reverse=True)[:k]
        base.append(s - _mean(others) if others else 0.0)
    return _finish(base, scores, successes, std_normalize, success_offset, cap_failures)


def is_zero_signal(scores: Sequence[float], successes: Sequence[bool]) -> bool:
    """True when all outcomes and all scores of the group are equal: it carries no signal."""
    if not scores:
        return True
    same_outcome = all(bool(y) == bool(successes[0]) for y in successes)
    return same_outcome and max(scores) - min(scores) <= ZERO_SIGNAL_TOL


ADVANTAGES: dict[str, Callable[..., tuple[list[float], dict[str, float]]]] = {
    "grpo": grpo,
    "rloo": rloo,
    "topk": topk,
}


def get_advantage_fn(name: str, **knobs: object) -> AdvantageFn:
    """The advantage variant ``name`` with its knobs bound; bad names or knobs fail here, at start-up."""
    if name not in ADVANTAGES:
        raise ValueError(f"unknown advantage {name!r}; choose one of {sorted(ADVANTAGES)}")
    fn = ADVANTAGES[name]
    try:
        inspect.signature(fn).bind_partial(**knobs)
    except TypeError as e:
        raise ValueError(f"advantage {name!r}: {e}") from None
    return functools.partial(fn, **knobs)
