"""``nccl``: broadcast from the trainer's rank 0 into the servers' weight-update group (CUDA only).

The servers are those of ``<run_dir>/engines.json`` (``engine/launch.py`` writes it, and rewrites it when a
server restarts). World: the trainer's rank 0 is NCCL rank 0, each server's workers follow it (``rank_offset``
1, 1 + the first server's world size, ...). When the set of servers changes the group is built again.

SGLang (``srt/entrypoints/http_server.py``): ``POST /init_weights_update_group`` (``master_address``,
``master_port``, ``rank_offset``, ``world_size``, ``group_name``, ``backend``) while the trainer joins the same
torch process group (TCP rendezvous); per step ``POST /update_weights_from_distributed`` (``names``, ``dtypes``,
``shapes``, ``group_name``, ``flush_cache``, ``weight_version``) while the trainer broadcasts every tensor.

vLLM 0.32 (``entrypoints/rl/online/api_router.py``, server started with ``--weight-transfer-config
'{"backend": "nccl"}'`` and ``VLLM_SERVER_DEV_MODE=1``): ``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update`` (``weight_version``). The trainer side
is vLLM's own ``NCCLTrainerWeightTransferEngine`` (its communicator is vLLM's ``PyNcclCommunicator``), so vLLM
must be importable in the trainer's environment.

Requests in flight keep running: the servers swap the weights between two forward passes, and the version they
report labels the tokens produced after it.
"""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

from albatross.engine.base import EngineError
from albatross.engine.remote import HTTPClient

GROUP = "albatross_weights"


def _master(urls: list[str]) -> tuple[str, int]:
    """The address the servers reach this trainer at (loopback when they all run here) and a free port."""
    from urllib.parse import urlparse

    local = all(urlparse(u).hostname in ("127.0.0.1", "localhost", "::1") for u in urls)
    with socket.socket() as s:
        s.bind(("", 0))
        port = int(s.getsockname()[1])
    return ("127.0.0.1" if local else socket.gethostbyname(socket.gethostname())), port


def _world_size(kind: str, url: str) -> int:
    """Ranks one server adds to the group (its tensor- x pipeline-parallel workers)."""
    client = HTTPClient(url, timeout=30, retries=2)
    if kind == "vllm":
        return int(client.call("GET", "/get_world_size")[1]["world_size"])
    info = client.call("GET", "/server_info", ok_404=True)[1]
    if not isinstance(info, dict):
        info = client.call("GET", "/get_server_info")[1]
    return int(info.get("tp_size", 1)) * int(info.get("pp_size", 1))


def _state(model: Any) -> dict[str, Any]:
    from albatross.trainer.checkpoint import unique_state_dict

    return unique_state_dict(model)  # full tensors (a collective under FSDP2), tied ones once


class NCCLSender:
    """Trainer side of the ``nccl`` transport; ranks other than 0 only take part in the gathers."""

    name = "nccl"

    def __init__(self, kind: str, run_dir: Path, rank: int = 0, backend: str = "nccl", device: str = "cuda") -> None:
        """``backend`` / ``device``: ``gloo`` / ``cpu`` let the SGLang protocol be tested without a GPU."""
        if kind not in ("vllm", "sglang"):
            raise ValueError(f"nccl weight sync needs a vllm or sglang engine, not {kind}")
        self.kind, self.run_dir, self.rank = kind, run_dir, rank
        self.backend, self.device = backend, device
        self.urls: list[str] = []
        self._group: Any = None  # torch process group (SGLang) or vLLM trainer engine

    def send(self, model: Any, version: int) -> str:
        state = _state(model)
        if self.rank != 0:
            return ""
        from albatross.engine.launch import read_endpoints

        urls = list(read_endpoints(self.run_dir).get("urls") or [])
        if not urls:
            raise EngineError(f"{self.run_dir}/engines.json names no engine servers to send weights to")
        if urls != self.urls:
            self.close()
            self._connect(urls)
        if self.kind == "sglang":
            self._send_sglang(state, version)
        else:
            self._send_vllm(state, version)
        return ""

    def _connect(self, urls: list[str]) -> None:
        sizes = [_world_size(self.kind, u) for u in urls]
        address, port = _master(urls)
        world = 1 + sum(sizes)
        offsets = [1 + sum(sizes[:i]) for i in range(len(urls))]
        if self.kind == "sglang":
            self._group = _sglang_group(urls, offsets, address, port, world, self.backend)
        else:
            self._group = _vllm_engine(urls, offsets, address, port, world)
        self.urls = urls

    def _send_sglang(self, state: dict[str, Any], version: int) -> None:
        import torch
        import torch.distributed as dist

        body = {"names": list(state), "dtypes": [str(t.dtype).split(".")[-1] for t in state.values()],
                "shapes": [list(t.shape) for t in state.values()], "group_name": GROUP, "flush_cache": True,
                "weight_version": str(version)}
        with ThreadPoolExecutor(len(self.urls)) as pool:
            futures = [pool.submit(HTTPClient(u, timeout=600, retries=0).call, "POST",
                                   "/update_weights_from_distributed", body) for u in self.urls]
            for tensor in state.values():
                dist.broadcast(tensor.to(self.device, non_blocking=True).contiguous(), src=0, group=self._group)
            if self.device == "cuda":
                torch.cuda.synchronize()
            for f in futures:
                out = f.result()[1]
                if isinstance(out, dict) and not out.get("success", True):
                    raise EngineError(f"SGLang refused the weights: {out.get('message')}")

    def _send_vllm(self, state: dict[str, Any], version: int) -> None:
        self._group.source.state = state
        self._group.client.version = str(version)
        self._group.send_weights()

    def close(self) -> None:
        if self._group is None:
            return
        if self.kind == "vllm":
            self._group.shutdown()
        else:
            import torch.distributed as dist

            dist.destroy_process_group(self._group)
        self._group, self.urls = None, []


