"""One source of truth for settings: the run config reaches every part, and the parts agree with it."""

import json
import random

import pytest
import torch

from albatross.config import RunConfig, default, load_config
from albatross.records import Batch, Sample, TrainSample
from albatross.rl.losses import LOSSES
from albatross.trainer.model import tiny_causal_lm
from albatross.trainer.step import Trainer

VOCAB = 64


def _batch(seed: int = 0) -> Batch:
    rng = random.Random(seed)
    samples = []
    for n, adv in ((12, 1.0), (9, -0.5), (15, 0.5)):
        mask = [0] * 3 + [1] * (n - 3)
        samples.append(TrainSample(Sample([rng.randrange(VOCAB) for _ in range(n)], mask,
                                          [-rng.uniform(2.0, 5.0) if m else 0.0 for m in mask],
                                          [0 if m else -1 for m in mask]), adv))
    return Batch(samples=samples, groups=1, min_version=0)


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_every_rl_loss_of_the_config_trains_a_step(loss):
    cfg = load_config(None, [f"rl.loss={loss}", "trainer.micro_batch_tokens=64"])
    trainer = Trainer.from_config(tiny_causal_lm(VOCAB, 32, 1), cfg)
    before = [p.detach().clone() for p in trainer.params]
    metrics = trainer.step(_batch())
    assert torch.isfinite(torch.tensor(metrics["loss"])) and metrics["tokens"] > 0
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, trainer.params, strict=True))


def test_the_trainer_scores_tokens_at_the_sampling_temperature():
    """Importance ratios compare like with like: the trainer's log-probs of tokens the engine sampled at
    temperature 0.5 equal the engine's own log-probs (they would not at temperature 1)."""
    from albatross.engine.base import SamplingParams
    from albatross.engine.builtin import BuiltinEngine

    torch.manual_seed(0)
    model = tiny_causal_lm(VOCAB, 32, 1)
    prompt = [1, 2, 3, 4]
    with BuiltinEngine(model, fast_forward=False) as engine:
        out = engine.generate([prompt], SamplingParams(temperature=0.5, max_tokens=12, seed=3))[0]
    ids = prompt + out.token_ids
    sample = Sample(ids, [0] * len(prompt) + [1] * len(out.token_ids), [0.0] * len(prompt) + out.logprobs,
                    [-1] * len(prompt) + [0] * len(out.token_ids))
    batch = Batch(samples=[TrainSample(sample, 1.0)], groups=1, min_version=0)
    for temperature, close in ((0.5, True), (1.0, False)):
        cfg = load_config(None, [f"sampling.temperature={temperature}"])
        trainer = Trainer.from_config(model, cfg)
        assert trainer.policy.temperature == temperature
        metrics = trainer.step(batch)  # mismatch_kl is measured before the update
        assert (metrics["mismatch_kl"] < 1e-6) is close, (temperature, metrics["mismatch_kl"])


def test_code_defaults_are_the_config_defaults():
    """A default is written once: the trainer's and the losses' own defaults are the config's."""
    import inspect

    from albatross.rl.losses import tis_loss

    tc = RunConfig().trainer
    trainer = Trainer(tiny_causal_lm(VOCAB, 32, 1))  # no sections given: the config's
    group = trainer.optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"]) == (tc.lr, tc.weight_decay)
    assert (trainer.grad_clip, trainer.micro_batch_tokens) == (tc.grad_clip, tc.micro_batch_tokens)
    assert trainer.policy.chunk_size == tc.logprob_chunk and trainer.loss_only == tc.logprob_loss_only
    loss_params = inspect.signature(tis_loss).parameters
    rl = RunConfig().rl
    assert loss_params["p_floor"].default == rl.p_floor and loss_params["n_floor"].default == rl.n_floor
    assert loss_params["cap"].default == rl.is_cap == default("rl", "is_cap")


def test_evaluation_samples_at_eval_temperature(tmp_path):
    from albatross.harness.agent import build_agent
    from albatross.pipeline.demo import demo_tokenizer
    from albatross.pipeline.driver import Pipeline
    from albatross.sandbox.process import ProcessBackend

    cfg = load_config(None, ["sampling.temperature=1.0", "eval.temperature=0.3", f"out={json.dumps(str(tmp_path))}"])
    pipeline = Pipeline(cfg)
    backend = ProcessBackend()
    try:
        evaluator = build_agent(pipeline.eval_config(), None, backend, demo_tokenizer())
        trainer_side = build_agent(cfg, None, backend, demo_tokenizer())
    finally:
        backend.close()
    assert evaluator.sampling.temperature == 0.3 and trainer_side.sampling.temperature == 1.0


def test_empty_families_are_the_demos_three_as_the_config_says(tmp_path):
    from albatross.config import TasksConfig
    from albatross.tasks.builtin import DEMO_FAMILIES, generate_tasks
    from albatross.tasks.format import load_tasks

    assert "empty: the demo's three" in TasksConfig.model_fields["families"].description
    paths = generate_tasks(tmp_path, families=RunConfig().tasks.families or None, n_train=30, n_heldout=0, seed=0)
    families = {t.metadata.get("family") for t in load_tasks(paths["train"])}
    assert families == set(DEMO_FAMILIES)


def test_the_warm_start_cache_key_hashes_the_tasks_contents(tmp_path):
    from albatross.pipeline.demo import demo_tokenizer
    from albatross.pipeline.warmstart import cache_key
    from albatross.tasks.builtin import generate_tasks
    from albatross.tasks.format import load_tasks

    cfg, tok = RunConfig(), demo_tokenizer()
    keys = []
    for seed in (0, 1):
        paths = generate_tasks(tmp_path / str(seed), n_train=6, n_heldout=0, seed=seed)
        keys.append(cache_key(cfg, "oracle", tok, load_tasks(paths["train"]), None))
    again = cache_key(cfg, "oracle", tok, load_tasks(tmp_path / "0" / "train"), None)
    assert keys[0] != keys[1] and keys[0] == again
