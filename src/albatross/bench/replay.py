"""Routing replay: the sampler-trainer mismatch KL with and without replay as the engine falls behind.

The built-in engine samples a batch once, at version 0, recording each generated token's experts and
indexer selections (``rl.routing_replay``). A ``Trainer`` then steps on that same batch again and again,
so at its k-th step the engine is k versions behind; every step logs the mismatch KL of its loss tokens
(``r - log r - 1``) with the recorded routing replayed (``mismatch_kl``) and with live routing
(``mismatch_kl_no_replay``), before its update. Without ``--model`` it measures tiny random models of
the MoE families (``albatross.models.tiny``); the figures are exact arithmetic, not timings.
"""

from __future__ import annotations

import argparse
import copy
import random
from pathlib import Path
from typing import Any

from albatross.bench.common import print_table, write_json
from albatross.errors import UserError

FAMILIES = ("qwen3_moe", "qwen4_exp", "glm_moe_dsa", "glm5_next")
PROMPTS = 6  # completions in the batch; prompt i has 6 + 3 i tokens
NEW_TOKENS = 24


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="DIR", help="a local MoE model directory (default: tiny models of "
                   f"{', '.join(FAMILIES)})")
    p.add_argument("--lr", type=float, default=1e-5, help="the trainer's learning rate (default %(default)s)")
    p.add_argument("--steps", type=int, default=4, help="trainer steps on the batch: the engine ends "
                   "steps - 1 versions behind (default %(default)s)")


def rollouts(model: Any, vocab: int, n: int = PROMPTS, new: int = NEW_TOKENS, prompt_step: int = 3,
             seed: int = 0) -> list[Any]:
    """``n`` completions of ``new`` tokens sampled by the built-in engine (temperature 1) from a copy of
    ``model``, with routing recorded, as samples (random prompts of 6, 6 + ``prompt_step``, ... tokens)."""
    from albatross.engine import BuiltinEngine, SamplingParams
    from albatross.records import Sample

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(6 + prompt_step * i)] for i in range(n)]
    with BuiltinEngine(copy.deepcopy(model), record_routing=True) as engine:
        done = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=new, seed=11))
    samples = []
    for prompt, c in zip(prompts, done, strict=True):
        s = Sample(list(prompt), [0] * len(prompt), [0.0] * len(prompt), [-1] * len(prompt))
        s.extend(c.token_ids, model=True, logprobs=c.logprobs, versions=c.versions, routing=c.routing)
        samples.append(s)
    return samples


def drift_kl(model: Any, vocab: int, lr: float, steps: int) -> list[dict[str, float]]:
    """Per trainer step (= versions behind): the mismatch KL with and without routing replay."""
    from albatross.config import TrainerConfig
    from albatross.records import Batch, TrainSample
    from albatross.trainer.step import Trainer

    samples = rollouts(model, vocab)
    if not any(r for s in samples for r in s.routing or []):
        raise UserError("bench replay: the model recorded no routing (not an MoE model?)")
    batch = Batch([TrainSample(s, 1.0 if i % 2 else -1.0) for i, s in enumerate(samples)], groups=1,
                  min_version=0)
    trainer = Trainer(copy.deepcopy(model).train(), TrainerConfig(lr=lr, precision="fp32"), temperature=1.0)
    rows = []
    for behind in range(steps):
        m = trainer.step(batch, current_version=behind)
        rows.append({"versions_behind": behind, "mismatch_kl": m["mismatch_kl"],
                     "mismatch_kl_no_replay": m["mismatch_kl_no_replay"]})
    return rows


def _table(results: dict[str, list[dict[str, float]]]) -> list[tuple[str, Any]]:
    return [(f"{name} {r['versions_behind']} behind: replayed / live",
             f"{r['mismatch_kl']:.3g} / {r['mismatch_kl_no_replay']:.3g}")
            for name, rows in results.items() for r in rows]


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from albatross.models.tiny import TEXT_VOCAB, load_any, tiny_model

    torch.set_num_threads(1)  # tiny models: thread overhead dominates
    lr, steps = float(args.lr), int(args.steps)
    if steps < 1 or lr < 0:
        raise UserError(f"bench replay: --steps {steps} / --lr {lr}: expected steps >= 1 and lr >= 0")
    model_dir = args.model
    if model_dir:
        if not (Path(model_dir) / "config.json").is_file():
            raise UserError(f"bench replay: --model {model_dir}: no config.json (not a model directory)")
        model = load_any(model_dir, dtype=torch.float32).eval()
        vocab = min(model.config.get_text_config().vocab_size, TEXT_VOCAB)
        results = {str(model_dir): drift_kl(model, vocab, lr, steps)}
    else:
        results = {f: drift_kl(tiny_model(f, seed=1), TEXT_VOCAB, lr, steps) for f in FAMILIES}
    print_table(f"albatross bench replay (mismatch KL, lr {lr:g})", _table(results))
    out = {"lr": lr, "steps": steps, "prompts": PROMPTS, "new_tokens": NEW_TOKENS, "runs": results}
    write_json(args.json, out)
    return out
