"""The study's trainer options are exact, installed by the trainer, refused where they cannot apply; and
``bench trainer --study --quick`` writes its keys in row order.

Exactness is against transformers' own modules (eager experts, the QSA indexer loop, the gated residual)
on tiny random models: log-probs equal to fp32 rounding and gradients to 1e-4 of each tensor's scale.
"""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

from albatross.config import TrainerConfig
from albatross.models import experts as ex
from albatross.models import hyper as hx
from albatross.models import indexer as ix
from albatross.models.masks import select_keys
from albatross.models.segments import is_segmented
from albatross.models.tiny import TEXT_VOCAB, tiny_model
from albatross.records import Sample, TrainSample
from albatross.trainer.logprobs import TokenLogprobs
from albatross.trainer.model import ModelOptionError, apply_model_options, keep_on_host
from albatross.trainer.packing import attention_inputs, pack

LENGTHS = [70, 5, 129, 64, 200]  # past the indexer's budget, shorter than a block, one block exactly


def _packed_row(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(3, TEXT_VOCAB, (n,), generator=gen).tolist() for n in LENGTHS]
    samples = [TrainSample(Sample(d, [1] * len(d), [0.0] * len(d), [0] * len(d)), 1.0) for d in docs]
    return pack(samples, 10_000)[0]


def _logprobs_and_grads(family: str, checkpointing: bool = False, saved: list[int] | None = None, **options):
    """Log-probs of one packed row and the gradients of a fixed weighting of them, with ``options`` installed
    (and activation checkpointing); ``saved`` gets the bytes the forward saved for the backward."""
    from albatross.trainer.model import enable_activation_checkpointing

    model = tiny_model(family, seed=0).train()
    if family != "qwen4_exp":
        model.set_experts_implementation("eager")
    apply_model_options(model, TrainerConfig(**options))
    if checkpointing:
        enable_activation_checkpointing(model)
    mb = _packed_row()
    policy = TokenLogprobs(model, chunk_size=64)
    attn = attention_inputs(model, "varlen")(mb, torch.float32, torch.device("cpu"))
    sizes = []

    def keep(t):
        sizes.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        logprobs, _ = policy(mb.input_ids, mb.position_ids, mb.targets, **attn)
    if saved is not None:
        saved.append(sum(sizes))
    (logprobs * torch.linspace(-1, 1, logprobs.numel())).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logprobs.detach(), grads


def _assert_same(ref, out):
    assert (out[0] - ref[0]).abs().max() <= 1e-5
    assert set(out[1]) == set(ref[1])
    for name, g in ref[1].items():
        scale = float(g.abs().max()) or 1.0
        assert float((out[1][name] - g).abs().max()) <= 1e-4 * scale, name


@pytest.fixture(scope="module")
def qwen4_reference():
    torch.manual_seed(0)
    return _logprobs_and_grads("qwen4_exp")


@pytest.mark.parametrize("option", ["grouped_experts", "fast_indexer", "fused_hyper"])
def test_each_option_is_exact_on_a_packed_row(qwen4_reference, option):
    _assert_same(qwen4_reference, _logprobs_and_grads("qwen4_exp", **{option: True}))


def test_all_options_together_are_exact(qwen4_reference):
    _assert_same(qwen4_reference, _logprobs_and_grads("qwen4_exp", grouped_experts=True, fast_indexer=True,
                                                      fused_hyper=True))


def test_fused_layers_keep_activation_checkpointing(qwen4_reference):
    """transformers checkpoints each layer class's ``forward``: the fused layers (a subclass, not an instance
    ``forward``) are still checkpointed, so their forward saves far less for the backward, and stay exact."""
    plain, checkpointed = [], []
    _assert_same(qwen4_reference, _logprobs_and_grads("qwen4_exp", saved=plain, fused_hyper=True))
    _assert_same(qwen4_reference, _logprobs_and_grads("qwen4_exp", checkpointing=True, saved=checkpointed,
                                                      fused_hyper=True, grouped_experts=True, fast_indexer=True))
    assert checkpointed[0] < plain[0] / 3


