"""n-gram speculative decoding: the index, exactness under greedy, distribution preservation under sampling."""

from __future__ import annotations

import math

import pytest
import torch

from albatross.engine import BuiltinEngine, SamplingParams
from albatross.engine.builtin.sampling import build_sampling_tensors
from albatross.engine.builtin.speculative import NgramIndex, verify
from tiny_models import tiny_qwen2 as tiny_model

# prompts that repeat themselves, as agent contexts do (file names, commands)
PROMPTS = [
    [5, 17, 33, 2, 40, 41, 42, 5, 17, 33, 2, 40],
    [9, 8, 7, 6, 9, 8, 7, 6, 9, 8],
    [250, 3, 3, 41, 77, 120, 8, 19, 64, 250, 3, 3, 41],
]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_ngram_index_proposes_what_followed_the_last_occurrence() -> None:
    index = NgramIndex(1, 3)
    index.extend([1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3])
    assert index.propose(3) == [4, 9, 2]  # the longest suffix wins: "1 2 3" (then 4), not "2 3" (then 5)
    index = NgramIndex(1, 2)
    index.extend([1, 2, 3, 4, 9, 2, 3, 5, 6, 1, 2, 3])
    assert index.propose(3) == [5, 6, 1]  # the most recent occurrence of "2 3"
    index = NgramIndex(1, 3)
    index.extend([1, 2, 3, 4, 5, 1, 2, 3])
    assert index.propose(2) == [4, 5]
    assert index.propose(0) == []
    index.extend([7])
    assert index.propose(4) == []  # 7 never occurred before
    with pytest.raises(ValueError):
        NgramIndex(2, 1)


def bigram_model() -> torch.nn.Module:
    """Attention switched off: the next token depends on the current one only, so greedy output cycles and the
    n-gram drafts are right (drafts of the plain random model are mostly rejected)."""
    model = tiny_model(0)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
    return model


@pytest.mark.parametrize("make", [tiny_model, bigram_model], ids=["mostly-rejected", "mostly-accepted"])
def test_greedy_output_is_identical_with_and_without_speculation(make) -> None:
    model = make()
    params = SamplingParams(temperature=0.0, max_tokens=40)
    with BuiltinEngine(model, prefix_cache_tokens=0) as plain, BuiltinEngine(
        model, speculative=4, prefix_cache_tokens=0
    ) as spec:
        want = plain.generate(PROMPTS, params)
        got = spec.generate(PROMPTS, params)
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
        assert g.versions == [0] * 40
    assert spec.stats.draft_tokens > 0 and spec.stats.accepted_draft_tokens > 0
    if make is bigram_model:
        assert spec.stats.accepted_draft_tokens > spec.stats.draft_tokens / 2
        assert spec.stats.forward_passes < 0.75 * plain.stats.forward_passes


def test_sampled_speculative_logprobs_are_those_of_the_sampling_distribution() -> None:
    model = bigram_model()
    params = SamplingParams(temperature=0.25, top_k=40, max_tokens=40, seed=3)
    with BuiltinEngine(model, speculative=4) as spec:
        outs = spec.generate(PROMPTS, params)
        assert spec.stats.accepted_draft_tokens > 0
    for prompt, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1].float()
        scaled = logits / 0.25
        kth = scaled.topk(40, dim=-1).values[:, -1:]
        logp = scaled.masked_fill(scaled < kth, float("-inf")).log_softmax(-1)
        expected = logp.gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
        assert out.logprobs == pytest.approx(expected.tolist(), abs=1e-4)


def _verify_many(logp_V: torch.Tensor, draft: int, n: int, greedy: bool = False) -> torch.Tensor:
    """The first output token of ``n`` independent rows that all draft ``draft`` against the same ``logp_V``."""
    params = [SamplingParams(temperature=0.0 if greedy else 1.0, max_tokens=2) for _ in range(n)]
    uniforms = [torch.rand(2, 2, generator=torch.Generator().manual_seed(i)) for i in range(n)]
    st = build_sampling_tensors(params, uniforms, logp_V.shape[0], torch.device("cpu"))
    logp_BTV = logp_V.expand(n, 2, -1)
    verdict = verify(logp_BTV, torch.full((n, 1), draft), torch.ones(n, dtype=torch.long), st, torch.zeros(n, dtype=torch.long))
    accepted = verdict.accepted_B.bool()
    return torch.where(accepted, torch.full((n,), draft), verdict.final_ids_B)


@pytest.mark.parametrize("draft", [0, 2, 4])
def test_accept_reject_preserves_the_sampling_distribution(draft: int) -> None:
    p = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    n = 40_000
    first = _verify_many(p.log(), draft, n)
    freq = torch.bincount(first, minlength=5).float() / n
    sd = (p * (1 - p) / n).sqrt()
    assert bool(((freq - p).abs() < 5 * sd).all()), (freq, p)


def test_greedy_rows_accept_only_the_argmax() -> None:
    p = torch.tensor([0.1, 0.6, 0.3]).log()
    assert bool((_verify_many(p, 1, 50, greedy=True) == 1).all())
    assert bool((_verify_many(p, 2, 50, greedy=True) == 1).all())


def test_speculation_across_a_weight_swap_keeps_versions_monotone() -> None:
    model = tiny_model(0)
    new_state = {k: v.clone() for k, v in tiny_model(1).state_dict().items()}
    with BuiltinEngine(model, speculative=4) as eng:
        future = eng.submit(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=200))
        eng.update_weights_from_state_dict(new_state, 3)
        versions = future.result(timeout=60).versions
    assert len(versions) == 200
    assert versions == sorted(versions) and set(versions) <= {0, 3}
    assert math.isclose(eng.version, 3)
