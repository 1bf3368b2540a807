"""The trainer benchmark's own pieces: the padded baseline computes the same loss, the fit is right."""

import random

import pytest
import torch

from albatross.bench.trainer import (
    MEMORY_CONFIGS,
    agent_lengths,
    fit_line,
    fit_max_len,
    padded_step,
    sweep_plan,
    synthetic_batch,
)
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


def test_fit_max_len_extrapolates_a_least_squares_line():
    points = [{"seq_len": 4096, "peak_gib": 2.0}, {"seq_len": 8192, "peak_gib": 3.0}]
    # 1 GiB per 4096 tokens from 1 GiB at 0: 24 GiB at 23 * 4096 tokens
    assert fit_line(points) == pytest.approx((1.0, 1 / 4096))
    assert fit_max_len(points, 24.0) == 23 * 4096
    noisy = [*points, {"seq_len": 16384, "peak_gib": 5.5}]  # residuals pull the slope up a little
    intercept, slope = fit_line(noisy)
    assert slope == pytest.approx(3.5 / 12288, rel=0.2) and slope > 1 / 4096
    assert fit_max_len(points[:1]) is None
    assert fit_max_len([points[0], {"seq_len": 8192, "peak_gib": 2.0}]) is None


def test_sweep_plan_runs_the_main_curve_before_the_rest():
    plan = sweep_plan([4096, 8192, 16384])
    assert plan[:4] == [(name, 4096) for name in MEMORY_CONFIGS]
    assert plan[4:6] == [("chunked+ckpt", 8192), ("chunked+ckpt", 16384)]
    assert len(plan) == 4 * 3
