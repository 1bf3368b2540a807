"""MTP speculative decoding in the built-in engine (engine/builtin/mtp_runner.py): greedy output identical to
plain decoding per family, the accept/reject math exact on MTP drafts, weight swaps carry the MTP head."""

import copy
import random

import pytest
import torch

from albatross.bench.engine import greedy_outputs, self_distill_mtp
from albatross.engine.base import SamplingParams
from albatross.engine.builtin import BuiltinEngine, SpecConfig
from albatross.engine.builtin.sampling import build_sampling_tensors, log_distribution
from albatross.engine.builtin.speculative import verify
from albatross.models.mtp import MTP_LAYOUT, get_mtp
from albatross.models.tiny import TEXT_VOCAB, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, TEXT_VOCAB) for _ in range(length)] for _ in range(n)]


def family_model(family: str, seed: int = 1):
    # DSA indexers (GLM families) keep all keys here: with a selective top-k, relu scores tie at 0 and top-k
    # breaks ties by the tensor's length, so a pass of several tokens selects other keys than one-token
    # passes (docs/models.md); that is the indexer, not speculation, and routing replay is its fix
    return tiny_model(family, seed=seed, **({"index_topk": 4096} if family.startswith("glm") else {}))


@pytest.fixture(scope="module")
def distilled():
    """A tiny qwen3_next whose head learned the model's greedy outputs of ``prompts(3, 11, seed=2)``."""
    torch.set_num_threads(1)
    model = family_model("qwen3_next")
    ps = prompts(3, 11, seed=2)
    plain = greedy_outputs(model, ps, 20)
    self_distill_mtp(model, [p + o for p, o in zip(ps, plain, strict=True)], steps=60, lr=1e-2)
    return model, ps, plain


def spec_engine(model, k: int) -> BuiltinEngine:
    return BuiltinEngine(model, speculative=SpecConfig(draft_tokens=k, method="mtp"), prefix_cache_tokens=0)


@pytest.mark.parametrize("family", sorted(MTP_LAYOUT))
def test_greedy_output_is_identical_with_mtp_speculation(family):
    """With the random head (drafts rejected: recurrent states put back) and with the head distilled on the
    model's outputs for these prompts (drafts accepted: passes committed)."""
    model = family_model(family)
    ps = prompts(3, 11, seed=2)
    plain = greedy_outputs(model, ps, 20)
    params = SamplingParams(temperature=0.0, max_tokens=20)
    with spec_engine(model, 2) as engine:
        assert [c.token_ids for c in engine.generate(ps, params)] == plain
        assert engine.stats.accepted_draft_tokens < engine.stats.draft_tokens
    self_distill_mtp(model, [p + o for p, o in zip(ps, plain, strict=True)], steps=60, lr=1e-2)
    with spec_engine(model, 2) as engine:
        assert [c.token_ids for c in engine.generate(ps, params)] == plain
        stats = engine.stats
    assert stats.accepted_draft_tokens > stats.draft_tokens // 2
    assert stats.forward_passes < sum(len(o) for o in plain)  # fewer passes than tokens: drafts were kept


def test_greedy_identical_for_every_draft_length_and_stop_inside_the_drafts(distilled):
    model, ps, plain = distilled
    for k in (1, 3):
        with spec_engine(model, k) as engine:
            assert [c.token_ids for c in engine.generate(ps, SamplingParams(temperature=0.0, max_tokens=20))] == plain
    stop = plain[0][7]  # a stop token that may arrive as an accepted draft
    want = plain[0][: plain[0].index(stop) + 1]
    with spec_engine(model, 3) as engine:
        got = engine.generate([ps[0]], SamplingParams(temperature=0.0, max_tokens=20, stop_token_ids=[stop]))[0]
    assert got.token_ids == want and got.finish_reason == "stop"


def test_second_turn_continues_from_the_snapshot_with_the_same_output():
    model = family_model("qwen4_exp")
    first = prompts(1, 10, seed=3)[0]
    params = SamplingParams(temperature=0.0, max_tokens=12)
    with BuiltinEngine(model, speculative=SpecConfig(draft_tokens=2, method="mtp")) as engine:
        out = engine.generate([first], params)[0].token_ids
        second = first + out + [5, 6, 7]
        again = engine.generate([second], params)[0]
    assert again.cached_tokens == len(first) + len(out) - 1
    assert again.token_ids == greedy_outputs(model, [second], 12)[0]


