"""Weight export for the engines and trainer state for resume, both written atomically.

Layout under ``out_root``::

    v000007/model.safetensors   weights of policy version 7, in the model's dtype (tied tensors stored once), or
    v000007/model-00001-of-00003.safetensors ... + model.safetensors.index.json   when larger than one shard
    v000007/config.json         with ``dtype`` set to the export dtype
    LATEST                      "7": the newest complete version

A version directory is written under a temporary name, fsynced and renamed into place, and only then is
``LATEST`` replaced (tmp file + rename), so a reader that follows ``LATEST`` never sees a partial export.
Only the newest ``keep`` versions are kept. Shards are gathered and written one at a time
(``trainer/weights/tensors.py``): no rank holds more than one shard of full tensors.

Trainer state (``save_state``) is a ``torch.distributed.checkpoint`` directory: the model weights in the model's
dtype, the optimizer state as it is (fp32 moments), and ``meta.pt`` (step, version, every rank's RNG state). Every
rank writes its own shards (no gather onto one rank), ``background=True`` writes them from a thread after a
synchronous copy to host memory, and a checkpoint saved with any number of ranks resumes with any other.
Resuming a bf16 model restores its fp32 master weights from the bf16 copy: the weights the engines served.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from albatross.config import default

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

from albatross.trainer.distributed import barrier, is_distributed, rank
from albatross.trainer.offload import TrainerOptimizer
from albatross.trainer.weights.tensors import Names, buckets, plan
from albatross.trainer.weights.tensors import gather as gather_tensors

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
LATEST_NAME = "LATEST"
META_NAME = "meta.pt"
SHARD_BYTES = 4 << 30  # safetensors shard size of exported versions


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


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(path.parent)


def unique_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """State dict on the CPU with tied tensors stored once, under the first name (e.g. the input embedding), in
    the parameters' own dtype. Sharded (FSDP2) tensors are gathered in full, so every rank must call this; for a
    large model prefer ``export_weights``, which never holds more than one shard."""
    metas = plan(model, "float32", "unique")
    out = {}
    for m in metas:
        t = model.state_dict()[m.source].detach()
        full = t.full_tensor() if hasattr(t, "full_tensor") else t  # a DTensor shard (FSDP2) or a plain tensor
        out[m.name] = full.contiguous().cpu()
    return out


def shard_names(count: int) -> list[str]:
    """File names of ``count`` safetensors shards, as transformers names them."""
    if count == 1:
        return [WEIGHTS_NAME]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def write_weights(model: nn.Module, directory: Path | None, dtype: str = "float32", names: Names = "unique",
                  shard_bytes: int = SHARD_BYTES, metadata: dict[str, str] | None = None) -> int:
    """Write ``model``'s weights in ``dtype`` as (sharded) safetensors into ``directory`` (rank 0; other ranks pass
    anything and only take part in the gathers). Returns the bytes written."""
    from safetensors.torch import save_file

    shards = buckets(plan(model, dtype, names), shard_bytes)
    files = shard_names(len(shards))
    weight_map, total = {}, 0
    for shard, file in zip(shards, files, strict=True):
        tensors: dict[str, torch.Tensor] = {}
        for name, t in gather_tensors(model, shard, device="cpu"):
            # safetensors refuses two names on one storage (a tied alias): the alias gets its own copy
            tensors[name] = t.clone() if any(t is v for v in tensors.values()) else t
        if rank() == 0 and directory is not None:
            save_file(tensors, str(directory / file), metadata={"format": "pt", **(metadata or {})})
            weight_map.update(dict.fromkeys(tensors, file))
            total += sum(t.numel() * t.element_size() for t in tensors.values())
    if rank() == 0 and directory is not None and len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return total


def _write_config(model: nn.Module, directory: Path, dtype: str) -> None:
    """The model's ``config.json``, declaring ``dtype`` (the dtype its weights were written in)."""
    config = getattr(model, "config", None)  # a transformers model's (or MergedView's); a bare torch module has none
    if config is None:
        return
    config.save_pretrained(directory)
    path = directory / "config.json"
    data = json.loads(path.read_text())
    data["dtype"] = dtype
    if "torch_dtype" in data:
        data["torch_dtype"] = dtype
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def export_weights(model: nn.Module, out_root: str | Path, version: int,
                   keep: int = default("trainer", "keep_versions"), dtype: str = "float32", names: Names = "unique",
                   shard_bytes: int = SHARD_BYTES) -> Path:
    """Write version ``version`` in ``dtype`` atomically, point LATEST at it, prune to the newest ``keep``; return
    its dir. Every rank calls it (the gathers are collectives); rank 0 writes. ``names``: ``"served"`` also writes
    tied aliases (``lm_head.weight``), which vLLM's in-place reload needs."""
    root = Path(out_root)
    final = version_dir(root, version)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    if rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    write_weights(model, tmp, dtype, names, shard_bytes, {"version": str(version)})
    if rank() != 0:
        return final
    _write_config(model, tmp, dtype)
    _fsync_tree(tmp)
    if final.exists():  # re-export of the same version after a resume
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_path(root)
    write_text_atomic(root / LATEST_NAME, f"{version}\n")
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
    """Load an exported version (its directory, sharded or not, or one safetensors file) into ``model``, cast to
    the parameters' dtype; tied tensors fill in."""
    from safetensors.torch import load_file

    path = Path(path)
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(model.state_dict()) - {m.name for m in plan(model, "float32", "unique")}
    really_missing = sorted(set(missing) - tied)
    if unexpected or really_missing:
        raise ValueError(f"{path}: missing keys {really_missing}, unexpected keys {sorted(unexpected)}")


