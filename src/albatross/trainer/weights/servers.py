"""One inference server's side of the ``nccl`` transport: its weight routes, over HTTP (no vLLM or SGLang import).

A round, driven by ``nccl.py`` for every server in parallel: ``pause`` -> ``begin`` -> one ``receive`` per bucket
(answered once the server has received that bucket's broadcasts) -> ``finish(version)`` (new weights labelled
``version``, prefix cache emptied) -> ``resume``. ``join`` / ``leave`` open and close the weight group.

vLLM 0.32 (server started with ``--weight-transfer-config '{"backend": "nccl"}'`` and ``VLLM_SERVER_DEV_MODE=1``;
routes in ``vllm/entrypoints/rl/online/api_router.py`` and ``vllm/entrypoints/serve/dev/cache/api_router.py``;
docs/gpu.md cites the lines):
``POST /pause?mode=keep`` (requests freeze in the queue), ``POST /init_weight_transfer_engine`` ``{"init_info":
{...}}``, ``POST /start_weight_update``, ``POST /update_weights`` ``{"update_info": {"names", "dtype_names",
"shapes"}}`` (the workers receive one broadcast per tensor, in order, and load it), ``POST /finish_weight_update``
``{"weight_version"}``, ``POST /reset_prefix_cache?reset_running_requests=true`` (the frozen requests are preempted
and recompute their KV with the new weights), ``POST /resume``, ``POST /shutdown_weight_transfer_engine``,
``GET /get_world_size``.

SGLang (``python/sglang/srt/entrypoints/http_server.py``): ``GET /server_info`` (``tp_size``, ``pp_size``,
``dp_size``), ``POST /init_weights_update_group``, ``POST /pause_generation`` ``{"mode": "retract"}`` (running
requests go back to the queue; their KV is recomputed after ``/continue_generation``), one
``POST /update_weights_from_distributed`` per bucket (``names``, ``dtypes``, ``shapes``, ``group_name``; the last one
with ``flush_cache`` and ``weight_version``), ``POST /continue_generation``, ``POST /destroy_weights_update_group``.
"""

from __future__ import annotations

from typing import Any, Protocol

from albatross.engine.base import EngineError
from albatross.engine.remote import HTTPClient
from albatross.trainer.weights.tensors import TensorMeta

GROUP = "albatross_weights"


class WeightServer(Protocol):
    """Every member ``nccl.py`` uses of one server."""

    url: str

    def ranks(self) -> int:
        """Ranks this server adds to the weight group (its tensor-parallel workers)."""
        ...

    def join(self, rendezvous: dict[str, Any], rank_offset: int, world: int) -> None:
        """Join the group (blocks until every rank has joined)."""
        ...

    def pause(self) -> None: ...

    def begin(self) -> None: ...

    def receive(self, bucket: list[TensorMeta], last: bool, version: int) -> None:
        """Receive ``bucket``'s broadcasts (blocks until they have all arrived and are loaded)."""
        ...

    def finish(self, version: int) -> None: ...

    def resume(self) -> None: ...

    def leave(self) -> None: ...


def _ok(kind: str, what: str, out: Any) -> None:
    if isinstance(out, dict) and out.get("success", True) is False:
        raise EngineError(f"{kind} {what}: {out.get('message') or out}")


