"""Memory and speed techniques of the trainer: each must leave the maths unchanged, and do its job."""

import math
import random

import pytest
import torch

from albatross.config import RLConfig, TrainerConfig
from albatross.records import Batch, Sample, TrainSample
from albatross.trainer.distributed import assign, decoder_layers
from albatross.trainer.logprobs import TokenLogprobs, chunked_logprobs, full_logprobs
from albatross.trainer.model import freeze, tiny_causal_lm
from albatross.trainer.offload import HostOffloadAdamW
from albatross.trainer.packing import MicroBatch, pack, varlen_attention
from albatross.trainer.step import Trainer

VOCAB = 300


def make_batch(lengths: list[int], advantages: list[float], seed: int = 0, version: int = 0) -> Batch:
    rng = random.Random(seed)
    samples = []
    for n, adv in zip(lengths, advantages, strict=True):
        mask = [0] * 3 + [1] * (n - 3)
        sample = Sample(token_ids=[rng.randrange(VOCAB) for _ in range(n)], loss_mask=mask,
                        logprobs=[-rng.uniform(4.0, 7.0) if m else 0.0 for m in mask],
                        versions=[version if m else -1 for m in mask])
        samples.append(TrainSample(sample, adv))
    return Batch(samples=samples, groups=1, min_version=version)


BATCH = make_batch([14, 9, 11, 6], [1.0, -0.5, 0.25, -1.0])


def params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# activation checkpointing --------------------------------------------------------------------------


def _saved_bytes_and_grads(trainer: Trainer) -> tuple[int, dict[str, torch.Tensor]]:
    """Bytes autograd keeps for the backward (outside recomputed regions), and the gradients."""
    saved = 0

    def pack_hook(t: torch.Tensor) -> torch.Tensor:
        nonlocal saved
        saved += t.numel() * t.element_size()
        return t

    (mb,) = pack(BATCH.samples, 4096)
    with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
        logprobs, _ = trainer.forward_logprobs(mb)
    (logprobs * mb.loss_mask).sum().backward()
    return saved, {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


def test_activation_checkpointing_same_gradients_fewer_saved_activations():
    plain, plain_grads = _saved_bytes_and_grads(Trainer(tiny_causal_lm(VOCAB, 64, 4)))
    ckpt, ckpt_grads = _saved_bytes_and_grads(
        Trainer(tiny_causal_lm(VOCAB, 64, 4), TrainerConfig(activation_checkpointing=True))
    )
    assert ckpt < plain / 3
    for name, g in plain_grads.items():
        torch.testing.assert_close(ckpt_grads[name], g, atol=1e-6, rtol=1e-5)


# chunked log-probs ---------------------------------------------------------------------------------


def test_token_logprobs_chunked_equals_full_logits():
    model = tiny_causal_lm(VOCAB)
    (mb,) = pack(BATCH.samples, 4096)
    chunked = TokenLogprobs(model, chunk_size=5)(mb.input_ids, mb.position_ids, mb.targets)
    full = TokenLogprobs(model, chunk_size=None)(mb.input_ids, mb.position_ids, mb.targets)
    for a, b in zip(chunked, full, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _step_grads(**options) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    trainer = Trainer(tiny_causal_lm(VOCAB, 64, 2), TrainerConfig(**options), RLConfig(kl_coef=0.1, entropy_coef=0.01))
    metrics = trainer.rl_gradients(BATCH, current_version=0)
    return metrics, {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def test_head_at_loss_tokens_only_gives_the_same_loss_metrics_and_gradients():
    model = tiny_causal_lm(VOCAB)
    (mb,) = pack(BATCH.samples, 4096)
    mask = mb.loss_mask > 0
    full_lp, full_ent = TokenLogprobs(model, chunk_size=5)(mb.input_ids, mb.position_ids, mb.targets)
    lp, ent = TokenLogprobs(model, chunk_size=5)(mb.input_ids, mb.position_ids, mb.targets, score_mask=mask)
    torch.testing.assert_close(lp[mask], full_lp[mask], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent[mask], full_ent[mask], atol=1e-6, rtol=1e-6)
    assert not lp[~mask].any() and not ent[~mask].any() and bool((full_lp[~mask] != 0).all())
    # no loss token at all (an FSDP rank's padding micro-batch): the head and layers still get (zero) gradients
    empty = torch.zeros_like(mask)
    lp, _ = TokenLogprobs(model, chunk_size=5)(mb.input_ids, mb.position_ids, mb.targets, score_mask=empty)
    lp.sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert float(lp[0]) == pytest.approx(float(full_lp[0]), abs=1e-6) and not lp[1:].any()
    ref_metrics, ref_grads = _step_grads(logprob_loss_only=False)
    metrics, grads = _step_grads(logprob_loss_only=True)
    assert set(grads) == set(ref_grads)
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, atol=1e-6, rtol=1e-5)
    for key in ("loss", "kl_penalty", "entropy_bonus", "entropy", "mismatch_kl", "tokens"):
        assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-5, abs=1e-7), key


def test_the_head_at_loss_tokens_only_is_the_trainer_default():
    from albatross.config import RunConfig

    assert RunConfig().trainer.logprob_loss_only
    off = RunConfig.model_validate({"trainer": {"logprob_loss_only": False}})
    assert Trainer.from_config(tiny_causal_lm(VOCAB), off).loss_only is False


def test_full_logprobs_by_hand():
    head = torch.nn.Linear(2, 3, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]]))
    hidden, targets = torch.tensor([[0.0, 0.0], [1.0, 0.0]]), torch.tensor([2, 0])
    lp, ent = full_logprobs(hidden, head, targets)
    # first token: logits (0, 0, 0), uniform; second: logits (1, 0, 0)
    assert lp.tolist() == pytest.approx([-math.log(3), 1 - math.log(2 + math.e)])
    assert ent[0].item() == pytest.approx(math.log(3))
    cl, _ = chunked_logprobs(hidden, head, targets, chunk_size=1)
    torch.testing.assert_close(cl, lp)