def _verify_grid(logp, draft: int, params: SamplingParams, u_sample, u_accept):
    """verify() of one draft on rows of the given uniforms: (accepted per row, first output token per row)."""
    n = len(u_sample)
    uniforms = [torch.stack([torch.tensor([s]), torch.tensor([a])]) for s, a in zip(u_sample, u_accept, strict=True)]
    st = build_sampling_tensors([params] * n, uniforms, logp.shape[-1], torch.device("cpu"))
    v = verify(logp[None].expand(n, -1, -1), torch.full((n, 1), draft), torch.ones(n, dtype=torch.long), st,
               torch.zeros(n, dtype=torch.long))
    accepted = v.accepted_B > 0
    return accepted, torch.where(accepted, torch.full_like(v.final_ids_B, draft), v.final_ids_B)


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 20)])
def test_accept_reject_on_the_mtp_draft_keeps_the_distribution_exact(distilled, temperature, top_k):
    """verify() on the MTP head's draft d (a point mass q): the accept test passes with probability p(d) and
    a rejected row draws from p without d, renormalised, so the first output token is distributed as p, the
    sampling distribution. Both are integrated on grids of their uniform (the two are independent), so the
    check is deterministic, to quadrature accuracy (1 / grid points per token)."""
    model, ps, _ = distilled
    head = get_mtp(model)
    ids = torch.tensor([ps[1]])
    with torch.no_grad():
        hidden = model.get_decoder()(input_ids=ids).last_hidden_state
        draft = int(head(hidden[:, :-1], ids[:, 1:])[0, -1].argmax())
        logits = model(torch.cat([ids, torch.tensor([[draft]])], dim=1)).logits[0, -2:]
    params = SamplingParams(temperature=temperature, top_k=top_k, max_tokens=1)
    one = [torch.zeros(2, 1)] * 2
    logp = log_distribution(logits, build_sampling_tensors([params] * 2, one, logits.shape[-1], torch.device("cpu")))
    p = logp[0].exp()
    n_accept, n_sample = 2000, 20000
    grid = (torch.arange(n_accept) + 0.5) / n_accept
    accepted, _ = _verify_grid(logp, draft, params, torch.full((n_accept,), 0.5), grid)
    p_accept = float(accepted.float().mean())
    grid = (torch.arange(n_sample) + 0.5) / n_sample
    rejected, tokens = _verify_grid(logp, draft, params, grid, torch.full((n_sample,), 0.99999))
    assert not bool(rejected.any()) and not bool((tokens == draft).any())  # the residual excludes the draft
    residual = torch.bincount(tokens, minlength=p.numel()).float() / n_sample
    first = p_accept * torch.nn.functional.one_hot(torch.tensor(draft), p.numel()).float() + (1 - p_accept) * residual
    assert abs(p_accept - float(p[draft])) <= 1.0 / n_accept
    assert float((first - p).abs().sum()) / 2 <= 0.015  # total variation
    assert 0.0 < float(p[draft]) < 0.9  # not trivial: the draft can be rejected and other tokens carry mass
    if top_k:
        assert int((p > 0).sum()) == top_k and bool((first[p == 0] == 0).all())


def test_sampled_tokens_carry_the_models_logprobs(distilled):
    model, ps, _ = distilled
    prompt = ps[2]
    with spec_engine(model, 2) as engine:
        c = engine.generate([prompt], SamplingParams(temperature=1.0, max_tokens=14, seed=3))[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + c.token_ids]), use_cache=False).logits[0].float()
    logp = logits.log_softmax(-1)[len(prompt) - 1 : -1].gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
    assert torch.allclose(logp, torch.tensor(c.logprobs), atol=1e-4)


def test_weight_swap_updates_the_mtp_head():
    model, other = family_model("glm_moe_dsa", seed=1), family_model("glm_moe_dsa", seed=2)
    with spec_engine(model, 2) as engine:
        engine.update_weights_from_state_dict(other.state_dict(), version=1)
        swapped = get_mtp(engine.model).state_dict()
        assert all(torch.equal(swapped[k], v) for k, v in get_mtp(other).state_dict().items())
        # a trainer with trainer.mtp = "off" sends no mtp.*: the engine's head keeps its weights
        third = family_model("glm_moe_dsa", seed=3)
        engine.update_weights_from_state_dict({k: v for k, v in third.state_dict().items()
                                               if not k.startswith("mtp.")}, version=2)
        assert all(torch.equal(get_mtp(engine.model).state_dict()[k], v) for k, v in get_mtp(other).state_dict().items())
        assert engine.version == 2
    plain = copy.deepcopy(model)
    del plain.mtp
    with BuiltinEngine(plain) as engine:  # an engine without a head drops the trainer's mtp.* tensors
        engine.update_weights_from_state_dict(other.state_dict(), version=1)


def test_mtp_speculation_needs_a_head_and_engine_config_is_wired():
    from pathlib import Path

    from albatross.config import ConfigError, EngineConfig
    from albatross.engine.launch import check_engine_config, sglang_command, vllm_command

    with pytest.raises(ValueError, match="no MTP head"):
        spec_engine(tiny_model("qwen3_next", mtp=False), 2)
    ec = EngineConfig(type="vllm", speculative="mtp", draft_tokens=3)
    assert vllm_command(ec, Path("m"), "py", 1, False)[-2:] == [
        "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}']
    assert "EAGLE" in sglang_command(EngineConfig(type="sglang", speculative="mtp"), Path("m"), "py", 1, False)
    with pytest.raises(ConfigError, match="engine.speculative"):
        check_engine_config(EngineConfig(process=True, speculative="mtp"))
