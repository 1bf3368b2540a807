"""albatross' packed-aware layers equal transformers' on one document, and packed equals one by one."""

import pytest
import torch
import torch.nn.functional as F

from albatross.models.conv import causal_conv1d_packed, positions_in_documents
from albatross.models.linear_attention import gated_delta_net_forward, gated_delta_rule_packed, kda_forward
from albatross.models.tiny import tiny_model

LENGTHS = [70, 5, 129, 1, 64]  # past one 64-token chunk, shorter than the conv, exactly one chunk


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_positions_in_documents():
    assert positions_in_documents([3, 1, 2]).tolist() == [0, 1, 2, 0, 0, 1]


@pytest.mark.parametrize("dilation", [1, 3])
def test_causal_conv_never_reads_the_previous_document(dilation):
    torch.manual_seed(0)
    x, w, b = torch.randn(1, 6, sum(LENGTHS)), torch.randn(6, 4), torch.randn(6)
    packed = causal_conv1d_packed(x, w, b, LENGTHS, dilation=dilation)
    pad = 3 * dilation
    alone = [F.conv1d(F.pad(d, (pad, 0)), w[:, None], b, groups=6, dilation=dilation)
             for d in x.split(LENGTHS, dim=-1)]
    torch.testing.assert_close(packed, torch.cat(alone, dim=-1), atol=1e-5, rtol=1e-5)
    leaky = F.conv1d(F.pad(x, (pad, 0)), w[:, None], b, groups=6, dilation=dilation)
    assert (leaky - packed).abs().max() > 1e-2  # the unmasked conv reads across the boundary


def _recurrent_reference(q, k, v, g, beta):
    """transformers' token-by-token gated delta rule on one document ([1, n, H, d] inputs)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    out, _ = torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    return out[0]


def test_gated_delta_rule_matches_the_recurrent_form_per_document():
    torch.manual_seed(0)
    t, h = sum(LENGTHS), 3
    q, k, v = torch.randn(t, h, 8), torch.randn(t, h, 8), torch.randn(t, h, 16)
    g, beta = -F.softplus(torch.randn(t, h)), torch.rand(t, h)
    packed = gated_delta_rule_packed(q, k, v, g, beta, LENGTHS)
    parts = zip(*(x.split(LENGTHS) for x in (q, k, v, g, beta)), strict=True)
    alone = torch.cat([_recurrent_reference(*(x[None] for x in p)) for p in parts])
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    whole_row = _recurrent_reference(*(x[None] for x in (q, k, v, g, beta)))
    assert (whole_row - packed).abs().max() > 1e-2  # one state over the row leaks


@pytest.mark.parametrize("name", ["qwen3_next", "qwen4_exp"])
def test_gated_delta_net_equals_the_transformers_module(name):
    model = tiny_model(name)
    module = model.model.layers[0].linear_attn
    torch.manual_seed(1)
    h = torch.randn(1, sum(LENGTHS), model.config.hidden_size)
    with torch.no_grad():
        packed = gated_delta_net_forward(module, LENGTHS, h)
        alone = torch.cat([module(d, cache=None, attention_mask=None) for d in h.split(LENGTHS, dim=1)], dim=1)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-4)


def test_gated_delta_net_gradients_equal_the_transformers_module():
    model = tiny_model("qwen3_next")
    module = model.model.layers[0].linear_attn
    torch.manual_seed(2)
    h = torch.randn(1, 90, model.config.hidden_size)
    weight = torch.randn(1, 90, model.config.hidden_size)
    grads = []
    for run in (lambda x: gated_delta_net_forward(module, [90], x), lambda x: module(x, cache=None)):
        module.zero_grad(set_to_none=True)
        (run(h) * weight).sum().backward()
        grads.append({n: p.grad.clone() for n, p in module.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(g, grads[1][name], atol=1e-5, rtol=1e-4)


def test_kda_per_channel_decay_matches_the_recurrent_form_per_document():
    from transformers.models.glm5_next.modeling_glm5_next import recurrent_kimi_delta_attention

    torch.manual_seed(3)
    t, h = sum(LENGTHS), 2
    q, k, v = torch.randn(t, h, 8), torch.randn(t, h, 8), torch.randn(t, h, 8)
    g, beta = -0.5 * torch.rand(t, h, 8), torch.rand(t, h)
    packed = gated_delta_rule_packed(q, k, v, g, beta, LENGTHS)
    alone = []
    for p in zip(*(x.split(LENGTHS) for x in (q, k, v, g, beta)), strict=True):
        out, _ = recurrent_kimi_delta_attention(*(x[None] for x in p), initial_state=None,
                                                output_final_state=False, use_qk_l2norm_in_kernel=True)
        alone.append(out[0])
    torch.testing.assert_close(packed, torch.cat(alone), atol=1e-5, rtol=1e-5)


def test_kda_layer_equals_the_transformers_module():
    model = tiny_model("glm5_next")
    layers = model.model.language_model.layers
    module = next(layer.self_attn for layer in layers if layer.block_type == "linear_attention")
    torch.manual_seed(4)
    h = torch.randn(1, sum(LENGTHS), model.config.text_config.hidden_size)
    with torch.no_grad():
        packed = kda_forward(module, LENGTHS, h)
        alone = torch.cat([module(d, cache=None, attention_mask=None) for d in h.split(LENGTHS, dim=1)], dim=1)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-4)


def test_ple_ngram_layer_equals_the_transformers_module_per_document():
    from albatross.models.ngram import ple_forward

    model = tiny_model("qwen4_exp")
    module = model.model.layers[0].ple
    torch.manual_seed(5)
    with torch.no_grad():
        module.conv1d.weight.normal_()  # initialised to zero: make the dilated conv read its taps
    ids = torch.randint(3, 250, (1, sum(LENGTHS)))
    ids[0, [10, 11, 90]] = model.config.eos_token_id  # segments also restart after an EOS
    h = torch.randn(1, sum(LENGTHS), model.config.hidden_size * model.config.hc_count)
    with torch.no_grad():
        packed = ple_forward(module, LENGTHS, h, ids)
        parts = zip(h.split(LENGTHS, dim=1), ids.split(LENGTHS, dim=1), strict=True)
        alone = torch.cat([module(hd, idd, None) for hd, idd in parts], dim=1)
        leaky = module(h, ids, None)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-4)
    assert (leaky - packed).abs().max() > 1e-2  # transformers hashes and convolves across documents
