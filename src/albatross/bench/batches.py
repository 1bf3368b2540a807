"""Synthetic agent trajectories and the padded baseline trainer step, shared by ``bench trainer`` and its
``--study`` (``bench/study.py``), and by ``bench gpu``."""

from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING

from albatross.records import Batch, Sample, TrainSample

if TYPE_CHECKING:
    import torch


# synthetic trajectories -----------------------------------------------------------------------------


def agent_lengths(n: int, rng: random.Random, cap: int = 4096) -> list[int]:
    """Trajectory lengths like real agent runs: log-normal, median 400 tokens, clipped to [64, cap]."""
    return [min(max(int(rng.lognormvariate(math.log(400), 1.0)), 64), cap) for _ in range(n)]


def synthetic_batch(lengths: list[int], vocab: int, seed: int = 0) -> Batch:
    """Random trajectories: a 48-token prompt, then model turns (loss tokens) and observations."""
    rng = random.Random(seed)
    samples: list[TrainSample] = []
    for n in lengths:
        mask = [0 if t < 48 or (t // 96) % 3 == 2 else 1 for t in range(n)]  # every 3rd block: observation
        # rollout log-probs near a random model's (-log V), so importance ratios sit around 1
        old = [-math.log(vocab) + rng.uniform(-0.3, 0.3) if m else 0.0 for m in mask]
        sample = Sample([rng.randrange(vocab) for _ in range(n)], mask, old, [0 if m else -1 for m in mask])
        samples.append(TrainSample(sample, rng.choice([-1.0, -0.5, 0.5, 1.0])))
    return Batch(samples=samples, groups=len(samples), min_version=0)


# the padded baseline --------------------------------------------------------------------------------


def _padded_tensors(samples: list[TrainSample], length: int) -> dict[str, torch.Tensor]:
    import torch

    b = len(samples)
    out = {"ids": torch.zeros(b, length, dtype=torch.long), "attn": torch.zeros(b, length, dtype=torch.long),
           "tgt": torch.zeros(b, length, dtype=torch.long), "mask": torch.zeros(b, length),
           "old": torch.zeros(b, length), "ver": torch.zeros(b, length, dtype=torch.long),
           "adv": torch.zeros(b, length)}
    for i, ts in enumerate(samples):
        s, n = ts.sample, len(ts.sample.token_ids) - 1
        out["ids"][i, :n] = torch.tensor(s.token_ids[:-1])
        out["attn"][i, :n] = 1
        out["tgt"][i, :n] = torch.tensor(s.token_ids[1:])
        out["mask"][i, :n] = torch.tensor(s.loss_mask[1:], dtype=torch.float32)
        out["old"][i, :n] = torch.tensor(s.logprobs[1:])
        out["ver"][i, :n] = torch.tensor(s.versions[1:])
        out["adv"][i, :n] = ts.advantage
    return out


def padded_order(samples: list[TrainSample], sort: bool) -> list[TrainSample]:
    """The order the padded baseline batches trajectories in: arrival order, or sorted by length."""
    return sorted(samples, key=lambda ts: len(ts.sample.token_ids)) if sort else list(samples)


def padded_tokens(lengths: list[int], batch_size: int = 8, sort: bool = False) -> int:
    """Tokens the padded baseline processes: each batch padded to its longest trajectory (minus one)."""
    xs = sorted(lengths) if sort else list(lengths)
    return sum(len(c) * (max(c) - 1) for c in (xs[i : i + batch_size] for i in range(0, len(xs), batch_size)))


def padded_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, batch_size: int = 8,
                grad_clip: float = 1.0,
                sort: bool = False) -> dict[str, float]:
    """The straightforward step: padded batches (``sort``: by length), full logits, the same TIS loss and
    AdamW step."""
    import torch

    from albatross.rl.losses import tis_loss

    optimizer.zero_grad(set_to_none=True)
    samples = padded_order(batch.samples, sort)
    n_loss = sum(sum(ts.sample.loss_mask[1:]) for ts in samples)
    loss_sum, processed = 0.0, 0
    for i in range(0, len(samples), batch_size):
        chunk = samples[i : i + batch_size]
        length = max(len(ts.sample.token_ids) - 1 for ts in chunk)
        t = _padded_tensors(chunk, length)
        logits = model(input_ids=t["ids"], attention_mask=t["attn"], use_cache=False).logits
        logp = torch.log_softmax(logits.float(), -1).gather(-1, t["tgt"][..., None])[..., 0]
        loss, _ = tis_loss(logp.flatten(), t["old"].flatten(), t["adv"].flatten(), t["mask"].flatten(),
                           t["ver"].flatten(), current_version=0, num_batch_tokens=n_loss)
        torch.autograd.backward(loss)
        loss_sum += float(loss.detach())
        processed += len(chunk) * length
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    return {"loss": loss_sum, "processed_tokens": float(processed)}