def test_checkpointed_layers_leave_the_fast_indexers_attention_out_of_their_recompute(qwen4_reference, monkeypatch):
    """Under activation checkpointing a fused layer with the fast indexer's (self-checkpointing) attention is
    checkpointed around it: the indexer selects once per document, not again in the layer's recompute; the
    linear-attention layers are still recomputed whole, and the result stays exact."""
    calls = {"select": 0}
    select = ix.qsa_select

    def counting(*args, **kwargs):
        calls["select"] += 1
        return select(*args, **kwargs)

    monkeypatch.setattr(ix, "qsa_select", counting)
    saved: list[int] = []
    options = {"fused_hyper": True, "grouped_experts": True, "fast_indexer": True}
    _assert_same(qwen4_reference, _logprobs_and_grads("qwen4_exp", saved=saved, **options))
    once = calls["select"]
    assert once > 0
    calls["select"] = 0
    checkpointed: list[int] = []
    _assert_same(qwen4_reference, _logprobs_and_grads("qwen4_exp", checkpointing=True, saved=checkpointed,
                                                      **options))
    assert calls["select"] == once  # not again in a recompute
    assert checkpointed[0] < saved[0] / 3
    model = tiny_model("qwen4_exp", seed=0)
    apply_model_options(model, TrainerConfig(**options))
    from albatross.trainer.model import enable_activation_checkpointing

    enable_activation_checkpointing(model)
    layers = model.get_decoder().layers
    assert all(layer.__dict__["_albatross_checkpointing"] for layer in layers)
    # transformers' wrapper checkpoints the linear-attention layers whole, the indexed ones not
    assert {layer.layer_type: layer.gradient_checkpointing for layer in layers} == {
        "linear_attention": True, "indexed_attention": False}


def test_options_change_the_computation():
    """The installed forwards are the ones that run: the swapped modules no longer call transformers'."""
    model = tiny_model("qwen4_exp", seed=0)
    done = apply_model_options(model, TrainerConfig(grouped_experts=True, fast_indexer=True, fused_hyper=True))
    layers = len(model.model.layers)  # 4: the indexed attention is the last; plus the final stream mixer
    assert done == {"grouped_experts": len(ex.expert_modules(model)), "fast_indexer": 1, "fused_hyper": layers + 1}
    assert done["grouped_experts"] >= layers
    layer = model.model.layers[3]
    assert type(layer).forward is hx.fused_class(type(layer)).forward
    assert type(layer).__name__ == "Qwen4ExpTextDecoderLayer" and type(layer).__mro__[1].__name__ == type(layer).__name__
    assert layer.mlp.experts.forward.func is ex.grouped_experts_forward
    assert is_segmented(layer.self_attn)


def _experts_case(seed: int):
    model = tiny_model("qwen3_moe", seed=seed)
    module = ex.expert_modules(model)[0]
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(37, module.gate_up_proj.shape[-1], generator=gen, requires_grad=True)
    scores = torch.randn(37, module.num_experts, generator=gen).softmax(-1)
    weights, index = scores.topk(2, dim=-1)
    return model, module, hidden, index, weights.requires_grad_()


def test_grouped_experts_equal_transformers_eager_with_gradients():
    model, module, hidden, index, weights = _experts_case(1)
    model.set_experts_implementation("eager")
    ref = module(hidden, index, weights)
    grads_ref = torch.autograd.grad(ref.square().sum(), [hidden, weights, module.gate_up_proj, module.down_proj])
    out = ex.grouped_experts_forward(module, hidden, index, weights)
    grads = torch.autograd.grad(out.square().sum(), [hidden, weights, module.gate_up_proj, module.down_proj])
    assert (out - ref).abs().max() <= 1e-6
    for g, r in zip(grads, grads_ref, strict=True):
        assert (g - r).abs().max() <= 1e-5 * max(1.0, float(r.abs().max()))


def test_grouped_matmul_loop_fallback_equals_grouped_kernel():
    x = torch.randn(13, 16)
    w = torch.randn(3, 16, 8)
    offsets = torch.tensor([4, 4, 13], dtype=torch.int32)
    ref = torch.cat([x[:4] @ w[0], x[4:13] @ w[2]])
    assert ex._use_grouped_mm(x, w)
    assert (ex.grouped_mm(x, w, offsets) - ref).abs().max() <= 1e-5
    odd_x, odd_w = torch.randn(13, 15), torch.randn(3, 15, 7)  # strides off 16 bytes: the loop
    assert not ex._use_grouped_mm(odd_x, odd_w)
    odd_ref = torch.cat([odd_x[:4] @ odd_w[0], odd_x[4:] @ odd_w[2]])
    assert (ex.grouped_mm(odd_x, odd_w, offsets) - odd_ref).abs().max() <= 1e-5


def _indexer_inputs(model, n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, n, model.config.hidden_size, generator=gen)
    cos, sin = model.model.rotary_emb(hidden, torch.arange(n)[None].expand(3, 1, n))
    return hidden, cos, sin


