"""The trainer's end of the weight group: rank 0, broadcasting each tensor to the servers' workers.

``NcclUid`` (vLLM on CUDA): vLLM's documented path for a trainer that does not import vLLM. The trainer mints an
``ncclUniqueId`` and sends it base64-encoded as ``nccl_unique_id_b64`` in ``init_info``; every worker calls
``ncclCommInitRank`` with it and then a one-element float32 ``all_reduce`` (its warm-up handshake), which the
trainer matches before any broadcast (``vllm/distributed/weight_transfer/nccl_common.py`` and
``device_communicators/pynccl.py``). NCCL is reached through ``ctypes`` on the ``libnccl.so.2`` that CUDA builds of
torch ship, so nothing beyond torch is needed in the trainer's environment.

``TorchGroup`` (SGLang, and the gloo stand-ins of the tests): a standalone torch process group over a TCP
rendezvous, the same ``PrefixStore`` that SGLang's ``init_custom_process_group`` uses on the other ranks.
"""

from __future__ import annotations

import base64
import ctypes
import os
import socket
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from albatross.engine.base import EngineError

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

GROUP = "albatross_weights"
TIMEOUT = timedelta(minutes=30)
NCCL_DTYPES = {"int8": 0, "uint8": 1, "int32": 2, "int64": 4, "float16": 6, "float32": 7, "float64": 8,
               "bfloat16": 9}  # ncclDataType_t
NCCL_SUM = 0  # ncclRedOp_t


class Communicator(Protocol):
    """Rank 0 of a weight group: ``rendezvous()`` is what the servers need to join, ``open`` joins (blocking until
    every rank has), ``broadcast`` sends one tensor, ``sync`` waits until the broadcasts sent so far are done."""

    def rendezvous(self) -> dict[str, Any]: ...

    def open(self, world: int) -> None: ...

    def broadcast(self, tensor: torch.Tensor) -> None: ...

    def sync(self) -> None: ...

    def close(self) -> None: ...


def master_address(urls: list[str]) -> str:
    """The address the servers reach this trainer at: loopback when they all run here."""
    from urllib.parse import urlparse

    if all(urlparse(u).hostname in ("127.0.0.1", "localhost", "::1") for u in urls):
        return "127.0.0.1"
    return socket.gethostbyname(socket.gethostname())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class TorchGroup:
    """A torch process group (``nccl`` or ``gloo``) named ``GROUP``, outside the trainer's default group."""

    def __init__(self, address: str, backend: str = "nccl", device: str = "cuda") -> None:
        self.address, self.port, self.backend, self.device = address, free_port(), backend, device
        self.group: ProcessGroup | None = None

    def rendezvous(self) -> dict[str, Any]:
        return {"master_address": self.address, "master_port": self.port, "backend": self.backend}

    def open(self, world: int) -> None:
        from torch.distributed import distributed_c10d as c10d
        from torch.distributed.rendezvous import rendezvous

        store, rank, world = next(rendezvous(f"tcp://{self.address}:{self.port}", 0, world, timeout=TIMEOUT))
        store.set_timeout(TIMEOUT)
        self.group, _ = c10d._new_process_group_helper(world, rank, [], self.backend, c10d.PrefixStore(GROUP, store),
                                                       group_name=c10d.GroupName(GROUP), timeout=TIMEOUT)
        c10d._world.pg_group_ranks[self.group] = {i: i for i in range(world)}

    def broadcast(self, tensor: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.broadcast(tensor.to(self.device), src=0, group=self.group)

    def sync(self) -> None:
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()

    def close(self) -> None:
        if self.group is not None:
            import torch.distributed as dist

            dist.destroy_process_group(self.group)
            self.group = None


def nccl_library_path() -> str:
    """``$ALBATROSS_NCCL_SO``, else the ``nvidia-nccl`` wheel's library next to torch, else ``libnccl.so.2``."""
    explicit = os.environ.get("ALBATROSS_NCCL_SO")
    if explicit:
        return explicit
    try:
        import nvidia.nccl  # type: ignore[import-not-found]  # shipped with CUDA builds of torch

        for root in nvidia.nccl.__path__:
            lib = Path(root) / "lib" / "libnccl.so.2"
            if lib.is_file():
                return str(lib)
    except ImportError:
        pass
    return "libnccl.so.2"


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * 128)]