class VLLMServer:
    """A vLLM 0.32 server's weight-transfer routes."""

    def __init__(self, url: str, timeout: float = 1800.0) -> None:
        self.url = url
        self.http = HTTPClient(url, timeout=timeout, retries=0)

    def ranks(self) -> int:
        _, out = HTTPClient(self.url, timeout=30, retries=2).call("GET", "/get_world_size")
        if not isinstance(out, dict) or "world_size" not in out:
            raise EngineError(f"{self.url}/get_world_size gave no world_size: {str(out)[:200]}")
        return int(out["world_size"])

    def join(self, rendezvous: dict[str, Any], rank_offset: int, world: int) -> None:
        info = {**rendezvous, "rank_offset": rank_offset, "world_size": world, "packed": False}
        self.http.call("POST", "/init_weight_transfer_engine", {"init_info": info})

    def pause(self) -> None:
        self.http.call("POST", "/pause?mode=keep")

    def begin(self) -> None:
        self.http.call("POST", "/start_weight_update")

    def receive(self, bucket: list[TensorMeta], last: bool, version: int) -> None:
        info = {"names": [m.name for m in bucket], "dtype_names": [m.dtype for m in bucket],
                "shapes": [list(m.shape) for m in bucket]}
        self.http.call("POST", "/update_weights", {"update_info": info})

    def finish(self, version: int) -> None:
        self.http.call("POST", "/finish_weight_update", {"weight_version": str(version)})
        _, out = self.http.call("POST", "/reset_prefix_cache?reset_running_requests=true")
        if isinstance(out, dict) and out.get("success") is False:
            raise EngineError(f"vLLM at {self.url} could not reset its prefix cache after the weight update")

    def resume(self) -> None:
        self.http.call("POST", "/resume")

    def leave(self) -> None:
        self.http.call("POST", "/shutdown_weight_transfer_engine")


class SGLangServer:
    """An SGLang server's weight-update-group routes."""

    def __init__(self, url: str, timeout: float = 1800.0) -> None:
        self.url = url
        self.http = HTTPClient(url, timeout=timeout, retries=0)

    def ranks(self) -> int:
        """``tp_size`` from ``/server_info`` (``/get_server_info`` on older servers); SGLang puts its worker of
        tensor-parallel rank r at ``rank_offset + r``, so pipeline or data parallelism cannot join."""
        client = HTTPClient(self.url, timeout=30, retries=2)
        info: Any = None
        for path in ("/server_info", "/get_server_info"):
            status, out = client.call("GET", path, ok_404=True)
            if status == 200 and isinstance(out, dict) and "tp_size" in out:
                info = out
                break
        if info is None:
            raise EngineError(f"SGLang at {self.url}: neither /server_info nor /get_server_info gives tp_size")
        if int(info.get("pp_size") or 1) > 1 or int(info.get("dp_size") or 1) > 1:
            raise EngineError(f"SGLang at {self.url}: weights over NCCL need pp_size = dp_size = 1 (it has "
                              f"pp {info.get('pp_size')}, dp {info.get('dp_size')}); use engine.replicas for more "
                              "servers")
        return int(info["tp_size"])

    def join(self, rendezvous: dict[str, Any], rank_offset: int, world: int) -> None:
        body = {**rendezvous, "rank_offset": rank_offset, "world_size": world, "group_name": GROUP}
        _ok("SGLang could not join the weight group:", self.url, self.http.call(
            "POST", "/init_weights_update_group", body)[1])

    def pause(self) -> None:
        self.http.call("POST", "/pause_generation", {"mode": "retract"})

    def begin(self) -> None:
        pass

    def receive(self, bucket: list[TensorMeta], last: bool, version: int) -> None:
        body: dict[str, Any] = {"names": [m.name for m in bucket], "dtypes": [m.dtype for m in bucket],
                                "shapes": [list(m.shape) for m in bucket], "group_name": GROUP,
                                "flush_cache": last}
        if last:
            body["weight_version"] = str(version)
        _ok("SGLang refused the weights:", self.url, self.http.call(
            "POST", "/update_weights_from_distributed", body)[1])

    def finish(self, version: int) -> None:
        pass  # the last bucket flushed the cache and set the version

    def resume(self) -> None:
        self.http.call("POST", "/continue_generation", {})

    def leave(self) -> None:
        self.http.call("POST", "/destroy_weights_update_group", {"group_name": GROUP})


def server(kind: str, url: str) -> WeightServer:
    if kind == "vllm":
        return VLLMServer(url)
    if kind == "sglang":
        return SGLangServer(url)
    raise ValueError(f"nccl weight sync needs a vllm or sglang engine, not {kind}")
