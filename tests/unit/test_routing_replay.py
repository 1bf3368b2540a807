"""Routing replay: the engine records each token's experts, the trainer's forward routes through them.

Tiny MoE models (``albatross.models.tiny``). The trainer copy is made to drift from the sampler's weights
(a few optimizer steps), so its live routing differs from the recorded one; replay must use the recorded
experts, still give the router gradients, and the samples must carry the routing through JSON and packing.
"""

from __future__ import annotations

import copy

import pytest
import torch

from albatross.engine import BuiltinEngine, SamplingParams
from albatross.models.routing import install, moe_routers
from albatross.records import Sample, TrainSample, Trajectory
from albatross.trainer.logprobs import TokenLogprobs
from albatross.trainer.packing import pack

pytest.importorskip("transformers")
from albatross.models.tiny import tiny_model  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def rollouts(model: torch.nn.Module, n: int = 4, new: int = 16) -> list[Sample]:
    """Sampled completions from the engine with routing recorded, as trainer samples."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 240, (6 + 3 * i,), generator=g).tolist() for i in range(n)]
    with BuiltinEngine(copy.deepcopy(model), record_routing=True) as engine:
        done = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=new, seed=11))
    samples = []
    for p, c in zip(prompts, done, strict=True):
        s = Sample(list(p), [0] * len(p), [0.0] * len(p), [-1] * len(p))
        s.extend(c.token_ids, model=True, logprobs=c.logprobs, versions=c.versions, routing=c.routing)
        samples.append(s)
    return samples


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
    for s in samples:
        model_rows = [r for r, m in zip(s.routing, s.loss_mask, strict=True) if m]
        assert len(model_rows) == s.num_model_tokens and all(len(r) == n_layers for r in model_rows)
        assert all(len(set(experts)) == k for r in model_rows for experts in r)
    # same weights: the trainer's fp32 log-probs with replay are the engine's, up to glm_moe_dsa's DSA indexer,
    # whose top-k ties break by tensor length (decoding token by token vs a whole document): not replayed yet
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
        assert torch.equal(forced[layer][where].sort(-1).values, recorded[where, layer].sort(-1).values)
    flips = sum(int((live[i][where].sort(-1).values != recorded[where, i].sort(-1).values).any(-1).sum())
                for i in range(n_layers))
    assert flips > 0, "the drifted trainer routes like the sampler: the test would not show replay working"


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
