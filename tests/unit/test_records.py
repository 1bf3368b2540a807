import json

import pytest

from albatross.records import Reward, Sample, Trajectory, Turn, append_jsonl, read_jsonl


def test_sample_extend_and_lengths():
    s = Sample([], [], [], [])
    s.extend([1, 2, 3], model=False)
    s.extend([4, 5], model=True, logprobs=[-0.1, -0.2], versions=[3, 4])
    assert s.loss_mask == [0, 0, 0, 1, 1]
    assert s.versions == [-1, -1, -1, 3, 4]
    assert s.num_model_tokens == 2
    with pytest.raises(ValueError):
        Sample([1, 2], [0], [0.0, 0.0], [-1, -1])


def test_trajectory_json_roundtrip(tmp_path):
    t = Trajectory("task", "g0", 1, samples=[Sample([1, 2], [0, 1], [0.0, -0.5], [-1, 2])],
                   turns=[Turn("a", "ls", "out", 2, 3)], reward=Reward({"x": 1.0}, True, 1.0, 0.0, 1.0))
    path = tmp_path / "t.jsonl"
    append_jsonl(path, t.to_dict())
    with path.open("a") as f:
        f.write('{"truncated": ')  # a line cut short by a crash
    rows = read_jsonl(path)
    assert len(rows) == 1
    back = Trajectory.from_dict(json.loads(json.dumps(rows[0])))
    assert back == t


def test_prune_keeps_what_state_needs(tmp_path):
    from albatross.orchestrator.state import prune_before

    (tmp_path / "checkpoints").mkdir()
    for v in range(1, 6):
        (tmp_path / "checkpoints" / f"trainer-v{v:06d}.pt").write_text("x")
        (tmp_path / "weights" / f"v{v:06d}").mkdir(parents=True)
    prune_before(tmp_path, 3, keep_weights=2)  # the trainer ran ahead to v5; state names v3
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "trainer-v000003.pt", "trainer-v000004.pt", "trainer-v000005.pt"]
    assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v000002", "v000003", "v000004", "v000005"]