# document masking ----------------------------------------------------------------------------------


def test_varlen_attention_sliding_window_matches_band_mask():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    cu = torch.tensor([0, 4, 7], dtype=torch.int32)
    out, _ = varlen_attention(torch.nn.Module(), q, k, v, None, sliding_window=2, cu_seq_lens_q=cu)
    expected = []
    for s, e in ((0, 4), (4, 7)):
        scores = q[:, :, s:e] @ k[:, :, s:e].transpose(-1, -2) / 8**0.5
        i = torch.arange(e - s)
        allowed = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < 2)
        expected.append(scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v[:, :, s:e])
    torch.testing.assert_close(out, torch.cat(expected, 2).transpose(1, 2), atol=1e-5, rtol=1e-5)


def test_varlen_attention_refuses_what_sdpa_cannot_do():
    q = torch.randn(1, 2, 4, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match="softcap"):
        varlen_attention(torch.nn.Module(), q, q, q, None, cu_seq_lens_q=cu, softcap=30.0)


def test_varlen_model_still_generates_like_sdpa():
    # The varlen implementation falls back to sdpa without sample boundaries (engine, padded batches).
    ids = torch.randint(0, VOCAB, (2, 9))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    ref = tiny_causal_lm(VOCAB)(input_ids=ids, attention_mask=mask).logits
    trainer = Trainer(tiny_causal_lm(VOCAB), TrainerConfig(attention="varlen"))
    out = trainer.model(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(out[0], ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1, 3:], ref[1, 3:], atol=1e-5, rtol=1e-5)


def test_attention_mode_checked_at_start_up():
    with pytest.raises(ValueError, match="attention"):  # the config refuses the name
        Trainer(tiny_causal_lm(VOCAB), TrainerConfig(attention="ring"))
    with pytest.raises(ValueError, match="flash"):
        Trainer(tiny_causal_lm(VOCAB), TrainerConfig(attention="flash"))


# frozen modules ------------------------------------------------------------------------------------


def test_frozen_parameters_get_no_gradient_and_no_update():
    knobs = TrainerConfig(lr=1e-2, freeze=["model.layers.0.*", "model.norm.weight"])
    trainer = Trainer(tiny_causal_lm(VOCAB), knobs)
    before = params(trainer.model)
    trainer.step(BATCH)
    after = params(trainer.model)
    frozen = set(trainer.frozen)
    assert "model.layers.0.mlp.up_proj.weight" in frozen and "model.norm.weight" in frozen
    assert not any(n.startswith("model.layers.1.") for n in frozen)
    in_optimizer = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    for name, p in trainer.model.named_parameters():
        assert (id(p) in in_optimizer) == (name not in frozen)
        assert p.grad is None
        changed = not torch.equal(before[name], after[name])
        assert changed == (name not in frozen), name


def test_freeze_pattern_must_match():
    with pytest.raises(ValueError, match="matches no parameter"):
        freeze(tiny_causal_lm(VOCAB), ["model.layer.*"])


# optimizer offload ---------------------------------------------------------------------------------


def test_host_offload_optimizer_equals_adamw():
    plain = Trainer(tiny_causal_lm(VOCAB), TrainerConfig(lr=1e-2, weight_decay=0.1))
    offload = Trainer(tiny_causal_lm(VOCAB), TrainerConfig(lr=1e-2, weight_decay=0.1, offload_optimizer=True))
    assert isinstance(offload.optimizer, HostOffloadAdamW)
    for _ in range(3):
        a, b = plain.step(BATCH), offload.step(BATCH)
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
    pa, pb = params(plain.model), params(offload.model)
    for name in pa:
        torch.testing.assert_close(pa[name], pb[name], atol=1e-6, rtol=1e-6)
    opt = offload.optimizer
    assert all(m.data_ptr() != p.data_ptr() for m, p in zip(opt.masters, opt.params, strict=True))
    n = sum(p.numel() for p in opt.params)
    assert opt.state_bytes() >= 12 * n  # fp32 masters + two moments, all on the host


