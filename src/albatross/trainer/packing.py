"""Pack samples into micro-batches under a token budget, with no padding.

A micro-batch is one row of concatenated samples. Each sample of n tokens contributes its first n - 1
tokens as inputs and its last n - 1 tokens as targets, so every field is aligned with the *target*:
``loss_mask``, ``logprobs`` (rollout log-prob of the target), ``versions`` and ``advantages``.
``position_ids`` restart at 0 for each sample, and ``block_causal_mask`` keeps attention inside a
sample. Samples are placed first-fit decreasing; a sample longer than the budget gets a micro-batch
of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from albatross.records import TrainSample


@dataclass
class MicroBatch:
    input_ids: Tensor  # [1, T] long
    position_ids: Tensor  # [1, T] long, restarting at 0 per sample
    seq_lens: list[int]  # tokens of each packed sample, in order
    targets: Tensor  # [T] long, the next token
    loss_mask: Tensor  # [T] float, 1 where the target is a model token
    logprobs: Tensor  # [T] float, rollout log-prob of the target
    versions: Tensor  # [T] long, policy version of the target
    advantages: Tensor  # [T] float

    @property
    def num_tokens(self) -> int:
        return int(self.targets.shape[0])

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())


def first_fit_decreasing(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices grouped into bins of total length <= budget (an item over budget gets its own bin)."""
    if budget < 1:
        raise ValueError(f"token budget must be >= 1, got {budget}")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(budget - lengths[i])
    return bins


def _concat(samples: Sequence[TrainSample]) -> MicroBatch:
    ids, pos, tgt, mask, lps, vers, advs, lens = [], [], [], [], [], [], [], []
    for ts in samples:
        s, n = ts.sample, len(ts.sample.token_ids) - 1
        ids += s.token_ids[:-1]
        pos += range(n)
        tgt += s.token_ids[1:]
        mask += s.loss_mask[1:]
        lps += s.logprobs[1:]
        vers += s.versions[1:]
        advs += [ts.advantage] * n
        lens.append(n)
    return MicroBatch(
        input_ids=torch.tensor([ids], dtype=torch.long),
        position_ids=torch.tensor([pos], dtype=torch.long),
        seq_lens=lens,
        targets=torch.tensor(tgt, dtype=torch.long),
        loss_mask=torch.tensor(mask, dtype=torch.float32),
        logprobs=torch.tensor(lps, dtype=torch.float32),
        versions=torch.tensor(vers, dtype=torch.long),
        advantages=torch.tensor(advs, dtype=torch.float32),
    )


def pack(samples: Sequence[TrainSample], max_tokens: int) -> list[MicroBatch]:
    """Micro-batches of at most ``max_tokens`` input tokens; samples with < 2 tokens are skipped."""
    kept = [s for s in samples if len(s.sample.token_ids) >= 2]
    bins = first_fit_decreasing([len(s.sample.token_ids) - 1 for s in kept], max_tokens)
    return [_concat([kept[i] for i in sorted(b)]) for b in bins]


def block_causal_mask(
    seq_lens: Sequence[int], dtype: torch.dtype, device: torch.device | str = "cpu"
) -> Tensor:
    """[1, 1, T, T] mask letting query t attend key s only within its own sample and for s <= t.

    With ``dtype=torch.bool`` it is True where attention is allowed (for sdpa, a quarter of the memory);
    with a float dtype it is additive: 0 where allowed, the dtype's minimum elsewhere (for eager).
    """
    seg = torch.repeat_interleave(
        torch.arange(len(seq_lens), device=device), torch.tensor(seq_lens, device=device)
    )
    t = seg.shape[0]
    allowed = torch.ones(t, t, dtype=torch.bool, device=device).tril() & (seg[:, None] == seg[None, :])
    if dtype == torch.bool:
        return allowed[None, None]
    mask = torch.zeros(t, t, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]
