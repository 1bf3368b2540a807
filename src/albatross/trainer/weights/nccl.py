"""``nccl``: broadcast from the trainer's rank 0 into the vLLM / SGLang servers' weight group (CUDA).

The servers are those of ``<run_dir>/engines.json`` (``engine/launch.py`` writes it, and rewrites it when a
server restarts). World: the trainer's rank 0 is rank 0 of the group, each server's workers follow it
(``rank_offset`` 1, 1 + the first server's ranks, ...). When the set of servers changes the group is built again.

One send, every server in parallel (``servers.py`` has the routes): pause generation, then bucket by bucket
(``tensors.py``: at most ``bucket_bytes`` of full tensors, gathered from the FSDP2 shards in the transfer dtype)
the servers are told what comes and receive it while rank 0 broadcasts it; then the new weights are labelled with
the version, the prefix caches emptied, generation resumed. Every name the server holds is sent (vLLM: tied
``lm_head.weight`` too). The trainer never imports vLLM or SGLang (``comm.py``).

The sender only sends: ``exports`` is False, so the trainer writes ``<out>/final`` itself at the end of a run, and
a resumed trainer sends the weights of its checkpoint before the first step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from albatross.engine.base import EngineError
from albatross.trainer.weights.comm import Communicator, NcclUid, TorchGroup, master_address
from albatross.trainer.weights.servers import WeightServer, server
from albatross.trainer.weights.tensors import Names, TensorMeta, buckets, gather, plan

if TYPE_CHECKING:
    from torch import nn

T = TypeVar("T")

BUCKET_BYTES = 1 << 30  # full tensors held at once on rank 0 while they are broadcast


class NCCLSender:
    """Trainer side of the ``nccl`` transport; ranks other than 0 only take part in the gathers. ``backend`` /
    ``device``: ``gloo`` / ``cpu`` run the protocol without a GPU against the tests' stand-in servers."""

    name = "nccl"
    exports = False

    def __init__(self, kind: str, run_dir: Path, rank: int = 0, dtype: str = "bfloat16", names: Names = "served",
                 backend: str = "nccl", device: str = "cuda", bucket_bytes: int = BUCKET_BYTES) -> None:
        if kind not in ("vllm", "sglang"):
            raise ValueError(f"nccl weight sync needs a vllm or sglang engine, not {kind}")
        self.kind, self.run_dir, self.rank = kind, Path(run_dir), rank
        self.dtype, self.names, self.bucket_bytes = dtype, names, bucket_bytes
        self.backend, self.device = backend, device
        self.urls: list[str] = []
        self.servers: list[WeightServer] = []
        self.comm: Communicator | None = None
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="albatross-weights")

    def send(self, model: nn.Module, version: int) -> str:
        """Every rank calls it; rank 0 pushes version ``version`` into every server. Returns ``""``: the weights
        are in the servers already and only the engines' version label moves."""
        plan_ = buckets(plan(model, self.dtype, self.names), self.bucket_bytes)
        if self.rank != 0:
            for bucket in plan_:
                for _ in gather(model, bucket):
                    pass
            return ""
        self._connect()
        servers, failed = self.servers, False
        self._all(lambda s: s.pause())
        try:
            self._all(lambda s: s.begin())
            for i, bucket in enumerate(plan_):
                self._bucket(model, bucket, i == len(plan_) - 1, version)
            self._all(lambda s: s.finish(version))
        except BaseException:
            failed = True
            raise
        finally:
            self._all(lambda s: s.resume(), quiet=True, on=servers)
            if failed:
                self.close()  # a broken transfer leaves the group unusable: the next send builds it again
        return ""

    def _bucket(self, model: nn.Module, bucket: list[TensorMeta], last: bool, version: int) -> None:
        """The servers post their receives while rank 0 gathers and broadcasts each tensor, in order."""
        assert self.comm is not None
        waiting = [self.pool.submit(s.receive, bucket, last, version) for s in self.servers]
        try:
            for _, tensor in gather(model, bucket, self.device):
                _raise_failed(waiting)  # a server that refused the bucket will never receive it
                self.comm.broadcast(tensor)
            self.comm.sync()
        finally:
            for f in waiting:
                f.result()

    def _connect(self) -> None:
        from albatross.engine.launch import read_endpoints

        urls = list(read_endpoints(self.run_dir).get("urls") or [])
        if not urls:
            raise EngineError(f"{self.run_dir}/engines.json names no engine servers to send weights to")
        if urls == self.urls and self.comm is not None:
            return
        self.close()
        servers = [server(self.kind, u) for u in urls]
        self.pool.shutdown(wait=False)
        self.pool = ThreadPoolExecutor(max(1, len(servers)), thread_name_prefix="albatross-weights")
        sizes = [s.ranks() for s in servers]
        world = 1 + sum(sizes)
        comm = self._communicator(urls)
        joins = [self.pool.submit(s.join, comm.rendezvous(), 1 + sum(sizes[:i]), world)
                 for i, s in enumerate(servers)]
        opened = _in_daemon_thread(comm.open, world)  # blocks until every worker has joined
        done, _ = wait([opened, *joins], return_when=FIRST_EXCEPTION)
        for f in done:  # a server that could not join fails the send now, not after the rendezvous timeout
            f.result()
        for f in [opened, *joins]:
            f.result()
        self.urls, self.servers, self.comm = urls, servers, comm

    def _communicator(self, urls: list[str]) -> Communicator:
        if self.kind == "vllm" and self.backend == "nccl":
            return NcclUid(self.device)
        return TorchGroup(master_address(urls), self.backend, self.device)

    def _all(self, call: Any, quiet: bool = False, on: list[WeightServer] | None = None) -> None:
        """``call(server)`` on every server at once; the first error is raised (``quiet``: logged only)."""
        futures = [self.pool.submit(call, s) for s in (self.servers if on is None else on)]
        for f in futures:
            try:
                f.result()
            except Exception as e:
                if not quiet:
                    raise
                print(f"[weights] {type(e).__name__}: {e}", flush=True)

    def close(self) -> None:
        """Leave the group (the servers first, then this end)."""
        if self.comm is None:
            return
        self._all(lambda s: s.leave(), quiet=True)
        self.comm.close()
        self.comm, self.urls, self.servers = None, [], []


def _raise_failed(futures: list[Future[Any]]) -> None:
    for f in futures:
        error = f.exception() if f.done() else None
        if error is not None:
            raise error


def _in_daemon_thread(fn: Callable[..., T], *args: Any) -> Future[T]:
    """``fn(*args)`` in a daemon thread (one stuck in a rendezvous must not keep the trainer from exiting)."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            future.set_exception(e)

    threading.Thread(target=run, daemon=True, name="albatross-weight-group").start()
    return future