@pytest.mark.parametrize("n", [9, 40, 200, 400])
def test_qsa_selection_equals_transformers_per_document(n):
    model = tiny_model("qwen4_exp", seed=0)
    indexer = model.model.layers[3].self_attn.indexer
    for seed in range(3):
        hidden, cos, sin = _indexer_inputs(model, n, seed)
        causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
        ref = indexer(hidden, (cos, sin), causal, None)
        mine = select_keys(None, ix.qsa_select(indexer, hidden[0], cos[0], sin[0])[None], n)
        assert torch.equal(mine, ref), (n, seed)


def test_tied_scores_are_broken_as_transformers_breaks_them():
    """Rows whose k-th and (k+1)-th block scores tie (relu zeros) exist, batched top-k can pick another
    block for some, and the selection still equals transformers' (the exact per-row recomputation)."""
    model = tiny_model("qwen4_exp", seed=0)
    indexer = model.model.layers[3].self_attn.indexer
    n, d, r, k = 400, indexer.index_head_dim, indexer.compress_ratio, indexer.block_topk
    hidden, cos, sin = _indexer_inputs(model, n, 5)
    q, raw = torch.split(indexer.index_qk_proj(hidden[0]), [indexer.index_n_heads * d, d], dim=-1)
    q = ix._rope(indexer)(indexer.q_layernorm(q.reshape(n, -1, d))[None], cos=cos, sin=sin, unsqueeze_dim=2)[0]
    keys = ix.block_keys(indexer, raw, cos[0], sin[0])
    visible = (torch.arange(n) + 1) // r
    scores = ix._block_scores(q, keys, d).masked_fill(torch.arange(keys.shape[0])[None] >= visible[:, None],
                                                      float("-inf"))
    top = scores.topk(k + 1, dim=-1)
    ties = torch.nonzero((visible > k) & (top.values[:, k - 1] == top.values[:, k])).flatten().tolist()
    assert ties
    differs = [i for i in ties if set(top.indices[i, :k].tolist())
               != set(ix._exact_row(q[i], keys, int(visible[i]), k, d).tolist())]
    assert differs  # the batched choice alone would be wrong here
    ref = indexer(hidden, (cos, sin), torch.ones(n, n, dtype=torch.bool).tril()[None, None], None)
    assert torch.equal(select_keys(None, ix.qsa_select(indexer, hidden[0], cos[0], sin[0])[None], n), ref)


def test_gathered_and_masked_sparse_attention_agree_with_dense_masked_sdpa():
    gen = torch.Generator().manual_seed(3)
    n, h, kv, d = 50, 4, 2, 8
    q, k, v = (torch.randn(n, heads, d, generator=gen, requires_grad=True) for heads in (h, kv, kv))
    idx = torch.stack([torch.cat([torch.randperm(i + 1, generator=gen)[: min(i + 1, 7)],
                                  torch.full((7 - min(i + 1, 7),), -1)]) for i in range(n)])
    mask = select_keys(None, idx[None], n)[0, 0]
    ref = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(2, 0),
                                                           v.transpose(0, 1).repeat_interleave(2, 0), attn_mask=mask,
                                                           scale=0.3).transpose(0, 1)
    for fn in (ix._attend, ix._attend_masked):
        out = fn(q, k, v, idx, 0.3)
        assert (out - ref).abs().max() <= 1e-5
        grads = torch.autograd.grad(out.sum(), [q, k, v])
        grads_ref = torch.autograd.grad(ref.sum(), [q, k, v], retain_graph=True)
        for g, r in zip(grads, grads_ref, strict=True):
            assert (g - r).abs().max() <= 1e-5


def test_options_the_model_lacks_are_refused():
    model = tiny_model("qwen3", seed=0)
    for option in ("grouped_experts", "fast_indexer", "fused_hyper"):
        with pytest.raises(ModelOptionError, match=f"trainer.{option}"):
            apply_model_options(model, TrainerConfig(**{option: True}))
    with pytest.raises(ModelOptionError, match="ngram"):
        keep_on_host(model, ["ngram"])
    with pytest.raises(ModelOptionError, match="expected one of"):
        keep_on_host(tiny_model("qwen4_exp"), ["experts"])


def test_host_params_keep_the_ngram_tables_on_the_host_and_train():
    from albatross.trainer.step import Trainer

    model = tiny_model("qwen4_exp", seed=0)
    tables = [m.ngram_embedding.weight for m in model.modules() if type(m).__name__.endswith("NGramEmbedding")]
    knobs = TrainerConfig(host_params=["ngram"], offload_optimizer=True, micro_batch_tokens=1024, lr=1e-2)
    trainer = Trainer(model, knobs)
    assert trainer.model_options["host_param_bytes"] == sum(t.numel() * 4 for t in tables)
    assert all(t.device.type == "cpu" for t in tables)
    before = [t.detach().clone() for t in tables]
    mb_samples = [TrainSample(Sample(list(range(3, 60)), [1] * 57, [-5.0] * 57, [0] * 57), 1.0)]
    from albatross.records import Batch

    trainer.step(Batch(samples=mb_samples, groups=1, min_version=0))
    assert any(not torch.equal(b, t) for b, t in zip(before, tables, strict=True))


