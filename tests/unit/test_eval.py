import pytest

from albatross.eval.run import EvalResult, pass_at_k
from albatross.records import Reward, Trajectory


def test_pass_at_k_hand_values():
    assert pass_at_k(5, 0, 1) == 0.0
    assert pass_at_k(5, 5, 3) == 1.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    # n=4, c=2, k=2: 1 - C(2,2)/C(4,2) = 1 - 1/6
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)


def _t(task, ok, tokens, status="ok"):
    return Trajectory(task, "g", 0, reward=Reward(success=ok), status=status, completion_tokens=tokens)


def test_eval_result_ignores_infra_errors():
    r = EvalResult([_t("a", True, 10), _t("a", False, 20), _t("b", False, 5),
                    _t("b", False, 5, status="infra_error")])
    assert r.pass_at_1 == pytest.approx((0.5 + 0.0) / 2)
    assert r.tokens_per_solve == 10
