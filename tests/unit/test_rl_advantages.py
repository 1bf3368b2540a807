import pytest

from albatross.rl.advantages import ADVANTAGES, get_advantage_fn, grpo, is_zero_signal, rloo, topk

S = [1.0, 0.0, 0.5, 0.5]
Y = [True, False, False, False]


def test_grpo_centres_on_group_mean():
    adv, metrics = grpo(S, Y)
    assert adv == pytest.approx([0.5, -0.5, 0.0, 0.0])
    assert metrics["adv/mean"] == pytest.approx(0.0)
    assert metrics["adv/max"] == pytest.approx(0.5)


def test_grpo_std_normalize():
    # population std of S is sqrt(0.125)
    adv, _ = grpo(S, Y, std_normalize=True)
    assert adv == pytest.approx([0.5 / 0.125**0.5, -0.5 / 0.125**0.5, 0.0, 0.0], rel=1e-5)


def test_success_offset():
    # mean y = 0.25: success gets +0.2 * 0.75, failures 0.2 * -0.25
    adv, _ = grpo(S, Y, success_offset=0.2)
    assert adv == pytest.approx([0.65, -0.55, -0.05, -0.05])


def test_cap_failures():
    adv, metrics = grpo([1.0, 0.4, 0.0, 0.0], Y, cap_failures=True)
    assert adv == pytest.approx([0.65, 0.0, -0.35, -0.35])
    assert metrics["adv/capped_failures"] == 1.0
    uncapped, _ = grpo([1.0, 0.4, 0.0, 0.0], Y)
    assert uncapped[1] == pytest.approx(0.05)


def test_rloo_leaves_one_out():
    adv, _ = rloo(S, Y)
    assert adv == pytest.approx([2 / 3, -2 / 3, 0.0, 0.0])
    assert rloo([0.7], [False])[0] == [0.0]


def test_topk_centres_on_best_others():
    adv, _ = topk([1.0, 0.0, 0.5, 0.25], Y, k=2)
    assert adv == pytest.approx([0.625, -0.75, -0.125, -0.5])
    # k larger than the group is capped at G - 1
    assert topk([1.0, 0.0], [True, False], k=4)[0] == pytest.approx([1.0, -1.0])
    with pytest.raises(ValueError):
        topk(S, Y, k=0)


def test_is_zero_signal():
    assert is_zero_signal([0.0, 0.0, 0.0], [False, False, False])
    assert is_zero_signal([1.0, 1.0], [True, True])
    assert not is_zero_signal([0.2, 0.3], [False, False])
    assert not is_zero_signal([0.5, 0.5], [True, False])
    assert grpo([0.0, 0.0], [False, False])[1]["adv/zero_signal"] == 1.0


def test_registry_binds_knobs_once():
    assert set(ADVANTAGES) == {"grpo", "rloo", "topk"}
    fn = get_advantage_fn("topk", k=2, success_offset=0.1)
    assert fn(S, Y)[0] == pytest.approx(topk(S, Y, k=2, success_offset=0.1)[0])
    with pytest.raises(ValueError, match="unknown advantage"):
        get_advantage_fn("ppo")
    with pytest.raises(ValueError):
        get_advantage_fn("grpo", k=2)


def test_length_mismatch_rejected():
    with pytest.raises(ValueError):
        grpo([1.0], [True, False])
    with pytest.raises(ValueError):
        grpo([], [])
