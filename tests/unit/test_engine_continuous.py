"""Built-in engine: continuous batching, the KV grid with holes, the prefix cache across turns, stop strings."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from albatross.engine import BuiltinEngine, Completion, SamplingParams
from albatross.engine.builtin.kvcache import Grid, PrefixCache, cache_from_kv, cache_kv
from tiny_models import tiny_qwen2 as tiny_model

PROMPTS = [[5, 17, 33, 2], [9], [250, 3, 3, 41, 77, 120, 8, 19, 64], [1, 2, 3, 4, 5, 6]]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model(0)


def greedy(n: int = 12, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


def sampled(n: int = 12, seed: int = 7) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_k=50, max_tokens=n, seed=seed)


def assert_same(a: Completion, b: Completion) -> None:
    assert a.token_ids == b.token_ids
    assert a.finish_reason == b.finish_reason
    assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def alone(model: torch.nn.Module, prompt: list[int], params: SamplingParams) -> Completion:
    with BuiltinEngine(model, prefix_cache_tokens=0) as eng:
        return eng.generate([prompt], params)[0]


# ------------------------------------------------------------------------------------ continuous batching


class StepGate:
    """A step hook that counts forward passes, can signal once at a given pass and can park the engine there."""

    def __init__(self) -> None:
        self.passes = 0
        self.at: dict[int, threading.Event] = {}
        self.held: dict[int, threading.Event] = {}

    def event(self, n: int) -> threading.Event:
        return self.at.setdefault(n, threading.Event())

    def hold(self, n: int) -> threading.Event:
        """Park the engine's worker at pass ``n`` until the returned event is set."""
        return self.held.setdefault(n, threading.Event())

    def reached(self, n: int, futures: list, timeout: float = 30) -> bool:
        """Wait for pass ``n``, or until every request so far is done (the engine then makes no more
        passes, e.g. when speculation finished them in fewer): join a running batch if there is one."""
        event, deadline = self.event(n), time.monotonic() + timeout
        while not event.wait(0.01):
            if all(f.done() for f in futures) or time.monotonic() > deadline:
                return all(f.done() for f in futures)
        return True

    def __call__(self) -> None:
        self.passes += 1
        if self.passes in self.at:
            self.at[self.passes].set()
        if self.passes in self.held:
            self.held[self.passes].wait(timeout=30)


def test_short_request_leaves_before_the_long_one_it_joined(model) -> None:
    with BuiltinEngine(model) as eng:
        gate = StepGate()
        eng.scheduler.step_hook = gate
        started, release = gate.event(3), gate.hold(3)
        long = eng.submit(PROMPTS[2], SamplingParams(temperature=1.0, max_tokens=300, seed=0))
        assert started.wait(timeout=30)
        # both ends counted by the engine itself: the submit while it is parked at pass 3, the end in its own thread
        # (a count read by this thread after waking up would include the long request's passes meanwhile)
        passes_at_submit = gate.passes
        short = eng.submit(PROMPTS[0], greedy(5))
        done_at: list[int] = []
        short.add_done_callback(lambda _f: done_at.append(gate.passes))
        release.set()
        got = short.result(timeout=30)
        passes_when_short_done = done_at[0]
        assert not long.done(), "the short request waited for the long one"
        # joined at the next step, one pass per token (counted from the submit, not from pass 3)
        assert passes_when_short_done - passes_at_submit <= 1 + 5 + 2
        assert len(long.result(timeout=60).token_ids) == 300
    assert_same(got, alone(model, PROMPTS[0], greedy(5)))


@pytest.mark.parametrize("params", [greedy(20), sampled(20)], ids=["greedy", "seeded"])
def test_requests_joining_a_running_batch_get_their_alone_results(model, params) -> None:
    """Rows join at different steps (left padding and holes in the grid) and still get what they get alone."""
    expected = [alone(model, p, params) for p in PROMPTS]
    with BuiltinEngine(model, prefix_cache_tokens=0) as eng:
        gate = StepGate()
        eng.scheduler.step_hook = gate
        futures = [eng.submit(PROMPTS[0], params)]
        for i, prompt in enumerate(PROMPTS[1:], start=1):
            assert gate.reached(3 * i, futures)
            futures.append(eng.submit(prompt, params))
        for future, want in zip(futures, expected, strict=True):
            assert_same(future.result(timeout=60), want)


