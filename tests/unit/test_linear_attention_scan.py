"""The packed gated delta rule's scan over chunk steps (all documents at once) and its triangular solve are
exact: against transformers' token-by-token recurrences (outputs and gradients) and against LAPACK."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from albatross.models.linear_attention import (
    UnitLowerSolve,
    gated_delta_rule_packed,
    scan_layout,
    unit_lower_inverse,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

LENGTHS = [130, 1, 64, 65, 7, 200, 63, 128, 2, 90]  # chunk edges, one token, the longest in the middle


def test_scan_layout_puts_each_step_of_every_document_together():
    slots, active = scan_layout([70, 5, 129, 1, 64], 64)
    assert active == [5, 2, 1]  # chunks per document [2, 1, 3, 1, 1]: 5 have a chunk 0, 2 a chunk 1, 1 a chunk 2
    # longest first: the 129-token document is rank 0, so its chunks are step-major positions 0, 5, 7
    doc = slots[75:75 + 129]
    assert doc[:64].tolist() == list(range(0, 64))
    assert doc[64:128].tolist() == list(range(5 * 64, 6 * 64))
    assert doc[128].item() == 7 * 64
    assert slots.unique().numel() == slots.numel() == 269


def test_unit_lower_inverse_and_its_solve_equal_lapack():
    gen = torch.Generator().manual_seed(0)
    t = (0.5 * torch.randn(3, 5, 64, 64, generator=gen, dtype=torch.float64)).tril(-1)
    t = t + 7 * torch.eye(64, dtype=torch.float64)  # the diagonal is not read: taken as 1
    unit = t.tril(-1) + torch.eye(64, dtype=torch.float64)
    torch.testing.assert_close(unit_lower_inverse(t), torch.linalg.inv(unit))
    a = t.clone().requires_grad_()
    r = torch.randn(3, 5, 64, 48, generator=gen, dtype=torch.float64, requires_grad=True)
    mine = UnitLowerSolve.apply(a, r)
    ref = torch.linalg.solve_triangular(a, r, upper=False, unitriangular=True)
    torch.testing.assert_close(mine, ref)
    weight = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    for g, g_ref in zip(torch.autograd.grad((mine * weight).sum(), [a, r]),
                        torch.autograd.grad((ref * weight).sum(), [a, r]), strict=True):
        torch.testing.assert_close(g, g_ref)


def test_unit_lower_inverse_refuses_a_chunk_that_is_not_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        unit_lower_inverse(torch.eye(48))


def _inputs(per_channel: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    t, h, d = sum(LENGTHS), 2, 16
    q, k, v = (torch.randn(t, h, d, generator=gen, requires_grad=True) for _ in range(3))
    g_raw = torch.randn(t, h, *((d,) if per_channel else ()), generator=gen, requires_grad=True)
    beta_raw = torch.randn(t, h, generator=gen, requires_grad=True)
    return q, k, v, g_raw, beta_raw


def _recurrent(per_channel: bool, q, k, v, g, beta):
    """transformers' token-by-token rule on one document ([n, H, d] inputs)."""
    if per_channel:
        from transformers.models.glm5_next.modeling_glm5_next import recurrent_kimi_delta_attention

        out, _ = recurrent_kimi_delta_attention(q[None], k[None], v[None], g[None], beta[None], initial_state=None,
                                                output_final_state=False, use_qk_l2norm_in_kernel=True)
    else:
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

        out, _ = torch_recurrent_gated_delta_rule(q[None], k[None], v[None], g=g[None], beta=beta[None],
                                                  use_qk_l2norm_in_kernel=True)
    return out[0]


@pytest.mark.parametrize("chunk", [32, 64], ids=["cpu_chunk", "gpu_chunk"])  # linear_attention.chunk_size
@pytest.mark.parametrize("strength", [1.0, 8.0], ids=["decay", "strong_decay"])  # strong: exponents past -87
@pytest.mark.parametrize("per_channel", [False, True], ids=["gated_delta_net", "kda"])
def test_packed_scan_equals_each_document_alone_with_gradients(per_channel, strength, chunk):
    inputs = _inputs(per_channel, seed=1)
    weight = torch.randn(sum(LENGTHS), 2, 16, generator=torch.Generator().manual_seed(2))
    results = []
    for run in ("packed", "alone"):
        q, k, v, g_raw, beta_raw = inputs
        g, beta = -strength * F.softplus(g_raw), beta_raw.sigmoid()
        if run == "packed":
            out = gated_delta_rule_packed(q, k, v, g, beta, LENGTHS, chunk=chunk)
        else:
            docs = zip(*(x.split(LENGTHS) for x in (q, k, v, g, beta)), strict=True)
            out = torch.cat([_recurrent(per_channel, *doc) for doc in docs])
        results.append((out.detach(), torch.autograd.grad((out * weight).sum(), inputs)))
    (packed, grads), (alone, grads_ref) = results
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    for g, g_ref in zip(grads, grads_ref, strict=True):
        assert float((g - g_ref).abs().max()) <= 1e-4 * float(g_ref.abs().max())