class NcclLibrary:
    """The five NCCL calls the sender needs, through ``ctypes``."""

    def __init__(self, path: str | None = None) -> None:
        try:
            self.lib = ctypes.CDLL(path or nccl_library_path())
        except OSError as e:
            raise EngineError(f"engine.weight_sync nccl: cannot load the NCCL library ({e}); set "
                              "ALBATROSS_NCCL_SO to libnccl.so.2") from None
        p, i, size = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        self._sig("ncclGetErrorString", ctypes.c_char_p, [i])
        self._sig("ncclGetUniqueId", i, [ctypes.POINTER(_UniqueId)])
        self._sig("ncclCommInitRank", i, [ctypes.POINTER(p), i, _UniqueId, i])
        self._sig("ncclAllReduce", i, [p, p, size, i, i, p, p])
        self._sig("ncclBroadcast", i, [p, p, size, i, i, p, p])
        self._sig("ncclCommDestroy", i, [p])

    def _sig(self, name: str, restype: Any, argtypes: list[Any]) -> None:
        fn = getattr(self.lib, name)
        fn.restype, fn.argtypes = restype, argtypes

    def check(self, result: int, what: str) -> None:
        if result != 0:
            raise EngineError(f"NCCL {what} failed: {self.lib.ncclGetErrorString(result).decode()}")

    def unique_id(self) -> bytes:
        uid = _UniqueId()
        self.check(self.lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return bytes(ctypes.string_at(ctypes.addressof(uid), 128))

    def init_rank(self, world: int, uid: bytes, rank: int) -> ctypes.c_void_p:
        handle = _UniqueId()
        ctypes.memmove(ctypes.addressof(handle), uid, 128)
        comm = ctypes.c_void_p()
        self.check(self.lib.ncclCommInitRank(ctypes.byref(comm), world, handle, rank), "ncclCommInitRank")
        return comm


class NcclUid:
    """Rank 0 of an NCCL communicator that vLLM's workers join by unique id."""

    def __init__(self, device: str = "cuda") -> None:
        import torch

        self.device = torch.device(device)
        self.nccl = NcclLibrary()
        self.uid = self.nccl.unique_id()
        self.comm: ctypes.c_void_p | None = None
        self._sent: list[torch.Tensor] = []

    def rendezvous(self) -> dict[str, Any]:
        return {"nccl_unique_id_b64": base64.b64encode(self.uid).decode()}

    def _stream(self) -> ctypes.c_void_p:
        import torch

        return ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)

    def open(self, world: int) -> None:
        import torch

        with torch.cuda.device(self.device):
            self.comm = self.nccl.init_rank(world, self.uid, 0)
            warm = torch.zeros(1, device=self.device)  # the workers' warm-up all_reduce, matched
            ptr = ctypes.c_void_p(warm.data_ptr())
            self.nccl.check(self.nccl.lib.ncclAllReduce(ptr, ptr, 1, NCCL_DTYPES["float32"], NCCL_SUM, self.comm,
                                                        self._stream()), "warm-up all_reduce")
            torch.cuda.current_stream(self.device).synchronize()

    def broadcast(self, tensor: torch.Tensor) -> None:
        t = tensor.to(self.device).contiguous()
        dtype = NCCL_DTYPES[str(t.dtype).replace("torch.", "")]
        ptr = ctypes.c_void_p(t.data_ptr())
        self.nccl.check(self.nccl.lib.ncclBroadcast(ptr, ptr, t.numel(), dtype, 0, self.comm, self._stream()),
                        "ncclBroadcast")
        self._sent.append(t)  # alive until the stream has sent it (``sync``)

    def sync(self) -> None:
        import torch

        torch.cuda.current_stream(self.device).synchronize()
        self._sent = []

    def close(self) -> None:
        if self.comm is not None:
            self.nccl.lib.ncclCommDestroy(self.comm)
            self.comm = None
