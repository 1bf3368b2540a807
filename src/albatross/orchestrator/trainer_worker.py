"""The trainer as its own process: batches in over a queue, versioned weights and checkpoints out on disk."""

from __future__ import annotations

import signal
import time
import traceback
from pathlib import Path
from typing import Any


def trainer_main(model_dir: str, run_dir: str, cfg_json: str, batch_q: Any, result_q: Any,
                 start_version: int, resume_ckpt: str) -> None:
    """Entry point of the trainer process (spawned). Puts one dict per step on ``result_q``.

    SIGINT is ignored here: on Ctrl-C the orchestrator stops the trainer in order, so the last
    checkpoint stays whole.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _serve(model_dir, Path(run_dir), cfg_json, batch_q, result_q, start_version, resume_ckpt)
    except Exception:  # the parent stops the run cleanly and reports this
        result_q.put({"error": traceback.format_exc()})


def _serve(model_dir: str, run_dir: Path, cfg_json: str, batch_q: Any, result_q: Any, version: int,
           resume_ckpt: str) -> None:
    import torch

    from albatross.config import RunConfig
    from albatross.trainer.checkpoint import export_weights
    from albatross.trainer.model import load_model
    from albatross.trainer.step import Trainer

    cfg = RunConfig.model_validate_json(cfg_json)
    torch.set_num_threads(cfg.trainer.threads)
    torch.manual_seed(cfg.seed)
    trainer = make_trainer(Trainer, load_model(model_dir), cfg)
    trainer.version = version
    if resume_ckpt:
        trainer.load(resume_ckpt)
    result_q.put({"ready": True, "version": trainer.version})
    every = cfg.orchestrator.checkpoint_every
    while True:
        t_wait = time.monotonic()
        batch = batch_q.get()
        wait_s = time.monotonic() - t_wait
        if batch is None:
            return
        metrics = trainer.step(batch, current_version=trainer.version, batch_info=batch.info)
        # no pruning here: the orchestrator prunes once its state.json no longer needs a version
        path = export_weights(trainer.model, run_dir / "weights", trainer.version, keep=1 << 30)
        ckpt = ""
        if trainer.version % every == 0:
            ckpt = str(save_checkpoint(trainer, run_dir / "checkpoints"))
        result_q.put({**metrics, "version": trainer.version, "path": str(path), "checkpoint": ckpt,
                      "trainer_wait_s": wait_s})


def save_checkpoint(trainer, directory: Path) -> Path:
    """Save trainer + optimizer state for version ``trainer.version`` (atomically, via the trainer)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"trainer-v{trainer.version:06d}.pt"
    trainer.save(path)
    return path


def make_trainer(trainer_cls, model, cfg):
    rl, tc = cfg.rl, cfg.trainer
    return trainer_cls(
        model, lr=tc.lr, weight_decay=tc.weight_decay, grad_clip=tc.grad_clip,
        micro_batch_tokens=tc.micro_batch_tokens, loss=rl.loss, seed=cfg.seed,
        loss_kwargs={"cap": rl.is_cap, "max_staleness": rl.max_staleness, "p_floor": rl.p_floor,
                     "n_floor": rl.n_floor},
        kl_coef=rl.kl_coef, entropy_coef=rl.entropy_coef, logprob_chunk=tc.logprob_chunk or None,
        attention=tc.attention, activation_checkpointing=tc.activation_checkpointing, freeze=tc.freeze,
        offload_optimizer=tc.offload_optimizer, precision=tc.precision,
    )