def test_lean_forward_equals_the_transformers_forward(model) -> None:
    """The same staggered joins (padding, holes, prefix reuse, speculation) through both forward paths."""

    def run(fast: bool) -> list[Completion]:
        with BuiltinEngine(model, fast_forward=fast, speculative=3) as eng:
            assert eng.runner.fast_forward is fast
            gate = StepGate()
            eng.scheduler.step_hook = gate
            futures = []
            for i, prompt in enumerate(PROMPTS * 2):
                assert gate.reached(2 * i + 1, futures) if i else True
                futures.append(eng.submit(prompt, sampled(16, seed=i)))
            return [f.result(timeout=60) for f in futures]

    for fast, slow in zip(run(True), run(False), strict=True):
        assert_same(fast, slow)


def test_batch_never_exceeds_max_batch_size(model) -> None:
    with BuiltinEngine(model, max_batch_size=2) as eng:
        seen: list[int] = []
        eng.scheduler.step_hook = lambda: seen.append(eng.runner.n_running)
        out = eng.generate(PROMPTS * 2, greedy(6))
    assert max(seen) <= 2
    assert [c.token_ids for c in out[:4]] == [c.token_ids for c in out[4:]]


def test_failed_forward_fails_its_requests_and_the_engine_keeps_serving(model) -> None:
    with BuiltinEngine(model) as eng:
        def boom() -> None:
            raise RuntimeError("boom")

        eng.scheduler.step_hook = boom
        future = eng.submit(PROMPTS[0], greedy(4))
        with pytest.raises(RuntimeError, match="boom"):
            future.result(timeout=30)
        eng.scheduler.step_hook = None
        assert_same(eng.generate([PROMPTS[0]], greedy(4))[0], alone(model, PROMPTS[0], greedy(4)))


# ------------------------------------------------------------------------------------ KV grid


def test_grid_compact_keeps_each_rows_tokens_in_order() -> None:
    torch.manual_seed(0)
    model = tiny_model(0)
    k = torch.randn(3, 2, 10, 4)
    v = torch.randn(3, 2, 10, 4)
    mask = torch.tensor([[0, 1, 1, 0, 1, 0, 0, 1, 1, 1], [0] * 7 + [1] * 3, [1, 0] * 5])
    grid = Grid(cache_from_kv(model, [(k, v), (k + 1, v + 1)]), mask)
    before = [grid.row_kv(r, 10) for r in range(3)]
    grid.compact(model)
    assert grid.length == 6
    assert grid.mask_BL.sum(1).tolist() == [6, 3, 5]
    assert bool((grid.mask_BL[:, -3:] == 1).all())
    for r in range(3):
        for (k0, v0), (k1, v1) in zip(before[r], grid.row_kv(r, 10), strict=True):
            assert torch.equal(k0, k1) and torch.equal(v0, v1)
    assert cache_kv(grid.cache)[0][0].shape == (3, 2, 6, 4)


def test_generation_through_heavy_compaction_matches_alone(model) -> None:
    """Many short rows leave around a long one: the grid is compacted repeatedly."""
    long_params = greedy(120)
    with BuiltinEngine(model, prefix_cache_tokens=0) as eng:
        long = eng.submit(PROMPTS[3], long_params)
        shorts = [eng.submit([7] * (40 + 7 * i), greedy(3)) for i in range(6)]
        got = long.result(timeout=60)
        [s.result(timeout=60) for s in shorts]
    assert_same(got, alone(model, PROMPTS[3], long_params))


# ------------------------------------------------------------------------------------ prefix cache


def test_next_turn_prefills_only_the_new_tokens(model) -> None:
    """prompt + completion + observation reuses the KV of prompt + completion, with the same results."""
    with BuiltinEngine(model) as cached, BuiltinEngine(model, prefix_cache_tokens=0) as fresh:
        contexts = [list(p) for p in PROMPTS]
        for turn in range(3):
            params = sampled(10, seed=turn)
            got, want = cached.generate(contexts, params), fresh.generate(contexts, params)
            for ctx, g, w in zip(contexts, got, want, strict=True):
                assert_same(g, w)
                assert w.cached_tokens == 0
                if turn > 0:
                    assert g.cached_tokens == len(ctx) - 3  # all but the observation and the last sampled id
            contexts = [c + g.token_ids + [11, 12] for c, g in zip(contexts, got, strict=True)]
        assert cached.stats.cached_prompt_tokens > cached.stats.prompt_tokens / 2