def test_host_offload_optimizer_resumes(tmp_path):
    a = Trainer(tiny_causal_lm(VOCAB, seed=1), TrainerConfig(lr=1e-2, offload_optimizer=True))
    a.step(BATCH)
    a.save(tmp_path / "state.pt")
    b = Trainer(tiny_causal_lm(VOCAB, seed=2), TrainerConfig(lr=1e-2, offload_optimizer=True))
    b.load(tmp_path / "state.pt")
    assert a.step(BATCH)["loss"] == b.step(BATCH)["loss"]


# precision -----------------------------------------------------------------------------------------


def test_bf16_autocast_close_to_fp32():
    fp32 = Trainer(tiny_causal_lm(VOCAB), TrainerConfig(precision="fp32")).rl_gradients(BATCH, 0)
    bf16 = Trainer(tiny_causal_lm(VOCAB), TrainerConfig(precision="bf16"))
    (mb,) = pack(BATCH.samples, 4096)
    logprobs, _ = bf16.forward_logprobs(mb)
    assert logprobs.dtype == torch.float32
    metrics = bf16.rl_gradients(BATCH, 0)
    assert metrics["loss"] == pytest.approx(fp32["loss"], rel=3e-2)
    assert metrics["loss"] != fp32["loss"]  # it really ran in bf16
    with pytest.raises(ValueError, match="precision"):
        Trainer(tiny_causal_lm(VOCAB), TrainerConfig(precision="fp16"))


# extra loss terms ----------------------------------------------------------------------------------


def test_optional_kl_and_entropy_terms():
    base = Trainer(tiny_causal_lm(VOCAB)).rl_gradients(BATCH, 0)
    assert "kl_penalty" not in base and "entropy_bonus" not in base
    both = Trainer(tiny_causal_lm(VOCAB), rl=RLConfig(kl_coef=0.1, entropy_coef=0.01)).rl_gradients(BATCH, 0)
    assert both["kl_penalty"] == pytest.approx(0.1 * both["mismatch_kl"], rel=1e-5)
    assert both["entropy_bonus"] == pytest.approx(-0.01 * both["entropy"], rel=1e-5)
    assert both["loss"] == pytest.approx(base["loss"], rel=1e-6)  # the policy term alone


def test_entropy_bonus_gradient_raises_entropy():
    batch = make_batch([14, 9], [0.0, 0.0])  # no policy gradient: only the entropy term moves weights
    trainer = Trainer(tiny_causal_lm(VOCAB), TrainerConfig(lr=3e-3), RLConfig(entropy_coef=1.0))
    first = trainer.step(batch)["entropy"]
    for _ in range(3):
        last = trainer.step(batch)["entropy"]
    assert last > first + 1e-3


# step metrics --------------------------------------------------------------------------------------


def test_step_passes_batch_info_through():
    metrics = Trainer(tiny_causal_lm(VOCAB)).step(BATCH, batch_info={"dropped_zero_signal": 3, "groups": 8})
    assert metrics["batch/dropped_zero_signal"] == 3.0 and metrics["batch/groups"] == 8.0
    assert metrics["groups"] == 1.0


# FSDP helpers (the 2-rank run is tests/integration/test_fsdp.py) -----------------------------------


def _mb(n: int) -> MicroBatch:
    return pack([TrainSample(Sample([1] * (n + 1), [1] * (n + 1), [0.0] * (n + 1), [0] * (n + 1)), 1.0)],
                4096)[0]


def test_assign_balances_tokens_and_pads_ranks():
    micro = [_mb(n) for n in (10, 3, 8, 4, 2)]
    r0, r1 = assign(micro, 2, 0), assign(micro, 2, 1)
    # LPT: 10 -> r0, 8 -> r1, 4 -> r1, 3 -> r0, 2 -> r1 (loads 13 / 14); r0 padded to three
    assert [m.num_tokens if m else None for m in r0] == [10, 3, None]
    assert [m.num_tokens if m else None for m in r1] == [8, 4, 2]
    assert assign(micro, 1, 0) == micro


def test_decoder_layers_found_by_no_split_modules():
    model = tiny_causal_lm(VOCAB, num_layers=3)
    assert decoder_layers(model) == list(model.model.layers)
    with pytest.raises(ValueError):
        decoder_layers(torch.nn.Linear(2, 2))
