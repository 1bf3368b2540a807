"""The weight transport seam: a ``WeightSender`` on the trainer side, ``engine.update_weights`` on the other.

Every trainer rank calls ``send(model, version)`` after each optimizer step (gathering sharded weights is a
collective); rank 0 writes or broadcasts. It returns the *locator* the orchestrator hands to
``engine.update_weights(locator, version)``: a checkpoint directory (``filesystem``), or ``""`` when the weights
are already in the servers (``nccl``) and only the engine's version label moves. ``exports`` says whether a send
leaves that directory on disk (the trainer then need not write ``<out>/final`` itself).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from albatross.config import RunConfig

if TYPE_CHECKING:
    from torch import nn

ADAPTERS_DIR = "adapters"  # beside the run's ``weights``: one PEFT adapter per version (serve = "adapter")


class WeightSender(Protocol):
    name: str
    exports: bool

    def send(self, model: nn.Module, version: int) -> str:
        """Publish ``model``'s weights as ``version``; return the locator for ``engine.update_weights``."""
        ...

    def close(self) -> None: ...


def make_weight_sender(cfg: RunConfig, weights_dir: str | Path, engine_dir: str | Path, rank: int = 0,
                       model_dir: str | Path | None = None) -> WeightSender:
    """The sender of ``cfg.engine.weight_sync`` for trainer rank ``rank``: ``filesystem`` exports into
    ``weights_dir`` (``v{version:06d}``, ``LATEST``) in the dtype ``model_dir`` declares; ``nccl`` reaches the
    servers listed in ``<engine_dir>/engines.json`` (the ``run_dir`` given to ``make_engine``) and sends in the
    servers' dtype (``engine.dtype``, else the checkpoint's). vLLM is sent tied aliases too (``lm_head.weight``).
    With ``[trainer.lora] serve = "adapter"`` only the adapter goes, to ``adapters`` beside ``weights_dir``."""
    from albatross.trainer.weights.tensors import Names, declared_dtype, transfer_dtype

    names: Names = "served" if cfg.engine.type == "vllm" else "unique"
    if cfg.engine.weight_sync == "nccl":
        from albatross.engine.launch import check_engine_config
        from albatross.trainer.weights.nccl import NCCLSender

        check_engine_config(cfg.engine)
        return NCCLSender(cfg.engine.type, Path(engine_dir), rank, dtype=transfer_dtype(cfg.engine.dtype, model_dir),
                          names=names)
    from albatross.trainer.weights.filesystem import AdapterSender, FilesystemSender

    if cfg.trainer.lora.sends_adapter:
        return AdapterSender(Path(weights_dir).with_name(ADAPTERS_DIR))
    return FilesystemSender(Path(weights_dir), keep=0, rank=rank, dtype=declared_dtype(model_dir), names=names)
