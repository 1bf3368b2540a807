from albatross.config import RLConfig
from albatross.orchestrator.buffer import BatchBuilder, GroupScorer, make_batch
from albatross.records import Group, Reward, Sample, Trajectory


def _traj(ok: bool, tokens: int) -> Trajectory:
    s = Sample([1] * (tokens + 2), [0, 0] + [1] * tokens, [0.0] * (tokens + 2), [-1, -1] + [3] * tokens)
    return Trajectory("t", "g", 0, samples=[s], reward=Reward({"a": float(ok)}, ok), completion_tokens=tokens)


def test_scoring_grpo_and_negative_scale():
    g = GroupScorer(RLConfig(efficiency_lambda=0.0)).score_group(Group("t", "g", [_traj(True, 4), _traj(False, 4)]))
    assert g.advantages == [0.5, -0.5]
    g = GroupScorer(RLConfig(efficiency_lambda=0.0, negative_scale=0.2)).score_group(
        Group("t", "g", [_traj(True, 4), _traj(False, 4)]))
    assert g.advantages == [0.5, -0.1]


def test_zero_signal_group_dropped_and_batch_versions():
    g = GroupScorer(RLConfig()).score_group(Group("t", "g", [_traj(False, 4), _traj(False, 4)]))
    assert g.dropped == "zero_signal"
    kept = GroupScorer(RLConfig(efficiency_lambda=0.0)).score_group(Group("t", "g", [_traj(True, 3), _traj(False, 5)]))
    batch = make_batch([kept])
    assert batch.min_version == 3 and len(batch.samples) == 2
    assert [s.advantage for s in batch.samples] == [0.5, -0.5]


def test_each_batch_carries_the_groups_seen_and_dropped_since_the_last_one():
    scorer, builder = GroupScorer(RLConfig(efficiency_lambda=0.0)), BatchBuilder(groups_per_step=2)

    def add(ok: list[bool], dropped: str = ""):
        group = scorer.score_group(Group("t", "g", [_traj(o, 4) for o in ok]))
        group.dropped = dropped or group.dropped
        return builder.add(group)

    assert add([False, False]) is None  # zero signal
    assert add([True, False], dropped="infra_error") is None
    assert add([True, False]) is None
    first = add([False, True])
    assert first is not None and first.info == {"groups_seen": 4, "groups_trained": 2,
                                                "dropped_zero_signal": 1, "dropped_infra_error": 1}
    assert add([True, False]) is None
    second = add([True, False])
    assert second is not None and second.info == {"groups_seen": 2, "groups_trained": 2}
    assert builder.counts["groups"] == 6 and builder.counts["dropped_zero_signal"] == 1


def test_trainer_options_of_the_config_reach_the_trainer():
    from albatross.config import load_config
    from albatross.orchestrator.trainer_worker import make_trainer
    from albatross.trainer.model import tiny_causal_lm
    from albatross.trainer.step import Trainer

    cfg = load_config(None, ["trainer.freeze=[\"model.embed_tokens.*\"]", "trainer.logprob_chunk=16",
                             "trainer.activation_checkpointing=true", "trainer.attention=dense",
                             "rl.entropy_coef=0.01"])
    trainer = make_trainer(Trainer, tiny_causal_lm(64), cfg)
    assert trainer.frozen == ["model.embed_tokens.weight"]
    assert trainer.policy.chunk_size == 16 and len(trainer.regularizers) == 1
    assert all(p.requires_grad is False for n, p in trainer.model.named_parameters() if "embed_tokens" in n)