def test_config_options_reach_the_trainer():
    from albatross.config import RunConfig
    from albatross.trainer.step import Trainer

    cfg = RunConfig.model_validate({"trainer": {"grouped_experts": True, "fast_indexer": True, "fused_hyper": True,
                                                "host_params": ["ngram"]}})
    trainer = Trainer.from_config(tiny_model("qwen4_exp", seed=0), cfg)
    assert set(trainer.model_options) == {"grouped_experts", "fast_indexer", "fused_hyper", "host_param_bytes"}


@pytest.mark.background([sys.executable, "-m", "albatross.cli", "bench", "trainer", "--study", "--quick", "--json",
                         "{dir}/study.json", "--study-budget-s", "1",  # the context search's sure lengths only
                         "--study-memory-gib", "1"])
def test_study_quick_writes_its_keys_in_row_order(background):
    """``bench trainer --study --quick``: every key, rows 0..9 in order, one first-step loss (the command runs
    while the session's other tests do: tests/background.py)."""
    from albatross.bench import study

    assert background.returncode == 0, background.stdout[-3000:] + background.stderr[-3000:]
    data = json.loads((background.dir / "study.json").read_text())
    assert [r["name"] for r in data["study"]] == [name for name, _ in study.ROWS] + [study.CONTEXT_ROW]
    for row in data["study"][:-1]:
        assert row["tokens_per_s"] > 0 and row["peak_gib"] > 0 and row["matmul_gflops"] > 0
        assert math.isclose(row["ratio"], row["tokens_per_s"] / data["study"][0]["tokens_per_s"])
    assert data["same_first_loss"] is True
    assert data["cumulative_speedup"] == data["study"][8]["tokens_per_s"] / data["study"][0]["tokens_per_s"]
    seed_only = data["seed_parts_only"]  # row 8 with the embedding trained, measured in the same run
    assert seed_only["name"] == study.SEED_PARTS_ONLY and "embed" not in seed_only["options"]["freeze"]
    assert "embed" in data["study"][8]["options"]["freeze"] and seed_only["tokens_per_s"] > 0
    assert data["context_baseline"] > 0 and data["max_context_measured"] >= data["context_baseline"]


@pytest.mark.parametrize("family", ["qwen3_next", "glm_moe_dsa"])
def test_study_rows_run_on_a_model_directory_of_another_family(tmp_path, family):
    """``--study --model DIR``: options the family lacks are dropped, and a loaded MTP head is kept frozen in
    row 8 (the trainer's default ``mtp = "off"`` would drop it, and freezing a dropped head is refused)."""
    from albatross.bench import study
    from albatross.models.mtp import get_mtp

    tiny_model(family, seed=0).save_pretrained(tmp_path)
    spec = {"device": "cpu", "model": str(tmp_path), "micro_batch_tokens": 512}
    losses = []
    for options in (study.row_options(0), study.row_options(len(study.ROWS) - 1)):
        step, model = study.make_step({**spec, "options": options})
        losses.append(float(step(study.batch_of([40, 90, 25], study.vocab_of(model)))["loss"]))
    head = get_mtp(model)
    assert head is not None and not any(p.requires_grad for p in head.parameters())
    assert "fast_indexer" not in study.applicable(model, study.row_options(8))  # no QSA in these families
    assert math.isclose(losses[0], losses[1], rel_tol=1e-4)


def test_first_loss_check_accepts_a_padded_baseline_only_where_the_documents_alone_agree():
    from albatross.bench.study import first_loss_check

    def never():
        raise AssertionError("not asked for when row 0 agrees")

    assert first_loss_check([3.0, 3.0000001], [3.0], never, "cpu")["same_first_loss"] is True
    out = first_loss_check([0.424876, 0.424876], [0.425597], lambda: 0.4248760, "cpu")  # glm_moe_dsa's numbers
    assert out["same_first_loss"] is False and out["documents_alone"] == 0.424876 and "padding" in out["note"]
    with pytest.raises(AssertionError, match="each trajectory alone"):
        first_loss_check([0.424876], [0.425597], lambda: 0.425597, "cpu")
    with pytest.raises(AssertionError, match="rows 1-8 disagree"):
        first_loss_check([3.0, 3.1], [3.0], never, "cpu")
