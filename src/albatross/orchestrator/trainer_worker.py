"""The trainer as its own process: batches in over a queue, versioned weights out on disk."""

from __future__ import annotations

import traceback
from typing import Any


def trainer_main(model_dir: str, weights_dir: str, cfg_json: str, batch_q: Any, result_q: Any,
                 start_version: int) -> None:
    """Entry point of the trainer process (spawned). Puts one dict per step on ``result_q``."""
    try:
        _serve(model_dir, weights_dir, cfg_json, batch_q, result_q, start_version)
    except Exception:  # the parent stops the run cleanly and reports this
        result_q.put({"error": traceback.format_exc()})


def _serve(model_dir: str, weights_dir: str, cfg_json: str, batch_q: Any, result_q: Any,
           version: int) -> None:
    import torch

    from albatross.config import RunConfig
    from albatross.trainer.checkpoint import export_weights
    from albatross.trainer.model import load_model
    from albatross.trainer.step import Trainer

    cfg = RunConfig.model_validate_json(cfg_json)
    torch.set_num_threads(cfg.trainer.threads)
    torch.manual_seed(cfg.seed)
    model = load_model(model_dir)
    trainer = make_trainer(Trainer, model, cfg)
    result_q.put({"ready": True})
    while True:
        batch = batch_q.get()
        if batch is None:
            return
        metrics = trainer.step(batch, current_version=version)
        version += 1
        path = export_weights(model, weights_dir, version, keep=cfg.trainer.keep_versions)
        result_q.put({"version": version, "path": str(path), **metrics})


def make_trainer(trainer_cls, model, cfg):
    rl = cfg.rl
    return trainer_cls(
        model, lr=cfg.trainer.lr, weight_decay=cfg.trainer.weight_decay, grad_clip=cfg.trainer.grad_clip,
        micro_batch_tokens=cfg.trainer.micro_batch_tokens, loss=rl.loss, seed=cfg.seed,
        loss_kwargs={"cap": rl.is_cap, "max_staleness": rl.max_staleness, "p_floor": rl.p_floor,
                     "n_floor": rl.n_floor},
    )
