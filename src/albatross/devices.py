"""Where the trainer and the built-in engine run: ``trainer.device`` / ``engine.device`` resolved once.

``auto`` means CUDA when torch sees a GPU: trainer rank r on ``cuda:r``; the built-in engine on the first GPU the
trainer does not hold (``cuda:<trainer.gpus>``), or on the last GPU when the trainer holds them all. On a machine
without CUDA everything runs on the CPU. Asking for ``cuda`` without one is an error, not a silent fallback.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from albatross.errors import UserError

if TYPE_CHECKING:  # annotations only: torch is imported when a device is resolved
    import torch


def _cuda_count(setting: str, field: str) -> int:
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if setting == "cuda" and n == 0:
        raise UserError(f"{field} = \"cuda\" but torch sees no CUDA device")
    return n if setting in ("auto", "cuda") else 0


def trainer_device(setting: str, rank: int = 0) -> torch.device:
    """The device of trainer rank ``rank``."""
    import torch

    n = _cuda_count(setting, "trainer.device")
    if not n:
        return torch.device("cpu")
    if rank >= n:
        raise UserError(f"trainer.gpus asks for rank {rank} but torch sees {n} CUDA device(s)")
    return torch.device("cuda", rank)


def engine_device(setting: str, trainer_gpus: int) -> torch.device:
    """The device of the built-in engine, next to a trainer holding ``trainer_gpus`` GPUs."""
    import torch

    n = _cuda_count(setting, "engine.device")
    if not n:
        return torch.device("cpu")
    return torch.device("cuda", min(trainer_gpus, n - 1))
