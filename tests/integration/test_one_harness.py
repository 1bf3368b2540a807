"""One harness for training and evaluation, and token-in/token-out all the way to the trainer."""

from collections import Counter

import pytest

from albatross.config import load_config
from albatross.engine.scripted import ScriptedEngine
from albatross.harness.agent import AttemptSpec
from albatross.harness.chat import TinyTokenizer
from albatross.sandbox import local_available, make_backend
from albatross.tasks.builtin import corpus_strings, generate_tasks
from albatross.tasks.format import load_tasks

pytestmark = pytest.mark.skipif(not local_available(), reason="needs root, user/mount namespaces and overlayfs")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    tasks = load_tasks(generate_tasks(root, n_train=3, n_heldout=0, seed=11)["train"])
    backend = make_backend("local", hide_paths=[str(root)])
    yield tasks, backend, TinyTokenizer.from_corpus(corpus_strings())
    backend.close()


def test_eval_and_train_run_the_same_harness_token_for_token(setup):
    from albatross.eval.run import evaluate
    from albatross.harness.agent import build_agent as make_agent  # what `train` and `eval` both build
    from albatross.harness.retry import run_with_retries

    tasks, backend, tokenizer = setup
    cfg = load_config(None, ["harness.max_turns=8", "harness.max_context_tokens=1024", "harness.max_tokens_per_turn=32"])
    task = tasks[0]
    actions = ["```bash\nls -la /usr/bin\n```", "no block here"] + [f"```bash\n{s}\n```" for s in task.demo_steps]

    eval_agent = make_agent(cfg, None, backend, tokenizer)
    eval_agent.engine = ScriptedEngine(actions, eval_agent.fmt.action, version=2)
    evaluated = evaluate(eval_agent, [task], trials=1, workers=1).trajectories[0]

    train_agent = make_agent(cfg, None, backend, tokenizer)
    train_agent.engine = ScriptedEngine(actions, train_agent.fmt.action, version=2)
    trained = run_with_retries(train_agent, AttemptSpec(task, "g00000", 0), 3, Counter())

    assert evaluated.status == trained.status == "ok" and evaluated.success and trained.success
    assert len(evaluated.samples) == len(trained.samples) >= 1
    for a, b in zip(evaluated.samples, trained.samples, strict=True):
        assert a.token_ids == b.token_ids and a.loss_mask == b.loss_mask and a.versions == b.versions
    assert "bytes left out" in evaluated.turns[0].observation  # the long listing went to a file in both
    assert [t.observation for t in evaluated.turns] == [t.observation for t in trained.turns]


def test_recorded_samples_reproduce_the_engines_logprobs_in_the_trainer(setup):
    import torch

    from albatross.config import HarnessConfig, ModelConfig
    from albatross.engine.base import SamplingParams
    from albatross.engine.builtin import BuiltinEngine
    from albatross.harness.agent import Agent
    from albatross.harness.chat import TinyChatFormat
    from albatross.pipeline.demo import build_tiny
    from albatross.records import TrainSample
    from albatross.sandbox.base import Limits
    from albatross.trainer.packing import pack
    from albatross.trainer.step import Trainer

    tasks, backend, tokenizer = setup
    model = build_tiny(ModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                                   intermediate_size=128, max_positions=1024), tokenizer, seed=3).eval()
    cfg = HarnessConfig(max_turns=14, max_tokens_per_turn=12, max_context_tokens=360, max_format_errors=100)
    cfg = cfg.model_copy(update={"compress_at": 0.9, "compress_target": 0.5, "keep_observations": 1,
                                 "summary_max_tokens": 12})
    agent = Agent(None, backend, TinyChatFormat(tokenizer), cfg, SamplingParams(temperature=1.0, seed=7),
                  Limits(command_timeout_s=5))
    engine = BuiltinEngine(model, max_batch_size=4)
    try:
        traj = agent.run(AttemptSpec(tasks[1], "g", 0), engine=engine)
    finally:
        engine.close()
    assert traj.status != "infra_error", traj.error
    assert "summary" in {c["method"] for c in traj.compressions}  # compression fired mid-attempt
    assert len(traj.samples) >= 3 and 0 < traj.compressions[0]["turn"] < len(traj.turns)

    trainer = Trainer(model, temperature=1.0)
    checked = 0
    for sample in traj.samples:
        (mb,) = pack([TrainSample(sample, 0.0)], max_tokens=4096)
        with torch.no_grad():
            logprobs, _ = trainer.forward_logprobs(mb)
        model_tokens = mb.loss_mask.bool()
        assert torch.allclose(logprobs[model_tokens], mb.logprobs[model_tokens], atol=2e-4), \
            (logprobs[model_tokens] - mb.logprobs[model_tokens]).abs().max()
        checked += int(model_tokens.sum())
    assert checked == traj.completion_tokens  # every model token, the summaries' included


def test_a_seeded_evaluation_gives_the_same_attempts_again_and_draws_apart_per_attempt(setup):
    """`eval.seed` (evaluation's `sampling.seed`): every engine request of an attempt samples with a seed drawn from
    (seed, group, attempt, request), so evaluating the same model again gives the same tokens, while the trials of a
    task and the turns of an attempt draw apart; unseeded (-1), a second evaluation draws anew."""
    from albatross.config import ModelConfig
    from albatross.engine.builtin import BuiltinEngine
    from albatross.eval.run import evaluate
    from albatross.harness.agent import build_agent
    from albatross.pipeline.demo import build_tiny

    tasks, backend, tokenizer = setup
    model = build_tiny(ModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                                   intermediate_size=128, max_positions=1024), tokenizer, seed=5).eval()

    def tokens(seed: int) -> list[list[int]]:
        cfg = load_config(None, ["harness.max_turns=3", "harness.max_tokens_per_turn=12", "harness.max_format_errors=9",
                                 "harness.max_context_tokens=512", f"sampling.seed={seed}"])
        agent = build_agent(cfg, None, backend, tokenizer)
        agent.engine = BuiltinEngine(model, max_batch_size=4)
        try:
            result = evaluate(agent, tasks[:2], trials=2, workers=2)
        finally:
            agent.engine.close()
        assert all(t.status != "infra_error" for t in result.trajectories)
        return [s.token_ids for t in result.trajectories for s in t.samples]

    first, again = tokens(3), tokens(3)
    assert first == again  # the same attempts, token for token
    assert first[0] != first[1] or first[0] != first[2]  # trials and tasks do not share one draw
    assert tokens(-1) != tokens(-1)  # unseeded: each evaluation draws anew
    assert tokens(4) != first
