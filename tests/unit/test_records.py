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