# ---------------------------------------------------------------------------------------------- trainer state


def _model_sd(model: nn.Module, dtype: str) -> dict[str, Any]:
    """The model's (sharded) state dict, floating tensors cast to ``dtype``."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    want = getattr(torch, dtype)  # "float32" -> torch.float32
    return {k: v.detach().to(want) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
            for k, v in get_model_state_dict(model).items()}


def _optim_sd(model: nn.Module, optimizer: TrainerOptimizer) -> dict[str, Any]:
    """Optimizer state keyed by parameter name (a ``torch.optim`` optimizer, sharded under FSDP2) or its own
    ``state_dict()`` (``HostOffloadAdamW``); state that does not exist yet is created (zeros) first."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    if not isinstance(optimizer, torch.optim.Optimizer):
        optimizer.init_state()
        return optimizer.state_dict()
    return get_optimizer_state_dict(model, optimizer)


_GROUP: list[ProcessGroup] = []


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence DCP's warning that a single process saves without a process group (that is the intent)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _checkpoint_group() -> ProcessGroup | None:
    """A gloo group of every rank for background writes (kept apart from the training collectives); None in a
    single process. Created by every rank at its first checkpoint."""
    if not is_distributed():
        return None
    if not _GROUP:
        import torch.distributed as dist

        _GROUP.append(dist.new_group(backend="gloo"))
    return _GROUP[0]


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _finish(tmp: Path, final: Path, private: bool = False) -> int:
    """Rank 0 (every rank with ``private`` directories), once every rank's part is on disk: fsync, rename into
    place; the checkpoint's bytes."""
    if rank() == 0 or private:
        _fsync_tree(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
        _fsync_path(final.parent)
        return _tree_bytes(final)
    return 0


def save_state(path: str | Path, model: nn.Module, optimizer: TrainerOptimizer, step: int, extra: dict[str, Any],
               dtype: str = "float32", background: bool = False, private: bool = False) -> Future[int]:
    """Save model (in ``dtype``) and optimizer state, the step and ``extra`` for resume, as a directory at
    ``path`` written under a temporary name and renamed when complete. Every rank calls it. ``background``: the
    state is copied to host memory now and written from a thread. ``private``: each rank's ``path`` is its own
    directory (ranks on machines that share no filesystem): each writes its part there and renames it itself; the
    union of the ranks' directories is the checkpoint. Returns a future of the bytes written (rank 0; 0 elsewhere
    unless ``private``), already done when not in the background."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse, async_save, save

    final = Path(path)
    tmp = final.with_name(f".{final.name}.tmp")
    state = {"model": _model_sd(model, dtype), "optim": _optim_sd(model, optimizer)}
    if rank() == 0 or private:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if rank() == 0:
        torch.save({"step": step, "extra": extra, "dtype": dtype}, tmp / META_NAME)
    barrier()
    group = _checkpoint_group()
    done: Future[int] = Future()
    if not background:
        with _quiet():
            save(state, checkpoint_id=str(tmp), process_group=group)
        done.set_result(_finish(tmp, final, private))
        return done
    with _quiet():
        started = async_save(state, checkpoint_id=str(tmp), process_group=group)
    # a plain Future of the write (an AsyncSaveResponse only with a stager of its own, which this passes none of)
    upload = started.upload_completion if isinstance(started, AsyncSaveResponse) else started

    def finished(f: Future[Any]) -> None:
        try:
            f.result()
            done.set_result(_finish(tmp, final, private))
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the checkpoint
            done.set_exception(e)

    upload.add_done_callback(finished)
    return done


def load_state(path: str | Path, model: nn.Module,
               optimizer: TrainerOptimizer | None = None) -> tuple[int, dict[str, Any]]:
    """Restore what ``save_state`` wrote (every rank reads its part); returns ``(step, extra)``."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    path = Path(path)
    meta = torch.load(path / META_NAME, map_location="cpu", weights_only=True)
    state: dict[str, Any] = {"model": _model_sd(model, meta["dtype"])}
    if optimizer is not None:
        state["optim"] = _optim_sd(model, optimizer)
    with _quiet():
        load(state, checkpoint_id=str(path), process_group=_checkpoint_group())
    set_model_state_dict(model, state["model"])
    if optimizer is not None and isinstance(optimizer, torch.optim.Optimizer):
        set_optimizer_state_dict(model, optimizer, state["optim"])
    elif optimizer is not None:
        optimizer.load_state_dict(state["optim"])
    return int(meta["step"]), dict(meta["extra"])


class Checkpointer:
    """When to checkpoint (every ``every_steps`` steps or ``every_minutes`` minutes, whichever is due first; 0
    turns either off) and the writes in flight. Rank 0's clock decides, so every rank agrees."""

    def __init__(self, every_steps: int, every_minutes: float) -> None:
        self.every_steps, self.every_minutes = every_steps, every_minutes
        self.last_step, self.last_time = 0, time.monotonic()
        self.pending: list[Future[int]] = []
        self.reports: list[Future[None]] = []  # each done once its write's ``checkpoint_done`` message is sent

    def due(self, step: int) -> bool:
        from albatross.trainer.distributed import broadcast_object

        by_steps = self.every_steps > 0 and step - self.last_step >= self.every_steps
        by_time = self.every_minutes > 0 and time.monotonic() - self.last_time >= self.every_minutes * 60
        return bool(broadcast_object(by_steps or by_time))

    def started(self, step: int, write: Future[int]) -> None:
        self.last_step, self.last_time = step, time.monotonic()
        self.pending = [f for f in self.pending if not f.done()] + [write]

    def reporting(self, write: Future[int], report: Callable[[Future[int]], None]) -> None:
        """Call ``report(write)`` once ``write`` is done; :meth:`wait` also waits for the report, so a message
        sent after it (the run's last) follows every checkpoint's."""
        sent: Future[None] = Future()

        def run(f: Future[int]) -> None:
            try:
                report(f)
            finally:
                sent.set_result(None)

        self.reports = [r for r in self.reports if not r.done()] + [sent]
        write.add_done_callback(run)

    def wait(self) -> None:
        """Until every write in flight is on disk and reported (their errors are the callers' to report)."""
        for f in self.pending:
            f.exception()
        for r in self.reports:
            r.result()
        self.pending, self.reports = [], []

