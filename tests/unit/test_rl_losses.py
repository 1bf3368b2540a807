import math

import pytest
import torch

from albatross.rl.losses import (
    LOSSES,
    cispo_loss,
    entropy_bonus,
    get_loss_fn,
    kl_penalty,
    masked_is_loss,
    ppo_clip_loss,
    sft_loss,
    tis_loss,
)


def _lp(probs: list[float], grad: bool = False) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs], dtype=torch.float32, requires_grad=grad)


# Four tokens; the last is a prompt token. Ratios r = new / old: 1, 0.5, 5 (cut to 2), 1.
NEW = [0.5, 0.25, 0.1, 0.2]
OLD = [0.5, 0.5, 0.02, 0.2]
ADV = torch.tensor([1.0, 1.0, -1.0, 2.0])
MASK = torch.tensor([1.0, 1.0, 1.0, 0.0])
VERS = torch.tensor([10, 10, 10, -1])


def test_tis_value_and_gradient():
    new = _lp(NEW, grad=True)
    loss, m = tis_loss(new, _lp(OLD), ADV, MASK, VERS, n_floor=1, current_version=10)
    expected = -(1 * 1 * math.log(0.5) + 0.5 * 1 * math.log(0.25) + 2 * -1 * math.log(0.1)) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    loss.backward()
    assert new.grad.tolist() == pytest.approx([-1 / 3, -1 / 6, 2 / 3, 0.0], rel=1e-6)
    assert m["tokens"] == 3.0
    assert m["truncated_fraction"] == pytest.approx(1 / 3)
    kl = [0.0, 0.5 + math.log(2) - 1, 5 - math.log(5) - 1]
    assert m["mismatch_kl"] == pytest.approx(sum(kl) / 3, rel=1e-5)
    assert m["ratio_max"] == pytest.approx(5.0, rel=1e-5)


def test_tis_cap_changes_the_weight():
    new = _lp(NEW, grad=True)
    tis_loss(new, _lp(OLD), ADV, MASK, VERS, n_floor=1, current_version=10, cap=10.0)[0].backward()
    assert new.grad[2].item() == pytest.approx(5 / 3, rel=1e-5)


def test_stale_tokens_give_no_gradient():
    new = _lp(NEW, grad=True)
    versions = torch.tensor([10, 3, 4, -1])  # staleness 0, 7 (> 6: dropped), 6 (kept)
    loss, m = tis_loss(new, _lp(OLD), ADV, MASK, versions, n_floor=1, current_version=10)
    loss.backward()
    assert new.grad[1].item() == 0.0
    assert new.grad[0].item() == pytest.approx(-1 / 3) and new.grad[2].item() == pytest.approx(2 / 3)
    assert m["stale_tokens_dropped"] == 1.0
    assert m["staleness_max"] == 7.0
    assert m["staleness_mean"] == pytest.approx(13 / 3)
    assert m["staleness_hist/0"] == 1.0 and m["staleness_hist/6"] == 1.0
    assert "staleness_hist/7" not in m


def test_loss_floor_only_stops_negative_advantage_tokens():
    new = _lp([0.1, 0.1, 0.5], grad=True)
    adv = torch.tensor([1.0, -1.0, -1.0])
    mask, vers = torch.ones(3), torch.zeros(3, dtype=torch.long)
    loss, m = tis_loss(new, new.detach(), adv, mask, vers, n_floor=1, current_version=0, p_floor=0.2)
    loss.backward()
    assert new.grad.tolist() == pytest.approx([-1 / 3, 0.0, 1 / 3])
    assert m["floored_tokens"] == 1.0
    new.grad = None
    tis_loss(new, new.detach(), adv, mask, vers, n_floor=1, current_version=0, p_floor=0.0)[0].backward()
    assert new.grad[1].item() == pytest.approx(1 / 3)


def test_normalisation_by_batch_tokens_and_floor():
    new, old = _lp(NEW), _lp(OLD)
    base = tis_loss(new, old, ADV, MASK, VERS, n_floor=1, current_version=10)[0].item()
    by_batch = tis_loss(new, old, ADV, MASK, VERS, n_floor=1, current_version=10, num_batch_tokens=12)[0].item()
    floored = tis_loss(new, old, ADV, MASK, VERS, current_version=10, n_floor=30)[0].item()
    assert by_batch == pytest.approx(base * 3 / 12)
    assert floored == pytest.approx(base * 3 / 30)


def test_micro_batch_losses_sum_to_batch_loss():
    new, old = _lp(NEW), _lp(OLD)
    whole = tis_loss(new, old, ADV, MASK, VERS, n_floor=1, current_version=10)[0]
    parts = [
        tis_loss(new[s], old[s], ADV[s], MASK[s], VERS[s], n_floor=1, current_version=10, num_batch_tokens=3)[0]
        for s in (slice(0, 1), slice(1, 4))
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item())


def _ratio_case(ratios: list[float], adv: list[float]) -> tuple[torch.Tensor, torch.Tensor, dict]:
    old = torch.full((len(ratios),), math.log(0.4))
    new = (old + torch.tensor(ratios).log()).requires_grad_(True)
    new.retain_grad()
    args = (old, torch.tensor(adv), torch.ones(len(ratios)), torch.zeros(len(ratios), dtype=torch.long))
    return new, args, {"current_version": 0, "n_floor": 1}


