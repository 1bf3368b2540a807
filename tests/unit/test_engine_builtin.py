"""Built-in engine on a tiny random Qwen2: batching, KV cache, sampling, log-probs, threads, weight swaps."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch
from safetensors.torch import save_file

from albatross.engine import BuiltinEngine, Completion, SamplingParams
from albatross.engine.builtin import EngineClosed
from albatross.engine.builtin.runner import ModelRunner, Request
from tiny_models import tiny_qwen2 as tiny_model

PROMPTS = [[5, 17, 33, 2], [9], [250, 3, 3, 41, 77, 120, 8, 19, 64], [1, 2, 3, 4, 5, 6]]


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture
def engine():
    eng = BuiltinEngine(tiny_model(0))
    yield eng
    eng.close()


def greedy(max_tokens: int = 12, stop: list[int] | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=stop or [])


def full_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log_softmax of one cache-free forward pass over prompt + completion, at the completion's positions."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    return logits[len(prompt) - 1 : -1].log_softmax(-1)


def reference_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    ids: list[int] = []
    logprobs: list[float] = []
    for _ in range(n):
        with torch.no_grad():
            logp = model(torch.tensor([prompt + ids])).logits[0, -1].float().log_softmax(-1)
        ids.append(int(logp.argmax()))
        logprobs.append(float(logp.max()))
    return ids, logprobs


def assert_same(a: Completion, b: Completion) -> None:
    assert a.token_ids == b.token_ids
    assert a.finish_reason == b.finish_reason
    assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


# ------------------------------------------------------------------------------------------ correctness


def test_batched_greedy_equals_one_by_one(engine: BuiltinEngine) -> None:
    batched = engine.generate(PROMPTS, greedy())
    for prompt, got in zip(PROMPTS, batched, strict=True):
        assert_same(got, engine.generate([prompt], greedy())[0])
    assert len({tuple(c.token_ids) for c in batched}) == len(PROMPTS)


def test_greedy_equals_cache_free_reference(engine: BuiltinEngine) -> None:
    for prompt, got in zip(PROMPTS, engine.generate(PROMPTS, greedy(16)), strict=True):
        ids, logprobs = reference_greedy(engine.model, prompt, 16)
        assert got.token_ids == ids
        assert got.logprobs == pytest.approx(logprobs, abs=1e-4)
        assert got.versions == [0] * 16


def test_sampled_logprobs_equal_full_forward_at_temperature_one(engine: BuiltinEngine) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=20, seed=3)
    for prompt, got in zip(PROMPTS, engine.generate(PROMPTS, params), strict=True):
        logp = full_logprobs(engine.model, prompt, got.token_ids)
        expected = logp.gather(1, torch.tensor(got.token_ids)[:, None]).squeeze(1)
        assert got.logprobs == pytest.approx(expected.tolist(), abs=1e-4)
        assert len(set(got.token_ids)) > 5  # really sampled, not a repeated argmax


def truncated_logprob(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, token: int
) -> float:
    """Independent reference: top-k, then top-p on the renormalised top-k, renormalised again."""
    probs = (logits / temperature).softmax(-1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])[:top_k]
    kept, mass, total_k = [], 0.0, sum(probs[i] for i in order)
    for i in order:
        if mass >= top_p:
            break
        kept.append(i)
        mass += probs[i] / total_k
    assert token in kept, "sampled a token outside the top-k / top-p support"
    return math.log(probs[token] / sum(probs[i] for i in kept))


def test_top_k_top_p_logprobs_are_renormalised_over_the_support(engine: BuiltinEngine) -> None:
    params = SamplingParams(temperature=0.7, top_k=8, top_p=0.8, max_tokens=15, seed=11)
    for prompt, got in zip(PROMPTS, engine.generate(PROMPTS, params), strict=True):
        with torch.no_grad():
            logits = (
                engine.model(torch.tensor([prompt + got.token_ids])).logits[0, len(prompt) - 1 : -1].float()
            )
        expected = [truncated_logprob(logits[t], 0.7, 8, 0.8, tok) for t, tok in enumerate(got.token_ids)]
        assert got.logprobs == pytest.approx(expected, abs=1e-4)


def test_seeded_sampling_is_reproducible_whatever_the_batch(engine: BuiltinEngine) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=20, seed=42)
    alone = engine.generate([PROMPTS[2]], params)[0]
    in_batch = engine.generate([PROMPTS[0], PROMPTS[2], PROMPTS[1]], params)[1]
    assert_same(alone, in_batch)
    other_seed = engine.generate(
        [PROMPTS[2]], SamplingParams(temperature=1.0, top_p=0.95, max_tokens=20, seed=43)
    )
    assert other_seed[0].token_ids != alone.token_ids


def test_mixed_params_in_one_batch_equal_each_request_alone() -> None:
    runner = ModelRunner(tiny_model(0))
    free = runner.generate([Request(PROMPTS[0], greedy(10))])[0]
    stop_id = free.token_ids[4]
    requests = [
        Request(PROMPTS[0], greedy(10, stop=[stop_id, 299])),
        Request(PROMPTS[1], SamplingParams(temperature=0.9, top_k=20, max_tokens=7, seed=5)),
        Request(PROMPTS[2], greedy(3)),
        Request(PROMPTS[3], SamplingParams(temperature=1.3, max_tokens=0)),
        Request(PROMPTS[1], SamplingParams(temperature=1.0, max_tokens=25, seed=9)),
    ]
    batched = runner.generate(requests)
    for request, got in zip(requests, batched, strict=True):
        assert_same(got, runner.generate([request])[0])
    first_stop = free.token_ids.index(stop_id)
    assert batched[0].token_ids == free.token_ids[: first_stop + 1]
    assert batched[0].finish_reason == "stop"
    assert [len(c.token_ids) for c in batched[1:]] == [7, 3, 0, 25]
    assert [c.finish_reason for c in batched[1:]] == ["length"] * 4


def test_stop_token_stops_the_row_and_is_included(engine: BuiltinEngine) -> None:
    free = engine.generate(PROMPTS, greedy(12))
    stop_id = free[2].token_ids[5]
    stopped = engine.generate(PROMPTS, greedy(12, stop=[stop_id]))
    for f, s in zip(free, stopped, strict=True):
        if stop_id in f.token_ids:
            cut = f.token_ids.index(stop_id) + 1
            assert (s.token_ids, s.finish_reason) == (f.token_ids[:cut], "stop")
            assert s.logprobs == pytest.approx(f.logprobs[:cut], abs=1e-4)
        else:
            assert (s.token_ids, s.finish_reason) == (f.token_ids, "length")


def test_max_tokens_respected(engine: BuiltinEngine) -> None:
    for n in (0, 1, 5):
        for c in engine.generate(PROMPTS, SamplingParams(max_tokens=n, seed=1)):
            assert len(c.token_ids) == len(c.logprobs) == len(c.versions) == n
            assert c.finish_reason == "length"


def test_bad_requests_are_rejected(engine: BuiltinEngine) -> None:
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], greedy())
    with pytest.raises(ValueError, match=r"\[0, 300\)"):
        engine.generate([[300]], greedy())
    with pytest.raises(ValueError, match="top_p"):
        engine.generate([[1]], SamplingParams(top_p=0.0))


# ------------------------------------------------------------------------------------------ threads


def test_concurrent_generate_from_8_threads(engine: BuiltinEngine) -> None:
    expected = [engine.generate([PROMPTS[i % 4], PROMPTS[(i + 1) % 4]], greedy(10)) for i in range(8)]
    results: dict[int, list[Completion]] = {}

    def work(i: int) -> None:
        results[i] = engine.generate([PROMPTS[i % 4], PROMPTS[(i + 1) % 4]], greedy(10))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(results) == list(range(8))
    for i in range(8):
        for got, want in zip(results[i], expected[i], strict=True):
            assert_same(got, want)


def test_submit_returns_a_future(engine: BuiltinEngine) -> None:
    future = engine.submit(PROMPTS[0], greedy(4))
    assert_same(future.result(timeout=30), engine.generate([PROMPTS[0]], greedy(4))[0])


def test_close_joins_the_worker_and_refuses_new_work() -> None:
    eng = BuiltinEngine(tiny_model(0))
    eng.generate([PROMPTS[0]], greedy(2))
    eng.close()
    assert not eng.scheduler._thread.is_alive()
    with pytest.raises(EngineClosed):
        eng.generate([PROMPTS[0]], greedy(2))


def test_close_during_generation_fails_the_request_and_joins() -> None:
    eng = BuiltinEngine(tiny_model(0))
    running = threading.Event()
    eng.scheduler.step_hook = running.set
    future = eng.submit(PROMPTS[0], SamplingParams(max_tokens=400, seed=0))
    assert running.wait(timeout=20)
    eng.close()
    assert not eng.scheduler._thread.is_alive()
    with pytest.raises(EngineClosed):
        future.result(timeout=5)


# ------------------------------------------------------------------------------------------ weights


def save_weights(model: torch.nn.Module, directory, drop_tied: bool = True) -> None:
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if drop_tied:
        state.pop("lm_head.weight")  # tied to model.embed_tokens.weight, as save_pretrained leaves it out
    directory.mkdir(exist_ok=True)
    save_file(state, str(directory / "model.safetensors"))


def test_update_weights_changes_outputs_and_version(engine: BuiltinEngine, tmp_path) -> None:
    before = engine.generate(PROMPTS, greedy())
    new_model = tiny_model(1)
    save_weights(new_model, tmp_path / "v1")
    engine.update_weights(str(tmp_path / "v1"), version=1)
    assert engine.version == 1
    after = engine.generate(PROMPTS, greedy())
    assert [c.token_ids for c in after] != [c.token_ids for c in before]
    with BuiltinEngine(new_model) as fresh:
        for got, want in zip(after, fresh.generate(PROMPTS, greedy()), strict=True):
            assert got.token_ids == want.token_ids
            assert got.versions == [1] * len(got.token_ids)


def test_update_weights_from_sharded_files(engine: BuiltinEngine, tmp_path) -> None:
    state = {k: v.clone() for k, v in tiny_model(1).state_dict().items() if k != "lm_head.weight"}
    names = sorted(state)
    save_file({k: state[k] for k in names[:10]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({k: state[k] for k in names[10:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    engine.update_weights(str(tmp_path), version=7)
    assert engine.version == 7
    assert torch.equal(engine.model.lm_head.weight, state["model.embed_tokens.weight"])


def test_generation_spanning_a_swap_switches_version_once(engine: BuiltinEngine, tmp_path) -> None:
    save_weights(tiny_model(1), tmp_path / "v1")
    calls = {"n": 0}
    reached = threading.Event()

    def hook() -> None:  # runs on the worker before each forward pass; call 11 is before decode step 10
        calls["n"] += 1
        if calls["n"] == 11:
            reached.set()
            deadline = time.monotonic() + 20
            while not engine.scheduler.has_pending_swap() and time.monotonic() < deadline:
                time.sleep(0.001)

    engine.scheduler.step_hook = hook
    params = SamplingParams(temperature=1.0, max_tokens=40, seed=0)
    futures = engine.scheduler.submit_many(PROMPTS, params)
    assert reached.wait(timeout=20)
    late = engine.submit(PROMPTS[1], greedy(5))  # joins the next batch
    engine.update_weights(str(tmp_path / "v1"), version=1)
    engine.scheduler.step_hook = None
    completions = [f.result(timeout=30) for f in futures]
    for c in completions:
        assert c.versions == [0] * 10 + [1] * 30
    assert late.result(timeout=30).versions == [1] * 5
    assert engine.version == 1


def test_swap_from_another_thread_during_long_generation(engine: BuiltinEngine) -> None:
    new_state = {k: v.clone() for k, v in tiny_model(1).state_dict().items()}
    future = engine.submit(PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=400, seed=0))
    swapper = threading.Thread(target=engine.update_weights_from_state_dict, args=(new_state, 5))
    swapper.start()
    swapper.join(timeout=30)
    versions = future.result(timeout=60).versions
    assert len(versions) == 400
    assert set(versions) <= {0, 5}
    assert versions == sorted(versions)
    assert engine.version == 5


def test_wrong_shape_update_raises_and_keeps_old_weights(engine: BuiltinEngine, tmp_path) -> None:
    before = engine.generate(PROMPTS, greedy())
    state = {k: v.clone() for k, v in tiny_model(1).state_dict().items() if k != "lm_head.weight"}
    state["model.norm.weight"] = torch.ones(65)
    (tmp_path / "bad").mkdir()
    save_file(state, str(tmp_path / "bad" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"shape mismatch for 'model.norm.weight'"):
        engine.update_weights(str(tmp_path / "bad"), version=1)
    del state["model.norm.weight"]
    with pytest.raises(ValueError, match=r"missing key 'model.norm.weight'"):
        engine.update_weights_from_state_dict(state, version=1)
    with pytest.raises(FileNotFoundError):
        engine.update_weights(str(tmp_path / "nowhere"), version=1)
    assert engine.version == 0
    for got, want in zip(engine.generate(PROMPTS, greedy()), before, strict=True):
        assert_same(got, want)


def test_engine_loads_a_model_directory(tmp_path) -> None:
    model = tiny_model(0)
    model.save_pretrained(str(tmp_path / "m"))
    with BuiltinEngine(str(tmp_path / "m")) as from_dir, BuiltinEngine(model) as from_module:
        for got, want in zip(
            from_dir.generate(PROMPTS, greedy()), from_module.generate(PROMPTS, greedy()), strict=True
        ):
            assert_same(got, want)


def test_busy_seconds_count_forward_passes_not_idle_time() -> None:
    with BuiltinEngine(tiny_model()) as eng:
        assert eng.busy_seconds == 0.0
        t0 = time.perf_counter()
        eng.generate([[5, 6, 7]], greedy(16))
        time.sleep(0.1)  # the pass that resolved the request finishes its accounting
        busy = eng.busy_seconds
        assert 0.0 < busy <= time.perf_counter() - t0
        time.sleep(0.3)  # idle: no request, no forward pass
        assert eng.busy_seconds == busy


def test_engine_failures_are_engine_errors_that_the_harness_retries():
    """A closed engine and a forward pass that raises both surface as ``EngineError`` (infrastructure)."""
    import pytest
    import torch

    from albatross.engine.base import EngineError, SamplingParams
    from albatross.engine.builtin import BuiltinEngine
    from albatross.trainer.model import tiny_causal_lm

    model = tiny_causal_lm(64, 32, 1)
    model.model.norm.weight = torch.nn.Parameter(torch.ones(7))  # every forward pass now fails (shape mismatch)
    engine = BuiltinEngine(model, fast_forward=False)
    with pytest.raises(EngineError, match="built-in engine"):
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    engine.close()
    with pytest.raises(EngineError):
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))


def test_sampling_params_default_to_the_sampling_section_and_come_from_it() -> None:
    from albatross.config import SamplingConfig

    neutral, section = SamplingParams(), SamplingConfig()
    assert (neutral.temperature, neutral.top_p, neutral.top_k) == (section.temperature, section.top_p, section.top_k)
    params = SamplingParams.from_config(SamplingConfig(temperature=0.3, top_p=0.9, top_k=5), 12, [2], seed=4)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.3, 0.9, 5, 12)
    assert (params.stop_token_ids, params.seed, params.stop) == ([2], 4, [])


def test_metrics_report_the_model_the_counters_and_closing() -> None:
    model = tiny_model(0)
    engine = BuiltinEngine(model)
    assert engine.metrics().positions == model.config.max_position_embeddings
    engine.generate([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=4))
    measured = engine.metrics()
    assert measured.stats is not None and (measured.stats.requests, measured.stats.generated_tokens) == (1, 4)
    assert (measured.closed, measured.running_requests, measured.waiting_requests) == (False, 0, 0)
    assert measured.prefix_cache_tokens == 3 + 4 - 1  # the finished request's ids but the last
    engine.close()
    assert engine.metrics().closed
