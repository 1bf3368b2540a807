"""FSDP2 across ranks: set-up, sharding, splitting a batch's micro-batches, gathering metrics and state.

Launch with ``torchrun --nproc-per-node N ...``; every rank builds the same model, calls
``init_distributed()``, and gets the same ``Batch``. The group has a CPU backend beside NCCL on GPUs
(``backend_for``: ``cuda:nccl,cpu:gloo``), so that parameters offloaded to the host (``CPUOffloadPolicy``) can be
clipped and gathered. The trainer packs the whole batch on every rank
(deterministically), then each rank takes a share of the micro-batches (longest-processing-time first,
so tokens are balanced) and pads its list with empty micro-batches so that all ranks run the same
number of forward/backward passes (FSDP's collectives must line up). Every micro-batch loss is
normalised by the token count of the *whole* batch, and each rank back-propagates its loss times the
world size, which FSDP's mean-reduction turns back into a sum (a custom divide factor would need
``PREMUL_SUM``, which gloo lacks); so the update equals a single-process step on the same batch.

Sharding: each decoder layer (the model's ``_no_split_modules``) is one FSDP2 unit and the
``TokenLogprobs`` wrapper is the root unit (embedding, final norm, LM head; tied weights stay together).
Optional ``MixedPrecisionPolicy`` (bf16 compute, fp32 gradient reduction) and ``CPUOffloadPolicy``
(parameters, gradients and the optimizer step on the host).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from albatross.trainer.packing import MicroBatch

T = TypeVar("T")


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def init_distributed(backend: str | None = None) -> tuple[int, int]:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR/PORT); return (rank, world).

    ``backend`` defaults to nccl with CUDA, gloo otherwise. Without torchrun variables this is a no-op
    returning (0, 1).
    """
    if "WORLD_SIZE" not in os.environ or dist.is_initialized():
        return rank(), world_size()
    backend = backend or backend_for("cuda" if torch.cuda.is_available() else "cpu")
    if "nccl" in backend:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def backend_for(device_type: str) -> str:
    """The process group's backends: on GPUs NCCL for CUDA tensors and gloo for CPU ones (``cuda:nccl,cpu:gloo``),
    which FSDP2's CPU offload needs (gradient clipping and ``full_tensor`` then run on host shards); gloo on CPUs."""
    return "cuda:nccl,cpu:gloo" if device_type == "cuda" else "gloo"


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a transformers model: modules whose class is in ``_no_split_modules``."""
    names = set(getattr(model, "_no_split_modules", None) or ())  # a transformers class attribute (may be None)
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__}: no decoder layers found (_no_split_modules={names})")
    return layers


def shard(root: nn.Module, model: nn.Module, *, bf16: bool = False, offload: bool = False) -> None:
    """Apply FSDP2 ``fully_shard`` to each decoder layer of ``model`` and then to ``root``, in place."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    host = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    kwargs: dict[str, Any] = {"mp_policy": mp or MixedPrecisionPolicy(), "offload_policy": host}
    for unit in [*decoder_layers(model), root]:
        fully_shard(unit, **kwargs)


def assign(micro: Sequence[MicroBatch], world: int, me: int) -> list[MicroBatch | None]:
    """This rank's micro-batches (LPT by token count), padded with ``None`` to the longest rank's count."""
    loads = [0] * world
    owned: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(micro)), key=lambda i: -micro[i].num_tokens):
        r = min(range(world), key=lambda r: (loads[r], r))
        owned[r].append(i)
        loads[r] += micro[i].num_tokens
    count = max((len(o) for o in owned), default=0)
    mine: list[MicroBatch | None] = [micro[i] for i in sorted(owned[me])]
    return mine + [None] * (count - len(mine))


def gather(obj: T) -> list[T]:
    """``obj`` from every rank, in rank order (just ``[obj]`` in a single process)."""
    if not is_distributed():
        return [obj]
    out: list[T] = [obj] * dist.get_world_size()  # every entry is overwritten
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (``obj`` itself in a single process)."""
    if not is_distributed():
        return obj
    box = [obj if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def leave() -> None:
    """Leave the process group, if this process joined one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A sharded DTensor gathered into a plain tensor (a collective: every rank must call it)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # torch's DTensor; a plain tensor has none
