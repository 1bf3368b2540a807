"""The built-in engine on the seeds' model families: greedy output equals transformers' ``generate``.

Tiny random models of each family (``albatross.models.tiny``): hybrid caches (gated delta-net / KDA recurrent
state and conv window, indexer key caches) run on ``HybridRunner``; a second turn that extends the first prompt
continues from the first turn's cache snapshot and must still match ``generate`` on the whole prompt.
"""

from __future__ import annotations

import pytest
import torch

from albatross.engine import BuiltinEngine, SamplingParams
from albatross.engine.builtin.hybrid import HybridRunner

pytest.importorskip("transformers")
from albatross.models.tiny import tiny_model  # noqa: E402

FAMILIES = ["qwen3", "qwen3_moe", "qwen3_next", "qwen4_exp", "glm_moe_dsa", "glm5_next"]
HYBRID = {"qwen3_next", "qwen4_exp", "glm_moe_dsa", "glm5_next"}
NEW = 24


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def reference(model: torch.nn.Module, prompt: list[int], new: int = NEW) -> list[int]:
    """transformers' greedy ``generate``: exactly ``new`` tokens (no end-of-sequence stop)."""
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def reference_continued(model: torch.nn.Module, first: list[int], extra: list[int]) -> tuple[list[int], list[int]]:
    """transformers' greedy ``generate`` over two turns, the second continuing from the first turn's cache
    (``past_key_values``): the completions of both turns."""
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([first]), max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                             return_dict_in_generate=True)
        second = out.sequences[0].tolist() + extra
        again = model.generate(torch.tensor([second]), past_key_values=out.past_key_values, max_new_tokens=NEW,
                               do_sample=False, pad_token_id=0)
    return out.sequences[0, len(first):].tolist(), again[0, len(second):].tolist()


def prompt_of(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 240, (n,), generator=g).tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_generate_over_two_turns(family: str) -> None:
    model = tiny_model(family, seed=1)
    first, extra = prompt_of(0, 13), prompt_of(1, 7)
    want_1, want_2 = reference_continued(model, first, extra)
    params = SamplingParams(temperature=0.0, max_tokens=NEW)
    with BuiltinEngine(model) as engine:
        assert isinstance(engine.runner, HybridRunner) == (family in HYBRID)
        got_1 = engine.generate([first], params)[0]
        assert got_1.token_ids == want_1 == reference(model, first)
        second = first + got_1.token_ids + extra
        got_2 = engine.generate([second], params)[0]
    # the second turn continued from the first turn's cache: everything but the last generated token
    assert got_2.cached_tokens == len(first) + NEW - 1
    assert got_2.token_ids == want_2
    if family != "glm_moe_dsa":
        assert got_2.token_ids == reference(model, second)


def test_dsa_ties_make_a_continued_prompt_differ_from_a_fresh_one() -> None:
    """Why the test above compares ``glm_moe_dsa``'s second turn with transformers' own continued ``generate``:
    its DSA indexer scores keys with ``relu``, many tie at 0, and ``topk`` breaks ties by the tensor's length, so
    transformers itself gives other tokens for the same prompt fresh or continued from a cache (docs/models.md)."""
    model = tiny_model("glm_moe_dsa", seed=1)
    first, extra = prompt_of(0, 13), prompt_of(1, 7)
    want_1, continued = reference_continued(model, first, extra)
    assert continued != reference(model, first + want_1 + extra)


@pytest.mark.parametrize("family", ["qwen3_next", "glm_moe_dsa"])
def test_concurrent_requests_and_weight_swap(family: str) -> None:
    """Several requests at once give each its own answer; a weight swap drops the snapshots and takes effect."""
    model, other = tiny_model(family, seed=1), tiny_model(family, seed=2)
    prompts = [prompt_of(s, n) for s, n in ((3, 5), (4, 11), (5, 2))]
    want = [reference(model, p, 10) for p in prompts]
    want_other = reference(other, prompts[0], 10)
    params = SamplingParams(temperature=0.0, max_tokens=10)
    with BuiltinEngine(model) as engine:
        assert [c.token_ids for c in engine.generate(prompts, params)] == want
        engine.update_weights_from_state_dict(other.state_dict(), version=1)
        assert isinstance(engine.runner, HybridRunner)
        assert len(engine.runner.snapshots) == 0
        got = engine.generate([prompts[0]], params)[0]
    assert got.token_ids == want_other and set(got.versions) == {1}


def test_sampled_logprobs_match_a_cache_free_forward() -> None:
    """Sampling on a hybrid cache: each token's log-prob is the model's over the whole sequence, no cache."""
    model = tiny_model("qwen4_exp", seed=1)
    prompt = prompt_of(6, 9)
    with BuiltinEngine(model) as engine:
        c = engine.generate([prompt], SamplingParams(temperature=1.0, max_tokens=12, seed=7))[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + c.token_ids]), use_cache=False).logits[0].float()
    logp = logits.log_softmax(-1)[len(prompt) - 1 : -1].gather(1, torch.tensor(c.token_ids)[:, None])[:, 0]
    assert torch.allclose(logp, torch.tensor(c.logprobs), atol=1e-4)
