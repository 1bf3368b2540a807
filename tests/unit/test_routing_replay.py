"""Routing replay: the engine records each token's experts, the trainer's forward routes through them.

Tiny MoE models (``albatross.models.tiny``). The trainer copy is made to drift from the sampler's weights
(a few optimizer steps), so its live routing differs from the recorded one; replay must use the recorded
experts, still give the router gradients, and the samples must carry the routing through JSON and packing.
"""

from __future__ import annotations

import copy

import pytest
import torch

from albatross.bench.replay import rollouts as engine_rollouts
from albatross.config import TrainerConfig
from albatross.models.routing import install, moe_routers, routing_tensor, sparse_indexers
from albatross.records import Batch, Sample, TrainSample, Trajectory
from albatross.trainer.logprobs import TokenLogprobs
from albatross.trainer.packing import pack
from albatross.trainer.step import Trainer

pytest.importorskip("transformers")
from albatross.models.tiny import tiny_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def rollouts(model: torch.nn.Module, n: int = 4, new: int = 16, prompt_step: int = 3) -> list[Sample]:
    """Sampled completions from the engine with routing recorded, as trainer samples (prompts of 6, 6 +
    ``prompt_step``, ... tokens; ``albatross bench replay``'s)."""
    return engine_rollouts(model, 240, n, new, prompt_step)


def drift(model: torch.nn.Module, samples: list[Sample], steps: int, lr: float = 3e-3) -> torch.nn.Module:
    """A trainer copy moved ``steps`` Adam steps (SFT on the samples) away from the sampler's weights."""
    trained = copy.deepcopy(model).train()
    policy = TokenLogprobs(trained, chunk_size=None)
    opt = torch.optim.Adam(trained.parameters(), lr=lr)
    mb = pack([TrainSample(s, 1.0) for s in samples], 4096)[0]
    for _ in range(steps):
        logp, _ = policy(mb.input_ids, mb.position_ids, mb.targets, cu_seq_lens_q=mb.cu_seq_lens)
        (-(logp * mb.loss_mask).sum()).backward()
        opt.step()
        opt.zero_grad()
    return trained.eval()


def routed(model: torch.nn.Module) -> list[list[torch.Tensor]]:
    """Collects each router's chosen experts per forward pass."""
    seen: list[list[torch.Tensor]] = []
    for i, router in enumerate(moe_routers(model)):
        seen.append([])
        router.register_forward_hook(lambda m, a, out, i=i: seen[i].append(out[2].detach().clone()))
    return seen


def mismatch(model: torch.nn.Module, samples: list[Sample], replay: bool) -> tuple[float, torch.Tensor]:
    """Mismatch KL (r - log r - 1, mean over model tokens) of ``model`` against the rollout log-probs."""
    mb = pack([TrainSample(s, 1.0) for s in samples], 4096)[0]
    policy = TokenLogprobs(model, chunk_size=None)
    with torch.no_grad():
        logp, _ = policy(mb.input_ids, mb.position_ids, mb.targets, cu_seq_lens_q=mb.cu_seq_lens,
                         routing=mb.routing if replay else None)
    log_r = (logp - mb.logprobs)[mb.loss_mask.bool()]
    return float((log_r.exp() - log_r - 1).mean()), logp


@pytest.mark.parametrize("family", ["qwen3_moe", "glm_moe_dsa"])
def test_engine_records_routing_and_the_trainer_replays_it(family: str) -> None:
    model = tiny_model(family, seed=1)
    samples = rollouts(model)
    n_layers, k = len(moe_routers(model)), model.config.num_experts_per_tok
    n_indexers = len(sparse_indexers(model))
    for s in samples:
        model_rows = [r for r, m in zip(s.routing, s.loss_mask, strict=True) if m]
        assert len(model_rows) == s.num_model_tokens
        assert all(len(r) == n_layers + n_indexers for r in model_rows)
        assert all(len(set(experts)) == k for r in model_rows for experts in r[:n_layers])
    # same weights: the trainer's fp32 log-probs with replay are the engine's, up to glm_moe_dsa's prompt positions
    # (prompts of up to 15 tokens, index_topk 8): their DSA top-k ties break by tensor length (the engine's
    # prefill vs a whole document) and only generated tokens' selections are recorded
    kl_same, _ = mismatch(copy.deepcopy(model), samples, replay=True)
    assert kl_same < (1e-8 if family == "qwen3_moe" else 1e-3)
    trained = drift(model, samples, steps=4)
    seen = routed(trained)
    mb = pack([TrainSample(s, 1.0) for s in samples], 4096)[0]
    mismatch(trained, samples, replay=False)
    live = [calls[-1] for calls in seen]
    mismatch(trained, samples, replay=True)
    forced = [calls[-1] for calls in seen]
    recorded = mb.routing
    where = recorded[:, 0, 0] >= 0
    for layer in range(n_layers):
        assert torch.equal(forced[layer][where].sort(-1).values, recorded[where, layer, :k].sort(-1).values)
    flips = sum(int((live[i][where].sort(-1).values != recorded[where, i, :k].sort(-1).values).any(-1).sum())
                for i in range(n_layers))
    assert flips > 0, "the drifted trainer routes like the sampler: the test would not show replay working"