def _sglang_group(urls: list[str], offsets: list[int], address: str, port: int, world: int,
                  backend: str) -> Any:
    """Ask every server to join the group (they block in the rendezvous) while rank 0 joins it here."""
    with ThreadPoolExecutor(len(urls)) as pool:
        futures = [pool.submit(HTTPClient(u, timeout=600, retries=0).call, "POST", "/init_weights_update_group",
                               {"master_address": address, "master_port": port, "rank_offset": off,
                                "world_size": world, "group_name": GROUP, "backend": backend})
                   for u, off in zip(urls, offsets, strict=True)]
        group = _torch_group(address, port, world, backend)
        for f in futures:
            out = f.result()[1]
            if isinstance(out, dict) and not out.get("success", True):
                raise EngineError(f"SGLang could not join the weight group: {out.get('message')}")
    return group


def _torch_group(address: str, port: int, world: int, backend: str = "nccl") -> Any:
    """Rank 0 of a standalone NCCL process group named ``GROUP``, outside the trainer's default group: the same
    TCP rendezvous and ``PrefixStore`` that SGLang's ``init_custom_process_group`` uses on the other ranks."""
    from torch.distributed import distributed_c10d as c10d

    timeout = timedelta(minutes=10)
    store, rank, world = next(c10d.rendezvous(f"tcp://{address}:{port}", 0, world, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = c10d._new_process_group_helper(world, rank, [], backend, c10d.PrefixStore(GROUP, store),
                                              group_name=GROUP, timeout=timeout)
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world)}
    return group


def _vllm_engine(urls: list[str], offsets: list[int], address: str, port: int, world: int) -> Any:
    """vLLM's trainer-side NCCL engine, driving every server through one fan-out client."""
    try:
        from vllm.distributed.weight_transfer.nccl_engine import (
            NCCLTrainerInitInfo,
            NCCLTrainerWeightTransferEngine,
        )
    except ImportError as e:
        raise EngineError("engine.weight_sync nccl with vLLM needs vllm importable by the trainer (vLLM's "
                          f"NCCL communicator): {e}") from None
    info = NCCLTrainerInitInfo(master_address=address, master_port=port, world_size=world, rank=0)
    return NCCLTrainerWeightTransferEngine.trainer_init(info, client=FanOutClient(urls, offsets),
                                                        source=_vllm_source())


class FanOutClient:
    """vLLM's weight-sync client protocol over HTTP, sent to every server in parallel; each server's
    ``rank_offset`` is its own; ``finish_weight_update`` labels the new weights ``version``."""

    def __init__(self, urls: list[str], offsets: list[int]) -> None:
        self.clients = [HTTPClient(u, timeout=600, retries=0) for u in urls]
        self.offsets, self.version = offsets, None

    def _all(self, path: str, bodies: list[Any]) -> None:
        with ThreadPoolExecutor(len(self.clients)) as pool:
            for f in [pool.submit(c.call, "POST", path, b) for c, b in zip(self.clients, bodies, strict=True)]:
                f.result()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._all("/init_weight_transfer_engine", [{"init_info": {**init_info, "rank_offset": off}}
                                                   for off in self.offsets])

    def shutdown_weight_transfer_engine(self) -> None:
        self._all("/shutdown_weight_transfer_engine", [None] * len(self.clients))

    def start_weight_update(self) -> None:
        self._all("/start_weight_update", [None] * len(self.clients))

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._all("/update_weights", [{"update_info": update_info}] * len(self.clients))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        body = {"weight_version": weight_version or self.version}
        self._all("/finish_weight_update", [body] * len(self.clients))


def _vllm_source() -> Any:
    """A ``vllm`` ``WeightSource`` over the state dict of the current step (set before each send)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class StateSource(WeightSource):
        state: dict[str, Any] = {}

        def metadata(self) -> list[Any]:
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.state.items()]

        def __iter__(self):  # noqa: ANN204 - vLLM's iterator protocol
            for name, tensor in self.state.items():
                yield name, tensor.to("cuda", non_blocking=True).contiguous()

    return StateSource()
