"""MTP heads (models/mtp.py): loaded from checkpoints instead of dropped, their forward, and trainer.mtp."""

import copy
import random

import pytest
import torch

from albatross.config import ConfigError, TrainerConfig
from albatross.models.mtp import (
    MTP_LAYOUT,
    MtpError,
    _fuse_experts,
    get_mtp,
    load_mtp,
    mtp_forward,
    save_pretrained_with_mtp,
)
from albatross.models.parts import resolve_freeze
from albatross.models.tiny import TEXT_VOCAB, tiny_model
from albatross.records import Batch, Sample, TrainSample
from albatross.trainer.model import load_model
from albatross.trainer.step import Trainer

FAMILIES = sorted(MTP_LAYOUT)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    rng = random.Random(seed)
    return torch.tensor([[rng.randrange(3, TEXT_VOCAB) for _ in range(n)]])


def _same_head(a, b) -> float:
    sa, sb = get_mtp(a).state_dict(), get_mtp(b).state_dict()
    assert sa.keys() == sb.keys()
    return max(float((sa[k] - sb[k]).abs().max()) for k in sa)


@pytest.mark.parametrize("layout", ["save_pretrained", "family_layout"])
@pytest.mark.parametrize("family", FAMILIES)
def test_load_round_trip_from_a_saved_directory(tmp_path, family, layout):
    """transformers drops the MTP weights at load; load_model reads them back, exactly, in either layout."""
    model = tiny_model(family, seed=3)
    if layout == "save_pretrained":
        model.save_pretrained(tmp_path)
    else:  # mtp.safetensors under the family's checkpoint names (DeepSeek layout: model.layers.{N}.*)
        save_pretrained_with_mtp(model, tmp_path)
    loaded = load_model(tmp_path)
    assert get_mtp(loaded) is not None and _same_head(model, loaded) == 0.0
    fresh = tiny_model(family, seed=3, mtp=False)
    fresh.load_state_dict(loaded.state_dict(), strict=False)
    assert load_mtp(fresh, tmp_path) == len(get_mtp(model).state_dict())


def test_deepseek_layout_uses_the_layer_after_the_last(tmp_path):
    from safetensors import safe_open

    model = tiny_model("glm_moe_dsa")
    save_pretrained_with_mtp(model, tmp_path)
    with safe_open(str(tmp_path / "mtp.safetensors"), "pt") as f:
        keys = set(f.keys())
    n = model.config.num_hidden_layers
    assert {f"model.layers.{n}.eh_proj.weight", f"model.layers.{n}.enorm.weight", f"model.layers.{n}.hnorm.weight",
            f"model.layers.{n}.shared_head.norm.weight", f"model.layers.{n}.shared_head.head.weight",
            f"model.layers.{n}.mlp.experts.0.gate_proj.weight"} <= keys
    assert not any(k.startswith("mtp.") for k in keys)


def test_expert_fusing_matches_transformers_on_the_main_layers(tmp_path):
    """The per-expert -> fused conversion is transformers' own: checked on a decoder layer it loads itself."""
    from safetensors import safe_open

    model = tiny_model("qwen3_next")
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        disk = {k: f.get_tensor(k) for k in f.keys() if k.startswith("model.layers.3.mlp.experts.")}
    fused = _fuse_experts(disk)
    own = model.state_dict()
    assert set(fused) == {"model.layers.3.mlp.experts.gate_up_proj", "model.layers.3.mlp.experts.down_proj"}
    assert all(torch.equal(fused[k], own[k]) for k in fused)


def test_a_checkpoint_without_mtp_weights(tmp_path):
    tiny_model("qwen3_next", mtp=False).save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    assert get_mtp(loaded) is None
    with pytest.raises(MtpError, match="no MTP weights"):
        load_mtp(loaded, tmp_path)
    with pytest.raises(MtpError, match="has no MTP head"):
        load_mtp(tiny_model("qwen3"), tmp_path)


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_shape_and_packed_equals_alone(family):
    """Logits [B, T, V]; documents of a packed row give what each gives alone (nothing crosses a boundary)."""
    model = tiny_model(family)
    head = get_mtp(model)
    ids = _ids(37)
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state
        packed = mtp_forward(model, hidden, ids, [9, 20, 8])
        alone = torch.cat([head(hidden[:, a:b], ids[:, a:b]) for a, b in ((0, 9), (9, 29), (29, 37))], dim=1)
        whole = head(hidden, ids)
    assert packed.shape == (1, 37, model.config.get_text_config().vocab_size)
    assert float((packed - alone).abs().max()) <= 1e-5
    assert float((packed[:, 9:] - whole[:, 9:]).abs().max()) > 1e-3  # unsegmented, the second document differs


