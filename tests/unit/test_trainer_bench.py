"""The trainer benchmark's own pieces: the padded baseline computes the same loss, the fit is right."""

import random

import pytest
import torch

from albatross.bench.batches import agent_lengths, padded_order, padded_step, padded_tokens, synthetic_batch
from albatross.bench.trainer import MEMORY_CONFIGS, _memory_result, fit_line, fit_max_len, sweep_plan
from albatross.config import TrainerConfig
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
    packed = Trainer(tiny_causal_lm(300), TrainerConfig(lr=1e-3, micro_batch_tokens=64))
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


def test_sorted_padded_baseline_is_the_same_loss_with_less_padding():
    lengths = [40, 9, 23, 17, 31]
    batch = synthetic_batch(lengths, vocab=300, seed=2)
    assert [len(ts.sample.token_ids) for ts in padded_order(batch.samples, sort=True)] == sorted(lengths)
    assert padded_order(batch.samples, sort=False) == batch.samples
    plain, ordered = tiny_causal_lm(300), tiny_causal_lm(300)
    a = padded_step(plain, torch.optim.AdamW(plain.parameters(), lr=1e-3), batch, batch_size=2)
    b = padded_step(ordered, torch.optim.AdamW(ordered.parameters(), lr=1e-3), batch, batch_size=2, sort=True)
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    # sorted: (9, 17) -> 2 x 16, (23, 31) -> 2 x 30, (40) -> 39; arrival order: 2 x 39 + 2 x 22 + 30
    assert b["processed_tokens"] == padded_tokens(lengths, 2, sort=True) == 2 * 16 + 2 * 30 + 39
    assert a["processed_tokens"] == padded_tokens(lengths, 2) == 2 * 39 + 2 * 22 + 30
    for (name, p), (_, q) in zip(plain.named_parameters(), ordered.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4, msg=name)


def test_memory_result_names_the_projection_apart_from_the_measurement():
    rows = [{"config": "chunked+ckpt", "seq_len": 4096, "peak_gib": 2.0, "status": "ok"},
            {"config": "chunked+ckpt", "seq_len": 8192, "peak_gib": 3.0, "status": "ok"},
            {"config": "chunked+ckpt", "seq_len": 16384, "status": "over 16 GiB"},
            {"config": "full-logits", "seq_len": 16384, "peak_gib": 9.0, "status": "ok"}]
    mem = _memory_result(rows)
    assert mem["max_seq_len_measured"] == 8192  # the longest chunked+ckpt step that ran
    assert mem["max_seq_len_projected"] == 23 * 4096 and "max_seq_len_fit" not in mem
    assert "projection, not a measurement" in mem["max_seq_len_projected_method"]