def test_attempts_of_a_group_reuse_the_shared_prompt(model) -> None:
    with BuiltinEngine(model) as eng:
        first = eng.generate([PROMPTS[2]], sampled(6, seed=1))[0]
        second = eng.generate([PROMPTS[2]], sampled(6, seed=2))[0]
    assert first.cached_tokens == 0
    assert second.cached_tokens == len(PROMPTS[2]) - 1
    assert_same(second, alone(model, PROMPTS[2], sampled(6, seed=2)))


def test_weight_swap_drops_the_prefix_cache(tmp_path) -> None:
    model = tiny_model(0)
    with BuiltinEngine(model) as eng:
        c = eng.generate([PROMPTS[2]], greedy(6))[0]
        eng.update_weights_from_state_dict({k: v.clone() for k, v in tiny_model(1).state_dict().items()}, 1)
        after = eng.generate([PROMPTS[2] + c.token_ids + [4]], greedy(6))[0]
    assert after.cached_tokens == 0
    assert after.versions == [1] * 6


def test_prefix_cache_is_bounded_lru_and_supersedes_prefixes() -> None:
    kv = [(torch.zeros(1, 1, 6, 2), torch.zeros(1, 1, 6, 2))]
    cache = PrefixCache(max_tokens=10)
    cache.put([1, 2, 3], [(k[:, :, :3], v[:, :, :3]) for k, v in kv], version=0)
    cache.put([1, 2, 3, 4, 5], [(k[:, :, :5], v[:, :, :5]) for k, v in kv], version=0)
    assert len(cache) == 1 and cache.tokens == 5  # [1, 2, 3] is a prefix of the new entry
    cache.put([7, 8, 9, 10], [(k[:, :, :4], v[:, :, :4]) for k, v in kv], version=0)
    assert cache.tokens == 9
    found, n = cache.lookup([1, 2, 3, 4, 5, 6], version=0)
    assert n == 5 and found is not None and found[0][0].shape[2] == 5
    assert cache.lookup([1, 2, 3, 4, 5, 6], version=1) == (None, 0)
    assert cache.lookup([1, 2, 9], version=0)[1] == 2  # the prompt diverges after 2 cached tokens
    assert cache.lookup([1, 9, 9], version=0) == (None, 0)
    assert cache.lookup([7, 8], version=0)[1] == 1  # one token is always left to prefill
    cache.put([20, 21], [(k[:, :, :2], v[:, :, :2]) for k, v in kv], version=0)  # evicts the LRU entry
    assert cache.tokens <= 10
    assert cache.lookup([1, 2, 3, 4, 5, 6], version=0) == (None, 0)
    assert cache.lookup([7, 8, 9, 10, 11], version=0)[1] == 4


# ------------------------------------------------------------------------------------ stop strings


def letters(ids) -> str:
    return "".join(chr(ord("a") + i % 26) for i in ids)


def test_stop_string_ends_the_completion_at_the_token_that_completes_it(model) -> None:
    with BuiltinEngine(model, decode=letters) as eng:
        free = eng.generate([PROMPTS[2]], greedy(16))[0]
        text = letters(free.token_ids)
        stop = text[6:8]
        cut = text.index(stop) + len(stop)
        got = eng.generate([PROMPTS[2]], greedy(16, stop=["zzzzzz", stop]))[0]
    assert (got.finish_reason, got.stop_reason) == ("stop", stop)
    assert got.token_ids == free.token_ids[:cut]
    assert got.logprobs == pytest.approx(free.logprobs[:cut], abs=1e-4)


def test_stop_token_sets_stop_reason(model) -> None:
    with BuiltinEngine(model) as eng:
        free = eng.generate([PROMPTS[0]], greedy(12))[0]
        got = eng.generate([PROMPTS[0]], greedy(12, stop_token_ids=[free.token_ids[4]]))[0]
    assert got.stop_reason == free.token_ids[4]
    assert got.finish_reason == "stop"


def test_stop_strings_need_a_tokenizer(model) -> None:
    with BuiltinEngine(model) as eng, pytest.raises(ValueError, match="tokenizer"):
        eng.generate([PROMPTS[0]], greedy(4, stop=["x"]))
