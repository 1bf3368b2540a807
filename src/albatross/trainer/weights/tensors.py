"""The tensors a weight transport moves: which names, in which dtype, in buckets of bounded bytes.

Every trainer rank builds the same ``plan`` from the model's state dict (global shapes, no data moved), then
``gather``s one bucket at a time: each parameter's FSDP2 shards are cast to the transfer dtype *before* the
all-gather (a bf16 gather moves half the bytes of an fp32 one), and at most one bucket of full tensors exists at
once. No rank ever holds a full copy of the model, in fp32 or otherwise.

``names``: ``"served"`` is every name of the state dict, tied ones included (vLLM holds a separate ``lm_head``
after an in-place reload even when the checkpoint ties it); ``"unique"`` stores tied tensors once, under their
first name (SGLang ties ``lm_head`` to the embedding module and skips ``lm_head.weight`` when loading).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch
    from torch import nn

Names = Literal["served", "unique"]
DTYPE_NAMES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16",
               "half": "float16"}


@dataclass(frozen=True)
class TensorMeta:
    """One tensor as it travels: its name, the state-dict key it is read from (a tied alias reads its first
    name), global shape, transfer dtype name (``bfloat16``)."""

    name: str
    source: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        import torch

        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


def declared_dtype(model_dir: str | Path | None) -> str:
    """The dtype a checkpoint directory declares (``config.json`` ``dtype`` or ``torch_dtype``), ``float32`` when
    it declares none: the dtype exported weight versions and ``<out>/final`` are written in."""
    path = Path(model_dir) / "config.json" if model_dir else None
    try:
        config = json.loads(path.read_text()) if path is not None else {}
    except (OSError, ValueError):
        config = {}
    text = config.get("dtype") or config.get("torch_dtype") or config.get("text_config", {}).get("dtype")
    return DTYPE_NAMES.get(str(text or "float32").replace("torch.", ""), "float32")


def transfer_dtype(engine_dtype: str, model_dir: str | Path | None) -> str:
    """The dtype weights travel in to a server: ``engine.dtype`` when set, else the checkpoint's own."""
    return DTYPE_NAMES.get(engine_dtype, declared_dtype(model_dir))


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor shard shares storage like its param
    return local.untyped_storage().data_ptr(), int(local.storage_offset())


def plan(model: nn.Module, dtype: str, names: Names = "served") -> list[TensorMeta]:
    """Every tensor to move, in state-dict order (the same on every rank: no data is read)."""
    out: list[TensorMeta] = []
    first: dict[tuple[int, int], str] = {}
    for key, t in model.state_dict().items():
        storage = _storage_key(t)
        if storage in first and names == "unique":
            continue
        source = first.setdefault(storage, key)
        wanted = dtype if t.is_floating_point() else str(t.dtype).replace("torch.", "")
        out.append(TensorMeta(key, source, tuple(t.shape), wanted))
    return out


def buckets(metas: list[TensorMeta], max_bytes: int) -> list[list[TensorMeta]]:
    """``metas`` in order, cut into runs of at most ``max_bytes`` (a bigger tensor is a bucket of its own)."""
    out: list[list[TensorMeta]] = []
    size = 0
    for m in metas:
        if not out or (size + m.nbytes > max_bytes and out[-1]):
            out.append([])
            size = 0
        out[-1].append(m)
        size += m.nbytes
    return out


def gather(model: nn.Module, bucket: list[TensorMeta],
           device: str | torch.device | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The full tensors of ``bucket`` in their transfer dtype, one at a time (a collective under FSDP2: every rank
    iterates it to the end); on ``device`` when given, else where the parameter lives. A tied alias reuses the
    tensor gathered for its first name in the same bucket."""
    import torch

    state = model.state_dict()
    done: dict[str, torch.Tensor] = {}
    for m in bucket:
        if m.source in done:
            yield m.name, done[m.source]
            continue
        t = state[m.source].detach()
        t = t.to(getattr(torch, m.dtype))  # cast the shard, then gather: fewer bytes on the wire
        full = t.full_tensor() if hasattr(t, "full_tensor") else t  # a DTensor shard (FSDP2) or a plain tensor
        full = (full.to(device) if device is not None else full).contiguous()
        done[m.name] = full
        yield m.name, full
