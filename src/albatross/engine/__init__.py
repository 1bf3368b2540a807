"""Engines: token-in/token-out generation with per-token log-probs and policy versions.

``BuiltinEngine`` is imported lazily so that importing this package does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from albatross.engine.base import Completion, Engine, SamplingParams

if TYPE_CHECKING:
    from albatross.engine.builtin import BuiltinEngine

__all__ = ["BuiltinEngine", "Completion", "Engine", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "BuiltinEngine":
        from albatross.engine.builtin import BuiltinEngine

        return BuiltinEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
