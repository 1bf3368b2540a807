from albatross.config import RLConfig
from albatross.orchestrator.buffer import GroupScorer, make_batch
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
