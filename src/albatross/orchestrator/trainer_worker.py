"""The trainer as its own process: batches in over a queue, versioned weights and checkpoints out on disk.

With ``trainer.gpus = N > 1`` the trainer process is rank 0 of an FSDP2 group it starts itself: it launches ranks
1..N-1 as ``python -m albatross.orchestrator.trainer_worker`` processes (one per GPU; gloo ranks on the CPU), hands
every batch to them with a broadcast, and every rank steps, exports and checkpoints together (the collectives
line up). The update equals a single-process step on the same batch (``trainer/distributed.py``).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any


def trainer_main(model_dir: str, run_dir: str, cfg_json: str, batch_q: Any, result_q: Any,
                 start_version: int, resume_ckpt: str) -> None:
    """Entry point of the trainer process (spawned). Puts one dict per step on ``result_q``.

    SIGINT is ignored here: on Ctrl-C the orchestrator stops the trainer in order, so the last
    checkpoint stays whole. If the orchestrator dies without stopping it (SIGKILL, SIGTERM), the trainer gets
    SIGTERM and ends too, instead of waiting for batches forever.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _end_with_parent()
    ranks: list[subprocess.Popen[bytes]] = []
    try:
        from albatross.config import RunConfig

        cfg = RunConfig.model_validate_json(cfg_json)
        if cfg.trainer.gpus > 1:
            ranks = _start_ranks(model_dir, run_dir, cfg_json, start_version, resume_ckpt, cfg.trainer.gpus)
        _serve(model_dir, Path(run_dir), cfg, _queue_source(batch_q), result_q, start_version, resume_ckpt,
               rank=0, world=cfg.trainer.gpus)
    except Exception:  # the parent stops the run cleanly and reports this
        result_q.put({"error": traceback.format_exc()})
    finally:
        _stop_ranks(ranks)