def _batch(n: int = 3) -> Batch:
    rng = random.Random(0)
    samples = []
    for i in range(n):
        ids = [rng.randrange(3, TEXT_VOCAB) for _ in range(20 + 7 * i)]
        mask = [0] * 4 + [1] * (len(ids) - 4)
        samples.append(TrainSample(Sample(ids, mask, [-5.0 if m else 0.0 for m in mask],
                                          [0 if m else -1 for m in mask]), 1.0 if i % 2 else -1.0))
    return Batch(samples=samples, groups=1, min_version=0)


@pytest.mark.parametrize("family", ["qwen3_next", "glm_moe_dsa"])
def test_trained_mtp_never_moves_the_policy(family):
    """trainer.mtp = "train": the policy's gradients equal those without the MTP loss, bit for bit, and the
    head's parameters get gradients (through DETACHED hidden states and the shared embedding / LM head)."""
    model = tiny_model(family)
    with_mtp, without = copy.deepcopy(model), copy.deepcopy(model)
    a = Trainer(with_mtp, TrainerConfig(mtp="train", mtp_loss_weight=1.0))
    b = Trainer(without, TrainerConfig(mtp="frozen"))
    metrics = a.rl_gradients(_batch(), 0)
    b.rl_gradients(_batch(), 0)
    grads_b = {n: p.grad for n, p in without.named_parameters()}
    policy = [(n, p) for n, p in with_mtp.named_parameters() if not n.startswith("mtp.")]
    assert all(p.grad is not None for n, p in policy if grads_b[n] is not None)
    assert all(torch.equal(p.grad, grads_b[n]) for n, p in policy if grads_b[n] is not None)
    head = {n: p.grad for n, p in with_mtp.named_parameters() if n.startswith("mtp.")}
    assert all(float(head[n].abs().sum()) > 0 for n in ("mtp.fc.weight", "mtp.pre_fc_norm_hidden.weight",
                                                        "mtp.layers.0.input_layernorm.weight"))
    no_grad = [n for n, g in head.items() if g is None]
    assert all(".indexer." in n for n in no_grad)  # a DSA indexer's top-k passes no gradient (as in the model)
    assert metrics["mtp_tokens"] > 0 and metrics["mtp_loss"] > 0 and 0 <= metrics["mtp_accuracy"] <= 1


def test_trained_mtp_learns_and_logs_per_step():
    model = tiny_model("qwen3_next")
    before = copy.deepcopy(get_mtp(model).state_dict())
    trainer = Trainer(model, TrainerConfig(mtp="train", mtp_loss_weight=1.0, lr=1e-2))
    losses = [trainer.step(_batch())["mtp_loss"] for _ in range(4)]
    assert losses[-1] < losses[0]
    after = get_mtp(model).state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert any(k.startswith("mtp.") for k in trainer.model.state_dict())  # exported and checkpointed with the model


def test_frozen_mtp_has_no_gradients_and_no_optimizer_state():
    model = tiny_model("glm_moe_dsa")
    trainer = Trainer(model, TrainerConfig(mtp="frozen", lr=1e-2))
    before = copy.deepcopy(get_mtp(model).state_dict())
    metrics = trainer.step(_batch())
    head = list(get_mtp(model).parameters())
    assert all(not p.requires_grad and p.grad is None for p in head)
    in_optimizer = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    assert not in_optimizer & {id(p) for p in head}
    assert all(id(p) not in trainer.optimizer.state for p in head)
    assert all(torch.equal(before[k], v) for k, v in get_mtp(model).state_dict().items())
    assert "mtp_loss" not in metrics
    assert resolve_freeze(model, ["mtp"]) == [n for n, _ in model.named_parameters() if n.startswith("mtp.")]


def test_off_drops_the_head_and_train_without_one_is_a_config_error():
    model = tiny_model("qwen3_next")
    Trainer(model, TrainerConfig(mtp="off"))
    assert get_mtp(model) is None and not any(n.startswith("mtp.") for n, _ in model.named_parameters())
    with pytest.raises(ConfigError, match="no MTP head"):
        Trainer(tiny_model("qwen3"), TrainerConfig(mtp="train"))
    with pytest.raises(ConfigError, match="trainer.freeze"):
        Trainer(tiny_model("qwen3_next"), TrainerConfig(mtp="train", freeze=["mtp"]))
    with pytest.raises(ConfigError, match='trainer.mtp = "frozen"'):  # freezing a head that "off" drops
        Trainer(tiny_model("qwen3_next"), TrainerConfig(mtp="off", freeze=["mtp"]))
