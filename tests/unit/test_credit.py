"""rl.credit: which tokens of a failed attempt are trained (orchestrator/buffer.credited)."""

import pytest

from albatross.orchestrator.buffer import credited, make_batch
from albatross.records import Group, Sample, Trajectory


def _sample(tokens: list[int], model: list[int]) -> Sample:
    """Prompt/observation tokens have mask 0, the model's 1 (``model``: their positions)."""
    mask = [int(i in model) for i in range(len(tokens))]
    return Sample(token_ids=tokens, loss_mask=mask, logprobs=[-0.1 * m for m in mask],
                  versions=[0 if m else -1 for m in mask])


def _group(trajs: list[list[Sample]], advantages: list[float]) -> Group:
    return Group("t", "g", [Trajectory("t", "g", i, samples=s) for i, s in enumerate(trajs)], advantages)


def test_all_keeps_every_model_token() -> None:
    good = [_sample([1, 2, 3, 4], [2, 3])]
    bad = [_sample([1, 2, 9, 4], [2, 3]), _sample([1, 2, 9, 4, 5, 6], [4, 5])]
    group = _group([good, bad], [1.0, -1.0])
    assert credited(group, "all") == [good, bad]


def test_divergence_cuts_a_failure_after_its_first_unshared_token() -> None:
    good = [_sample([1, 2, 3, 4], [2, 3])]
    bad = [_sample([1, 2, 3, 8, 7], [2, 3, 4]), _sample([1, 2, 3, 8, 7, 5, 6], [5, 6])]
    group = _group([good, bad], [1.0, -1.0])
    kept_good, kept_bad = credited(group, "divergence")
    assert kept_good == good  # successes are untouched
    assert kept_bad[0].loss_mask == [0, 0, 1, 1, 0]  # shared 3 tokens, the diverging 8 included, 7 not
    assert kept_bad[1].loss_mask == [0] * 7  # the turns after the divergence give no gradient
    assert bad[0].loss_mask == [0, 0, 1, 1, 1]  # the trajectory's own record is not changed
    batch = make_batch([group], "divergence")
    assert sum(sum(s.sample.loss_mask) for s in batch.samples if s.advantage < 0) == 2


def test_divergence_uses_the_longest_shared_prefix_and_leaves_groups_without_a_success() -> None:
    goods = [[_sample([1, 5, 6, 7], [1, 2, 3])], [_sample([1, 2, 3, 7], [1, 2, 3])]]
    bad = [_sample([1, 2, 3, 9], [1, 2, 3])]
    _, _, kept = credited(_group([*goods, bad], [1.0, 1.0, -2.0]), "divergence")
    assert kept[0].loss_mask == [0, 1, 1, 1]  # diverges from the second success at its last token
    failures = [bad, [_sample([1, 4], [1])]]
    assert credited(_group(failures, [-1.0, 1.0 * 0]), "divergence") == failures  # no positive advantage


def test_unknown_credit_is_refused() -> None:
    with pytest.raises(ValueError, match="rl.credit"):
        credited(_group([[_sample([1], [0])]], [1.0]), "tokens")