def _end_with_parent() -> None:
    """SIGTERM this process when its parent dies (Linux ``PR_SET_PDEATHSIG``), and end now if it already has."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    if sys.platform.startswith("linux"):
        from albatross.sandbox import linux

        linux.prctl(linux.PR_SET_PDEATHSIG, signal.SIGTERM)
    if parent is not None and os.getppid() != parent.pid:
        os.kill(os.getpid(), signal.SIGTERM)


def _queue_source(batch_q: Any) -> Callable[[], Any]:
    """Rank 0's batches: from the orchestrator's queue, shared with the other ranks by a broadcast."""

    def get() -> Any:
        from albatross.trainer import distributed as dist

        return dist.broadcast_object(batch_q.get())

    return get


def _rank_source() -> Any:
    from albatross.trainer import distributed as dist

    return dist.broadcast_object(None)


def serve_rank(model_dir: str, run_dir: str, cfg_json: str, batch_q: Any, result_q: Any, version: int,
               resume_ckpt: str, rank: int, world: int) -> None:
    """One rank of a trainer whose ranks were placed for it (Ray actors, ``ray_backend.TrainerGroup``): the
    rendezvous is in ``MASTER_ADDR``/``MASTER_PORT``, the rank sees only its own GPU, and ``run_dir`` is its own
    directory (checkpoints are written per rank, ``checkpoint.save_state(private=True)``). Rank 0 reads
    ``batch_q`` and reports on ``result_q`` (an error too); the others get the batches by broadcast."""
    from albatross.config import RunConfig

    cfg = RunConfig.model_validate_json(cfg_json)
    source = _queue_source(batch_q) if rank == 0 else _rank_source
    try:
        _serve(model_dir, Path(run_dir), cfg, source, result_q if rank == 0 else None, version, resume_ckpt,
               rank=rank, world=world, local_rank=0, private=True)
    except Exception:
        if rank == 0:  # the loop stops the run cleanly and reports this
            result_q.put({"error": traceback.format_exc()})
            return
        raise


def _serve(model_dir: str, run_dir: Path, cfg: Any, next_batch: Callable[[], Any], result_q: Any, version: int,
           resume_ckpt: str, rank: int, world: int, local_rank: int | None = None, private: bool = False) -> None:
    """Step as rank ``rank`` of ``world`` on device ``local_rank`` (default ``rank``: one machine's GPUs);
    ``private``: ``run_dir`` is this rank's own (no filesystem shared with the other ranks)."""
    import torch

    from albatross.devices import trainer_device
    from albatross.trainer.model import load_model, to_device
    from albatross.trainer.step import Trainer

    torch.set_num_threads(cfg.trainer.threads)
    torch.manual_seed(cfg.seed)
    device = trainer_device(cfg.trainer.device, rank if local_rank is None else local_rank)
    if world > 1:
        _join_group(device, rank, world)
    from albatross.trainer.weights import make_weight_sender
    from albatross.trainer.weights.tensors import declared_dtype

    sender = make_weight_sender(cfg, run_dir / "weights", run_dir, rank, model_dir=model_dir)
    try:
        trainer = Trainer.from_config(to_device(load_model(model_dir), device), cfg, fsdp=world > 1)
        where = f"{device}" + (f" x {world} ranks" if world > 1 else "")
        _steps(trainer, sender, run_dir, cfg, next_batch, result_q, version, resume_ckpt, where,
               declared_dtype(model_dir), private)
    finally:
        from albatross.trainer import distributed as dist

        sender.close()
        dist.leave()


FINISH = "finish"  # the orchestrator's last item on a run that ended normally: write the final weights, then exit
ADAPTER_DIR = "adapter"  # ``<run_dir>/adapter``: the last LoRA adapter in PEFT's format (``<out>/final``'s source)


def _rank() -> int:
    from albatross.trainer import distributed as dist

    return dist.rank()


def _steps(trainer: Any, sender: Any, run_dir: Path, cfg: Any, next_batch: Callable[[], Any], result_q: Any,
           version: int, resume_ckpt: str, where: str, dtype: str, private: bool = False) -> None:
    """Step on each batch until ``None`` (stop) or ``FINISH``; publish the weights after every step
    (``engine.weight_sync``: the locator goes to ``engine.update_weights``), checkpoint when due. A resumed trainer
    first publishes the weights of its checkpoint (the engines start from the base model)."""
    from albatross.trainer.checkpoint import Checkpointer

    trainer.version = version
    ready: dict[str, Any] = {"ready": True, "device": where, **trainer.parameter_counts()}
    if resume_ckpt:
        trainer.load(resume_ckpt)
        ready["path"] = sender.send(trainer.export_view(), trainer.version)
    _put(result_q, {**ready, "version": trainer.version})
    oc = cfg.orchestrator
    checkpoints = Checkpointer(oc.checkpoint_every, oc.checkpoint_minutes)
    checkpoints.last_step = trainer.version
    try:
        while True:
            t_wait = time.monotonic()
            batch = next_batch()
            wait_s = time.monotonic() - t_wait
            if batch is None or batch == FINISH:
                break
            metrics = trainer.step(batch, current_version=trainer.version, batch_info=batch.info)
            # no pruning here: the orchestrator prunes once nothing needs a version any more
            t_send = time.monotonic()
            path = sender.send(trainer.export_view(), trainer.version)
            metrics["weight_sync_s"] = time.monotonic() - t_send
            metrics.update(_peak_memory())
            ckpt, report = "", None
            if checkpoints.due(trainer.version):
                ckpt, report = _checkpoint(trainer, run_dir / "checkpoints", dtype, checkpoints, result_q, metrics,
                                           private)
            _put(result_q, {**metrics, "version": trainer.version, "path": str(path), "checkpoint": ckpt,
                            "trainer_wait_s": wait_s})
            if report is not None:
                report()  # after the step's message, so the orchestrator knows the step its state belongs to
    finally:
        checkpoints.wait()
    if batch == FINISH:
        final = _final_weights(trainer, sender, run_dir, dtype)
        adapter = trainer.save_adapter(run_dir / ADAPTER_DIR) if _rank() == 0 else None
        _put(result_q, {"final": final, "adapter": str(adapter or "")})


def _peak_memory() -> dict[str, float]:
    """This rank's peak GPU memory so far (``peak_memory_gib``), when it has a GPU."""
    import torch

    if not torch.cuda.is_available():
        return {}
    return {"peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30}


def _checkpoint(trainer: Any, directory: Path, dtype: str, checkpoints: Any, result_q: Any,
                metrics: dict[str, Any], private: bool = False) -> tuple[str, Callable[[], None]]:
    """Start a background checkpoint of ``trainer``; returns its path and ``report``, which sends its
    ``checkpoint_done`` (or ``checkpoint_error``) message once it is on disk."""
    t0 = time.monotonic()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"trainer-v{trainer.version:06d}"
    write = trainer.save(path, dtype=dtype, background=True, private=private)
    metrics["checkpoint_stage_s"] = time.monotonic() - t0  # the trainer's own pause: a copy to host memory
    version = trainer.version

    def done(f: Any) -> None:
        error = f.exception()
        if error is not None:
            _put(result_q, {"checkpoint_error": f"{path}: {type(error).__name__}: {error}"})
        else:
            _put(result_q, {"checkpoint_done": str(path), "version": version, "bytes": f.result(),
                            "seconds": time.monotonic() - t0})

    checkpoints.started(version, write)
    return str(path), lambda: checkpoints.reporting(write, done)


def _final_weights(trainer: Any, sender: Any, run_dir: Path, dtype: str) -> str:
    """The last version as a directory (``<out>/final``'s source): the sender's own export, or one written now when
    the sender does not export (``nccl``)."""
    from albatross.trainer.checkpoint import export_weights, version_dir

    if sender.exports:
        return str(version_dir(run_dir / "weights", trainer.version))
    return str(export_weights(trainer.export_view(), run_dir / "weights", trainer.version, keep=1 << 30,
                              dtype=dtype))


def _put(result_q: Any, item: dict[str, Any]) -> None:
    if result_q is not None:  # ranks above 0 report nothing: rank 0 speaks for the group
        result_q.put(item)


def _join_group(device: Any, rank: int, world: int) -> None:
    import datetime

    import torch.distributed as tdist

    from albatross.trainer.distributed import backend_for

    if device.type == "cuda":
        import torch

        torch.cuda.set_device(device)
    tdist.init_process_group(backend_for(device.type), rank=rank, world_size=world,
                             timeout=datetime.timedelta(minutes=30))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _start_ranks(model_dir: str, run_dir: str, cfg_json: str, version: int, resume_ckpt: str,
                 world: int) -> list[subprocess.Popen[bytes]]:
    """Launch ranks 1..world-1 (their logs in ``<run_dir>/logs``) and set this process up as rank 0."""
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())})
    logs = Path(run_dir) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    cfg_path = logs / "trainer-config.json"
    cfg_path.write_text(cfg_json)
    procs = []
    for r in range(1, world):
        cmd = [sys.executable, "-m", "albatross.orchestrator.trainer_worker", "--rank", str(r), "--world",
               str(world), "--model-dir", model_dir, "--run-dir", run_dir, "--config", str(cfg_path),
               "--version", str(version), "--resume", resume_ckpt]
        with open(logs / f"trainer-rank{r}.log", "ab") as log:
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ),
                                          start_new_session=True))
    return procs


def _stop_ranks(procs: list[subprocess.Popen[bytes]], timeout: float = 30.0) -> None:
    """Wait for the other ranks to leave after the stop broadcast; kill (by pid) any that do not."""
    for p in procs:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _rank_main(argv: list[str] | None = None) -> int:
    """A trainer rank above 0, started by rank 0: joins the group and steps on the batches it broadcasts."""
    from albatross.config import RunConfig

    p = argparse.ArgumentParser(description=__doc__)
    for name in ("--rank", "--world", "--version"):
        p.add_argument(name, type=int, required=True)
    for name in ("--model-dir", "--run-dir", "--config", "--resume"):
        p.add_argument(name, required=True)
    a = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    cfg = RunConfig.model_validate_json(Path(a.config).read_text())
    _serve(a.model_dir, Path(a.run_dir), cfg, _rank_source, None, a.version, a.resume, rank=a.rank, world=a.world)
    return 0


if __name__ == "__main__":
    sys.exit(_rank_main())
