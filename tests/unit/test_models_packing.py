"""The seeds' model families train exactly packed: packed == one by one == transformers on each document."""

import pytest
import torch

from albatross.bench.packing import documents, measure, packed_vs_single, trainer_logprobs
from albatross.models import PACKED_PARTS, family, prepare_for_packing
from albatross.models.segments import lengths_from
from albatross.models.tiny import FAMILIES, TEXT_VOCAB, load_any, tiny_model

DOCS = (21, 34, 13)  # packed in one row; lengths past the tiny indexers' top-k budgets (8)
TOL = 1e-5
HYBRID = [f for f in FAMILIES if PACKED_PARTS[f]]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.mark.parametrize("name", FAMILIES)
def test_family_is_exact_packed_and_matches_transformers_alone(name):
    model = tiny_model(name)
    assert family(model) == name
    r = measure(model, documents(DOCS, TEXT_VOCAB))
    assert r["max_abs_logprob_diff"] <= TOL, r
    assert r["max_abs_diff_vs_transformers_alone"] <= TOL, r


@pytest.mark.parametrize("name", HYBRID)
def test_transformers_as_shipped_leaks_across_documents(name):
    """Without prepare_for_packing a document's log-probs change when another precedes it."""
    model = tiny_model(name)
    docs = documents(DOCS, TEXT_VOCAB)
    try:
        leak = packed_vs_single(model, docs, exact=False)
    except (ValueError, NotImplementedError):  # no flash-linear-attention: varlen boundaries refused
        leak = packed_vs_single(model, docs, attention="dense", exact=False)
    assert leak > 1e-3


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _logprob_grads(model: torch.nn.Module, docs: list[list[int]]) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    with torch.enable_grad():
        from albatross.bench.packing import _micro_batch
        from albatross.trainer.logprobs import TokenLogprobs
        from albatross.trainer.packing import attention_inputs

        mb = _micro_batch(docs)
        logp, _ = TokenLogprobs(model, chunk_size=16)(mb.input_ids, mb.position_ids, mb.targets,
                                                       **attention_inputs(model)(mb, torch.float32, "cpu"))
        logp.sum().backward()
    return _grads(model)


@pytest.mark.parametrize("name", ["qwen4_exp", "glm5_next"])
def test_packed_gradients_equal_the_sum_of_one_by_one_under_checkpointing(name):
    from albatross.trainer.model import enable_activation_checkpointing

    model = tiny_model(name).train()
    enable_activation_checkpointing(model)  # the backward recomputes segmented layers: same boundaries
    docs = documents((17, 26), TEXT_VOCAB)
    packed = _logprob_grads(model, docs)
    alone = [_logprob_grads(model, [d]) for d in docs]
    assert packed
    for n, g in packed.items():
        torch.testing.assert_close(g, sum(a[n] for a in alone if n in a), atol=1e-5, rtol=1e-4)


def test_prepared_model_saves_and_loads_with_the_same_names(tmp_path):
    model = prepare_for_packing(tiny_model("qwen3_next"))
    docs = documents(DOCS, TEXT_VOCAB)
    before = trainer_logprobs(model, docs)
    model.save_pretrained(tmp_path)
    loaded = load_any(tmp_path).eval()
    assert [n for n, _ in loaded.named_parameters()] == [n for n, _ in model.named_parameters()]
    torch.testing.assert_close(trainer_logprobs(loaded, docs), before, atol=1e-6, rtol=0)


def test_prepare_is_idempotent_and_generation_still_works():
    model = prepare_for_packing(prepare_for_packing(tiny_model("qwen3_next")))
    ids = torch.tensor([documents((9,), TEXT_VOCAB)[0]])
    ref = tiny_model("qwen3_next").generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), ref)


def test_document_lengths_from_boundaries_or_positions():
    assert lengths_from({"cu_seq_lens_q": torch.tensor([0, 3, 8])}, None) == [3, 5]
    assert lengths_from({}, torch.tensor([[0, 1, 2, 0, 1, 0]])) == [3, 2, 1]
    assert lengths_from({}, torch.tensor([[5]])) == []  # a decode step of a cached sequence
    assert lengths_from({}, torch.zeros(2, 4, dtype=torch.long)) == []  # a padded batch, not a packed row


def test_unknown_family_with_linear_attention_is_refused():
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3_5_text", vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, intermediate_size=32,
                                  layer_types=["linear_attention"], linear_num_key_heads=1,
                                  linear_num_value_heads=1, linear_key_head_dim=8, linear_value_head_dim=8)
    with pytest.raises(NotImplementedError, match="cannot pack exactly"):
        prepare_for_packing(AutoModelForCausalLM.from_config(config))


def test_modules_swapped_before_prepare_share_the_decoders_layout():
    """A part segmented by hand (say, to compare implementations) and the rest prepared later stay exact."""
    from albatross.models.segments import segmented, track_layout

    model = tiny_model("qwen4_exp")
    segmented(model.model.layers[0].linear_attn, track_layout(model.get_decoder()))
    prepare_for_packing(model)
    assert packed_vs_single(model, documents(DOCS, TEXT_VOCAB)) <= TOL


def test_bench_packing_on_a_model_directory_writes_its_figures(tmp_path, capsys):
    import argparse
    import json

    from albatross.bench.packing import run
    from albatross.errors import UserError

    tiny_model("qwen3_next").save_pretrained(tmp_path / "m")
    out = tmp_path / "packing.json"
    run(argparse.Namespace(model=str(tmp_path / "m"), lengths="19,30,12", json=str(out)))
    data = json.loads(out.read_text())
    assert data["family"] == "qwen3_next" and data["doc_lengths"] == [19, 30, 12]
    assert data["max_abs_logprob_diff"] <= TOL < data["as_shipped_max_abs_logprob_diff"]
    assert "qwen3_next albatross" in capsys.readouterr().out
    with pytest.raises(UserError, match="no config.json"):
        run(argparse.Namespace(model=str(tmp_path / "missing"), lengths="19", json=None))