def test_ppo_clip_zero_gradient_when_clipped():
    new, args, kw = _ratio_case([1.5, 1.0, 1.5], [1.0, 1.0, -1.0])
    loss, m = ppo_clip_loss(new, *args, **kw)
    loss.backward()
    # token 0: clipped (r > 1.28, A > 0) -> no gradient; token 1: -A r / N; token 2: A < 0 keeps r A.
    assert new.grad.tolist() == pytest.approx([0.0, -1 / 3, 1.5 / 3], rel=1e-5)
    expected = -(1.28 * 1 + 1.0 * 1 + 1.5 * -1) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert m["truncated_fraction"] == pytest.approx(1 / 3)


def test_cispo_keeps_gradient_of_clipped_tokens():
    new, args, kw = _ratio_case([1.5, 0.5, 1.0], [1.0, 1.0, 1.0])
    loss, m = cispo_loss(new, *args, **kw)
    loss.backward()
    assert new.grad.tolist() == pytest.approx([-1.28 / 3, -0.8 / 3, -1 / 3], rel=1e-5)
    assert m["truncated_fraction"] == pytest.approx(2 / 3)


def test_masked_is_drops_tokens_outside_the_band():
    new, args, kw = _ratio_case([1.0, 0.25, 3.0], [1.0, 1.0, 1.0])
    loss, m = masked_is_loss(new, *args, **kw)
    loss.backward()
    assert new.grad.tolist() == pytest.approx([-1 / 3, 0.0, 0.0], rel=1e-5)
    assert loss.item() == pytest.approx(-math.log(0.4) / 3, rel=1e-5)
    assert m["truncated_fraction"] == pytest.approx(2 / 3)


def test_sft_loss_is_masked_mean_nll():
    lp = _lp([0.5, 0.25, 0.1])
    loss, m = sft_loss(lp, torch.tensor([1.0, 0.0, 1.0]))
    assert loss.item() == pytest.approx(-(math.log(0.5) + math.log(0.1)) / 2)
    assert sft_loss(lp, torch.tensor([1.0, 0.0, 1.0]), num_batch_tokens=4)[0].item() == pytest.approx(
        loss.item() / 2
    )
    assert m["tokens"] == 2.0


def test_empty_mask_gives_zero_loss():
    loss, m = tis_loss(
        _lp([0.5], grad=True), _lp([0.5]), torch.ones(1), torch.zeros(1), torch.zeros(1), n_floor=1, current_version=0
    )
    assert loss.item() == 0.0 and m["tokens"] == 0.0


def test_registry():
    assert set(LOSSES) == {"tis", "ppo_clip", "masked_is", "cispo"}
    fn = get_loss_fn("tis", cap=10.0)
    new = _lp(NEW)
    assert fn(new, _lp(OLD), ADV, MASK, VERS, n_floor=1, current_version=10)[0].item() == pytest.approx(
        tis_loss(new, _lp(OLD), ADV, MASK, VERS, n_floor=1, current_version=10, cap=10.0)[0].item()
    )
    with pytest.raises(ValueError, match="unknown loss"):
        get_loss_fn("kl")
    with pytest.raises(ValueError):
        get_loss_fn("tis", eps_high=0.3)


def test_kl_penalty_value_and_gradient():
    new = _lp(NEW, grad=True)
    value, m = kl_penalty(new, _lp(OLD), MASK, coef=0.5)
    k3 = [0.0, 0.5 + math.log(2) - 1, 5 - math.log(5) - 1]  # r - log r - 1 with r = 1, 0.5, 5
    assert value.item() == pytest.approx(0.5 * sum(k3) / 3, rel=1e-5)
    assert m["kl_penalty"] == pytest.approx(value.item())
    value.backward()
    # d/dlogp (r - log r - 1) = r - 1; the prompt token gives nothing
    assert new.grad.tolist() == pytest.approx([0.0, 0.5 * -0.5 / 3, 0.5 * 4 / 3, 0.0], rel=1e-5)
    assert kl_penalty(new, _lp(OLD), MASK, coef=0.5, num_batch_tokens=6)[0].item() == pytest.approx(
        value.item() / 2
    )


def test_entropy_bonus_value():
    entropy = torch.tensor([1.0, 2.0, 4.0, 8.0], requires_grad=True)
    value, m = entropy_bonus(entropy, MASK, coef=0.1)
    assert value.item() == pytest.approx(-0.1 * 7 / 3)
    value.backward()
    assert entropy.grad.tolist() == pytest.approx([-0.1 / 3] * 3 + [0.0])
    assert m["entropy_bonus"] == pytest.approx(value.item())


@pytest.mark.parametrize("name", sorted(LOSSES))
def test_every_config_loss_binds_its_knobs_from_the_rl_section(name):
    """Each `rl.loss` gets the knobs of its own variant from `[rl]` (a knob of another variant is refused)."""
    from albatross.config import load_config
    from albatross.rl.losses import loss_knobs

    rl = load_config(None, [f"rl.loss={name}", "rl.n_floor=1"]).rl
    fn = get_loss_fn(name, **loss_knobs(rl))
    new, args, kw = _ratio_case([1.0, 0.5, 1.5], [1.0, -1.0, 1.0])
    loss, m = fn(new, *args, current_version=0)
    loss.backward()
    assert torch.isfinite(loss) and new.grad is not None and m["tokens"] == 3.0