@pytest.mark.parametrize("family", ["qwen4_exp", "glm_moe_dsa"])
def test_recorded_indexer_selections_are_replayed_after_the_indexer_changes(family: str) -> None:
    """Prompts of 6-8 tokens, within the indexers' budget of 8 keys (QSA: 2 blocks of 4 plus the tail), so every
    position that has a choice is a generated one, whose selection the engine records."""
    model = tiny_model(family, seed=1)
    samples = rollouts(model, n=3, new=24, prompt_step=1)
    n_routers = len(moe_routers(model))
    qsa = family == "qwen4_exp"
    for s in samples:
        for t, (row, m) in enumerate(zip(s.routing, s.loss_mask, strict=True)):
            if not m:
                continue
            for sel in row[n_routers:]:  # QSA: complete blocks of 4 keys; DSA: key positions before token t
                assert sel == sorted(set(sel)) and len(sel) <= (2 if qsa else 8)
                assert all(0 <= x < (t // 4 if qsa else t) for x in sel)
    assert any(len(sel) == (2 if qsa else 8) for s in samples for row in s.routing for sel in row[n_routers:])
    perturbed = copy.deepcopy(model)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in (p for ix in sparse_indexers(perturbed) for p in ix.parameters()):
            p.add_(torch.randn(p.shape, generator=g) * 0.5)
    mb = pack([TrainSample(s, 1.0) for s in samples], 4096)[0]
    model_tokens = mb.loss_mask.bool()
    _, live = mismatch(copy.deepcopy(perturbed), samples, replay=False)
    _, replayed = mismatch(perturbed, samples, replay=True)
    assert float((live - mb.logprobs)[model_tokens].abs().max()) > 1e-2, "the live top-k did not change"
    assert float((replayed - mb.logprobs)[model_tokens].abs().max()) < 1e-5


def test_replay_refuses_attention_that_selects_keys_without_its_indexer() -> None:
    """A whole-row attention forward that bypasses the indexer module (``trainer.fast_indexer``) would ignore the
    recorded selections: refused, not silently live."""
    from albatross.models.segments import Layout, replaced

    model = tiny_model("qwen4_exp", seed=1)
    attention = next(m for m in model.modules() if hasattr(m, "indexer") and m.indexer is not None)
    replaced(attention, Layout(), lambda module, lengths, *a, **k: module(*a, **k))
    with pytest.raises(NotImplementedError, match="fast_indexer"):
        install(model)


def test_bench_replay_refuses_a_directory_that_is_not_a_model(tmp_path) -> None:
    import argparse

    from albatross.bench.replay import run
    from albatross.errors import UserError

    with pytest.raises(UserError, match="no config.json"):
        run(argparse.Namespace(model=str(tmp_path), lr=1e-5, steps=2, json=None))


def test_routing_tensor_pads_selections_wider_than_the_experts() -> None:
    rows = [[], [[0, 1], [4, 9, 2]], [[3, 2], []]]
    got = routing_tensor(rows, 2, 2)
    assert got.shape == (3, 2, 3)
    assert got[1].tolist() == [[0, 1, -1], [4, 9, 2]] and got[2].tolist() == [[3, 2, -1], [-1, -1, -1]]
    assert (got[0] == -1).all()


def test_a_step_with_replay_also_logs_the_mismatch_kl_without_it() -> None:
    model = tiny_model("qwen3_moe", seed=1)
    samples = rollouts(model)
    trained = drift(model, samples, steps=4)
    want_replayed, _ = mismatch(copy.deepcopy(trained), samples, replay=True)
    want_live, _ = mismatch(copy.deepcopy(trained), samples, replay=False)
    trainer = Trainer(trained.train(), TrainerConfig(micro_batch_tokens=64), temperature=1.0)  # several micro-batches
    metrics = trainer.step(Batch([TrainSample(s, 1.0) for s in samples], groups=1, min_version=0))
    assert metrics["mismatch_kl"] == pytest.approx(want_replayed, rel=1e-4)
    assert metrics["mismatch_kl_no_replay"] == pytest.approx(want_live, rel=1e-4)
    assert abs(want_live - want_replayed) > 1e-6  # routing flips after the drift: the two figures differ
    unrouted = [Sample(s.token_ids, s.loss_mask, s.logprobs, s.versions) for s in samples]
    assert "mismatch_kl_no_replay" not in trainer.step(Batch([TrainSample(s, 1.0) for s in unrouted], 1, 0))


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen4_exp", "glm_moe_dsa"])
def test_router_math_is_fp32_and_rl_has_no_load_balancing_loss(family: str) -> None:
    """A bf16 model's replayed routers score in fp32; no config turns the balancing loss on by default, and the
    trainer's log-probs (the decoder alone) are the same with it switched on: RL never adds it."""
    model = tiny_model(family, seed=3)
    assert not getattr(model.config, "output_router_logits", False)
    ids = torch.randint(3, 240, (1, 20), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(20)[None]
    want, _ = TokenLogprobs(copy.deepcopy(model), chunk_size=None)(ids, pos, ids[0])
    model.config.output_router_logits = True
    got, _ = TokenLogprobs(model, chunk_size=None)(ids, pos, ids[0])
    assert torch.equal(want, got)
    half = copy.deepcopy(model).to(torch.bfloat16)
    install(half)
    seen = []
    for router in moe_routers(half):
        router.register_forward_hook(lambda m, a, out: seen.append((out[0].dtype, out[1].dtype)))
    with torch.no_grad():
        half(ids, use_cache=False)
    assert seen and all(d == (torch.float32, torch.float32) for d in seen)


def test_replayed_routing_still_trains_the_router() -> None:
    model = tiny_model("qwen3_moe", seed=1)
    samples = rollouts(model, n=2)
    trained = drift(model, samples, steps=2)
    mb = pack([TrainSample(s, 1.0) for s in samples], 4096)[0]
    logp, _ = TokenLogprobs(trained, chunk_size=None)(mb.input_ids, mb.position_ids, mb.targets,
                                                      cu_seq_lens_q=mb.cu_seq_lens, routing=mb.routing)
    (logp * mb.loss_mask).sum().backward()
    grads = [r.weight.grad for r in moe_routers(trained)]
    assert all(g is not None and float(g.abs().sum()) > 0 for g in grads)


def test_replay_with_no_recorded_routing_is_the_live_model() -> None:
    model = tiny_model("glm_moe_dsa", seed=2)
    ids = torch.randint(3, 240, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
        install(model)
        got = model(ids, use_cache=False).logits
    assert torch.allclose(want, got, atol=1e-5)


def test_routing_is_serialised_only_when_recorded() -> None:
    plain = Sample([1, 2], [0, 1], [0.0, -0.5], [-1, 0])
    routed_s = Sample([1], [0], [0.0], [-1])
    routed_s.extend([7, 8], model=True, logprobs=[-1.0, -2.0], versions=[0, 0], routing=[[[0, 1]], [[2, 3]]])
    routed_s.extend([9], model=False)
    assert routed_s.routing == [[], [[0, 1]], [[2, 3]], []]
    d = Trajectory("t", "g", 0, samples=[plain, routed_s]).to_dict()
    assert "routing" not in d["samples"][0] and d["samples"][1]["routing"][1] == [[0, 1]]
    back = Trajectory.from_dict(d)
    assert back.samples[0].routing is None and back.samples[1].routing == routed_s.routing
    mb = pack([TrainSample(routed_s, 1.0), TrainSample(plain, 1.0)], 64)[0]
    assert mb.routing is not None and mb.routing.shape == (mb.num_tokens, 1, 2)
    assert mb.routing[:, 0, 0].tolist() == [0, 2, -1, -1]  # aligned with the targets, like logprobs
