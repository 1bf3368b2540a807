"""``filesystem``: the trainer exports safetensors to ``<weights>/v{version:06d}`` (atomically, ``LATEST`` last), in
the model's dtype and in shards written one at a time; each engine reloads that directory
(``update_weights(path, version)``): the built-in engine swaps tensors between two forward passes, vLLM reloads in
place (``collective_rpc reload_weights``, paused around it), SGLang ``/update_weights_from_disk``. Works on any
machine that shares the directory."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from albatross.trainer.weights.tensors import Names

if TYPE_CHECKING:
    from torch import nn


class FilesystemSender:
    """Export to a versioned directory; ``keep`` > 0 prunes older versions (0: the orchestrator prunes).
    ``names = "served"`` also writes tied aliases (``lm_head.weight``: vLLM's in-place reload needs it)."""

    name = "filesystem"
    exports = True

    def __init__(self, root: str | Path, keep: int = 0, rank: int = 0, dtype: str = "float32",
                 names: Names = "unique") -> None:
        self.root, self.keep, self.rank = Path(root), keep, rank
        self.dtype, self.names = dtype, names

    def send(self, model: nn.Module, version: int) -> str:
        """Every rank calls this (the gather of sharded weights is a collective); rank 0 writes."""
        from albatross.trainer.checkpoint import export_weights

        return str(export_weights(model, self.root, version, keep=self.keep or 1 << 30, dtype=self.dtype,
                                  names=self.names))

    def close(self) -> None:
        pass


class AdapterSender:
    """``[trainer.lora] serve = "adapter"``: each version is the adapter alone, in PEFT's format, written to
    ``<root>/v{version:06d}`` (atomically); vLLM loads it hot, the built-in engine merges it into its base. It
    exports no full weights (``exports`` False: the run's final merged weights are written at its end)."""

    name = "adapter"
    exports = False

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def send(self, model: nn.Module, version: int) -> str:
        """``model``: the trainer's ``export_view()`` of a LoRA model (``lora.MergedView``)."""
        from albatross.trainer.checkpoint import LATEST_NAME, version_dir, write_text_atomic
        from albatross.trainer.lora import MergedView

        if not isinstance(model, MergedView):
            raise TypeError(f"the adapter sender sends a LoRA model's adapter, got a {type(model).__name__}")
        path = model.save_adapter(version_dir(self.root, version))
        write_text_atomic(self.root / LATEST_NAME, f"{version}\n")  # a restarted engine starts from it
        return str(path)

    def close(self) -> None:
        pass
