"""The trainer benchmark's own pieces: the padded baseline computes the same loss, the fit is right."""

import random

import pytest
import torch

from albatross.bench.trainer import agent_lengths, fit_max_len, padded_step, synthetic_batch
from albatross.trainer.model import tiny_causal_lm
from albatross.trainer.step import Trainer


def test_agent_lengths_many_short_long_tail():
    lengths = agent_lengths(400, random.Random(0), cap=4096)
    assert min(lengths) >= 64 and max(lengths) <= 4096
    median = sorted(lengths)[200]
    assert 300 < median < 550
    assert sum(n > 4 * median for n in lengths) > 10  # a real tail


def test_padded_baseline_is_the_same_loss_and_update():
    batch = synthetic_batch([40, 9, 23, 17, 31], vocab=300, seed=2)
    packed = Trainer(tiny_causal_lm(300), lr=1e-3, micro_batch_tokens=64)
    padded = tiny_causal_lm(300)
    optimizer = torch.optim.AdamW(padded.parameters(), lr=1e-3, betas=(0.9, 0.95))
    a = packed.step(batch)
    b = padded_step(padded, optimizer, batch, batch_size=2)
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    assert b["processed_tokens"] == 2 * 39 + 2 * 22 + 30  # pairs padded to their longest
    for (name, p), (_, q) in zip(packed.model.named_parameters(), padded.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4, msg=name)


def test_fit_max_len_extrapolates_the_last_two_points():
    points = [{"seq_len": 4096, "peak_gib": 2.0}, {"seq_len": 8192, "peak_gib": 3.0}]
    # 1 GiB per 4096 tokens: 24 GiB is reached 21 * 4096 tokens after 8192
    assert fit_max_len(points, 24.0) == 8192 + 21 * 4096
    assert fit_max_len(points[:1]) is None
    assert fit_max_len([points[0], {"seq_len": 8192, "peak_gib": 2.0}]) is None
