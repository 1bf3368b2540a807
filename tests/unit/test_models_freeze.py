"""Freezing by part name (first_layers:N, embed, ngram, indexer, mtp, vision, router) besides glob patterns."""

import functools
import random

import pytest
import torch

from albatross.config import TrainerConfig
from albatross.models.parts import part_sizes, resolve_freeze
from albatross.models.tiny import TEXT_VOCAB, tiny_model
from albatross.records import Batch, Sample, TrainSample
from albatross.trainer.model import freeze
from albatross.trainer.step import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def qwen4():
    return tiny_model("qwen4_exp", mtp=False)  # without its MTP head, so "mtp" is a part it lacks


def test_first_layers_selects_exactly_the_first_decoder_layers(qwen4):
    names = resolve_freeze(qwen4, ["first_layers:2"])
    expected = [n for n, _ in qwen4.named_parameters() if n.startswith(("model.layers.0.", "model.layers.1."))]
    assert names == expected and names


@pytest.mark.parametrize("part,fragment", [("ngram", ".ple.ple_embedding.ngram_embedding."),
                                           ("indexer", ".self_attn.indexer."), ("router", ".mlp.gate.")])
def test_part_names_select_their_modules(qwen4, part, fragment):
    names = resolve_freeze(qwen4, [part])
    assert names and all(fragment in n for n in names)
    assert len(names) == sum(fragment in n for n, _ in qwen4.named_parameters())


def test_parts_and_globs_combine_without_repeats(qwen4):
    names = resolve_freeze(qwen4, ["indexer", "model.layers.3.*", "ngram"])
    assert len(names) == len(set(names))
    assert any(".indexer." in n for n in names) and any(n.startswith("model.layers.3.") for n in names)


@pytest.mark.parametrize("spec,match", [("mtp", "no mtp"), ("vision", "no vision"), ("first_layers:9", "only 4"),
                                        ("first_layers:x", "N >= 1"), ("model.layer.*", "matches no parameter")])
def test_a_part_the_model_lacks_is_a_clear_error(qwen4, spec, match):
    with pytest.raises(ValueError, match=match):
        resolve_freeze(qwen4, [spec])


def test_vision_tower_of_glm5_next():
    model = tiny_model("glm5_next", mtp=False)
    names = resolve_freeze(model, ["vision"])
    assert names and all(n.startswith("model.visual.") for n in names)
    assert set(part_sizes(model)) == {"indexer", "vision", "router"}


def _batch(n_samples: int = 3) -> Batch:
    rng = random.Random(0)
    samples = []
    for i in range(n_samples):
        ids = [rng.randrange(3, TEXT_VOCAB) for _ in range(20 + 7 * i)]
        mask = [0] * 4 + [1] * (len(ids) - 4)
        samples.append(TrainSample(Sample(ids, mask, [-5.0 if m else 0.0 for m in mask],
                                          [0 if m else -1 for m in mask]), 1.0 if i % 2 else -1.0))
    return Batch(samples=samples, groups=1, min_version=0)


def test_trainer_freezes_parts_gives_them_no_optimizer_state_and_trains_the_rest():
    model = tiny_model("qwen4_exp")
    specs = ["first_layers:1", "ngram", "indexer", "router"]
    trainer = Trainer(model, TrainerConfig(lr=1e-2, micro_batch_tokens=64, freeze=specs))
    frozen = set(resolve_freeze(model, specs))
    assert set(trainer.frozen) == frozen
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    metrics = trainer.step(_batch())
    assert torch.isfinite(torch.tensor(metrics["loss"]))
    params = dict(model.named_parameters())
    in_optimizer = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    stateful = {id(p) for p in trainer.optimizer.state}
    for name, p in params.items():
        if name in frozen:
            assert id(p) not in in_optimizer and id(p) not in stateful
            assert torch.equal(p, before[name]), name
    moved = [n for n, p in params.items() if n not in frozen and not torch.equal(p, before[n])]
    assert moved and stateful


def test_freeze_marks_parameters_and_returns_their_names():
    model = tiny_model("glm_moe_dsa")
    names = freeze(model, ["router"])
    assert names and all(not p.requires_grad for n, p in model.named_parameters() if n in names)
    assert all(p.requires_grad for n, p in model.named_parameters() if n not in names)


def test_embed_selects_the_input_embedding_and_is_refused_where_the_head_shares_it(qwen4):
    assert resolve_freeze(qwen4, ["embed"]) == ["model.embed_tokens.weight"]
    with pytest.raises(ValueError, match="ties its input embedding to the LM head"):
        resolve_freeze(tiny_model("qwen3", tie_word_embeddings=True), ["embed"])


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_frozen_bottom_stops_the_backward_and_trains_the_rest_as_before(checkpointing):
    """Frozen embedding and first layer: layer 0 runs once per micro-batch (no graph, no recompute under
    checkpointing) and the trainable parameters get the gradients they get with the embedding trainable."""
    specs = ["embed", "first_layers:1", "ngram", "indexer"]
    grads = {}
    for bottom in (specs, specs[1:]):
        model = tiny_model("qwen4_exp", mtp=False, seed=0)
        trainer = Trainer(model, TrainerConfig(lr=1e-2, micro_batch_tokens=256, freeze=bottom,
                                               activation_checkpointing=checkpointing))
        calls = []
        mlp = model.get_decoder().layers[0].mlp

        def counted(log, forward, *args, **kwargs):
            log.append(0)
            return forward(*args, **kwargs)

        mlp.forward = functools.partial(counted, calls, mlp.forward)
        assert torch.isfinite(torch.tensor(trainer.rl_gradients(_batch(), current_version=0)["loss"]))
        grads[len(bottom)] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        if bottom is specs:
            assert calls.count(0) == 1  # no recompute of the frozen layer
            assert "model.embed_tokens.weight" not in grads[len(bottom)]
        else:
            assert calls.count(0) == (2 if checkpointing else 1)  # a trainable embedding needs its backward
    trained = grads[len(specs)]
    assert trained and set(trained) == set(grads[len(specs) - 1]) - {"model.embed_tokens.weight"}
    for name, g in trained.items():
        torch.testing.assert_close(g, grads[len(specs) - 1][name], rtol=1e-5, atol=1e-6, msg=name)
