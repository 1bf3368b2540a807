"""The RL recipe as pure functions (DESIGN.md, "The recipe, as implemented").

``rewards`` and ``advantages`` are plain Python (no torch), so the orchestrator can import them cheaply;
``losses`` works on torch tensors and is imported by the trainer.
"""

from albatross.rl.advantages import ADVANTAGES, get_advantage_fn, grpo, is_zero_signal, rloo, topk
from albatross.rl.rewards import (
    calibrate,
    efficiency_adjust,
    efficiency_penalties,
    fit_isotonic,
    partial_credit,
    score,
)

__all__ = [
    "ADVANTAGES",
    "calibrate",
    "efficiency_adjust",
    "efficiency_penalties",
    "fit_isotonic",
    "get_advantage_fn",
    "grpo",
    "is_zero_signal",
    "partial_credit",
    "rloo",
    "score",
    "topk",
]
