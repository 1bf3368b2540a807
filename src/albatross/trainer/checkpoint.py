"""Weight export for the engines and trainer state for resume, both written atomically.

Layout under ``out_root``::

    v000007/model.safetensors   weights of policy version 7 (tied tensors stored once)
    v000007/config.json
    LATEST                      "7": the newest complete version

A version directory is written under a temporary name, fsynced and renamed into place, and only then is
``LATEST`` replaced (tmp file + rename), so a reader that follows ``LATEST`` never sees a partial export.
Only the newest ``keep`` versions are kept.

Under FSDP2 every rank calls ``export_weights`` and ``save_state`` (gathering the shards is a
collective); only rank 0 writes. Trainer state is stored as full (unsharded) tensors keyed by parameter
name, so a checkpoint saved with any number of ranks resumes with any other.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from albatross.trainer.distributed import barrier, full_tensor, rank

WEIGHTS_NAME = "model.safetensors"
LATEST_NAME = "LATEST"


def version_dir(out_root: str | Path, version: int) -> Path:
    return Path(out_root) / f"v{version:06d}"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for p in root.iterdir():
        if p.is_file():
            _fsync_path(p)
    _fsync_path(root)


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(path.parent)


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor shard shares storage like its param
    return local.untyped_storage().data_ptr(), local.storage_offset()


def unique_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """State dict with tied tensors stored once, under the first name (e.g. the input embedding).

    Sharded (FSDP2) tensors are gathered in full, so every rank must call this.
    """
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for name, t in model.state_dict().items():
        key = _storage_key(t)
        if key in seen:
            continue
        seen.add(key)
        out[name] = full_tensor(t.detach()).contiguous().cpu()
    return out


def export_weights(model: nn.Module, out_root: str | Path, version: int, keep: int = 3) -> Path:
    """Write version ``version`` atomically, point LATEST at it, prune to the newest ``keep``; return its dir."""
    root = Path(out_root)
    final = version_dir(root, version)
    state = unique_state_dict(model)
    if rank() != 0:
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(state, str(tmp / WEIGHTS_NAME), metadata={"format": "pt", "version": str(version)})
    config = getattr(model, "config", None)
    if config is not None:
        config.save_pretrained(tmp)
    _fsync_tree(tmp)
    if final.exists():  # re-export of the same version after a resume
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_path(root)
    _write_text_atomic(root / LATEST_NAME, f"{version}\n")
    prune_versions(root, keep)
    return final


def exported_versions(out_root: str | Path) -> list[int]:
    """Versions with a complete directory under ``out_root``, oldest first."""
    root = Path(out_root)
    if not root.is_dir():
        return []
    names = (p.name for p in root.iterdir() if p.is_dir() and p.name.startswith("v"))
    return sorted(int(n[1:]) for n in names if n[1:].isdigit())


def prune_versions(out_root: str | Path, keep: int) -> None:
    """Delete all but the newest ``keep`` versions (never the one LATEST points to)."""
    latest = latest_version(out_root)
    for v in exported_versions(out_root)[: -max(keep, 1)]:
        if v != latest:
            shutil.rmtree(version_dir(out_root, v), ignore_errors=True)


def latest_version(out_root: str | Path) -> int | None:
    """The version LATEST points to, or None if there is none yet."""
    try:
        return int((Path(out_root) / LATEST_NAME).read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def load_weights(model: nn.Module, path: str | Path) -> None:
    """Load an exported ``model.safetensors`` (or its version dir) into ``model``; tied tensors fill in."""
    path = Path(path)
    if path.is_dir():
        path = path / WEIGHTS_NAME
    state = load_file(str(path))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(model.state_dict()) - set(unique_state_dict(model))
    really_missing = sorted(set(missing) - tied)
    if unexpected or really_missing:
        raise ValueError(f"{path}: missing keys {really_missing}, unexpected keys {sorted(unexpected)}")


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full state dict of ``model`` on the CPU (gathered from the shards under FSDP2; rank 0 gets it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def optimizer_state(model: nn.Module, optimizer: Any) -> dict[str, Any]:
    """Optimizer state keyed by parameter name (a ``torch.optim`` optimizer) or its own ``state_dict()``."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    if not isinstance(optimizer, torch.optim.Optimizer):
        return optimizer.state_dict()
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(model, optimizer, options=opts)


def load_model_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


def load_optimizer_state(model: nn.Module, optimizer: Any, state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if not isinstance(optimizer, torch.optim.Optimizer):
        optimizer.load_state_dict(state)
        return
    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def save_state(
    path: str | Path, model: nn.Module, optimizer: Any, step: int, extra: dict[str, Any]
) -> None:
    """Save model and optimizer state, the step and ``extra`` for resume (tmp file + fsync + rename).

    Every rank must call it under FSDP2; rank 0 writes.
    """
    state = {"model": model_state(model), "optimizer": optimizer_state(model, optimizer), "step": step,
             "extra": extra}
    if rank() == 0:
        write_atomic(path, state)
    barrier()


def write_atomic(path: str | Path, obj: Any) -> None:
    """``torch.save`` to a temporary file, fsync, rename into place."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(path.parent)


def load_state(
    path: str | Path, model: nn.Module, optimizer: Any | None = None
) -> tuple[int, dict[str, Any]]:
    """Restore what ``save_state`` wrote (every rank reads the file); returns ``(step, extra)``."""
    state = torch.load(Path(path), map_location="cpu", weights_only=True)
    load_model_state(model, state["model"])
    if optimizer is not None:
        load_optimizer_state(model, optimizer, state["optimizer"])
    return int(state["step"]), dict(state["extra"])
