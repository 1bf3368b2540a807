"""Progress a person can plan by: the plan with estimates, bars with elapsed time and ETA (plain lines off a
terminal), every phase's stop with its reason, Ctrl-C included; estimates learnt from earlier runs."""

import io
import re

import pytest

from albatross.progress import Bar, Phase, Plan, Timings, fmt_duration


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_plan_names_each_phase_with_an_estimate_and_an_eta():
    lines: list[str] = []
    plan = Plan([Phase("tasks", 2), Phase("warm-start", 150, bound=True), Phase("train", 600, bound=True)],
                lines.append)
    plan.announce()
    assert lines[0].startswith("[plan] tasks ~2s, warm-start <= 2m30s, train <= 10m00s; eta 12m32s (about ")
    assert re.search(r"about \d\d:\d\d\)$", lines[0])
    unknown: list[str] = []
    Plan([Phase("train", 60, bound=True), Phase("trained eval", None)], unknown.append).announce()
    assert "trained eval ~?" in unknown[0] and "eta at least 1m00s" in unknown[0]


def test_each_phase_says_why_it_stopped_and_what_is_left():
    lines: list[str] = []
    plan = Plan([Phase("warm-start", 100), Phase("train", 300)], lines.append)
    with plan.phase("warm-start") as ph:
        ph.reason = "target reached at step 75"
    assert lines[-1].startswith("[warm-start] stopped: target reached at step 75 after 0s; run: ")
    assert lines[-1].endswith("about 5m00s left")
    with pytest.raises(KeyboardInterrupt), plan.phase("train"):
        raise KeyboardInterrupt
    assert lines[-1].startswith("[train] stopped: Ctrl-C after")


def test_a_plain_bar_prints_done_elapsed_and_eta_at_least_every_tenth():
    lines: list[str] = []
    plan = Plan([Phase("base eval", 40), Phase("train", 60)], lines.append)
    bar = Bar("base eval", 20, lines.append, stream=io.StringIO(), unit="attempts", plan=plan)
    for done in range(1, 21):
        bar.update(done)
    bar.close()
    assert 10 <= len(lines) <= 20
    assert re.fullmatch(r"\[base eval\] 20/20 attempts  elapsed \d+s  eta 0s  \(run: about 1m00s left\)", lines[-1])


def test_set_up_before_the_first_unit_is_not_the_pace(monkeypatch):
    """A phase whose first unit comes after minutes of set-up (demonstrations before the first warm-start step)
    says "eta ?" until a second unit gives the pace, then the pace from the first unit on."""
    import albatross.progress as progress

    now = [1000.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    lines: list[str] = []
    bar = Bar("warm-start", 600, lines.append, stream=io.StringIO())
    now[0] += 138.0
    bar.update(1)
    assert bar.eta_s() is None and "eta ?" in lines[-1]
    now[0] += 10.0
    bar.update(11)
    assert bar.eta_s() == pytest.approx(589.0)
    bar.update(600)
    assert bar.eta_s() == 0.0


def test_a_terminal_gets_a_bar_with_eta_and_lines_above_it():
    stream, lines = _Tty(), []
    bar = Bar("train", 10, lines.append, stream=stream, unit="steps")
    bar.write("[train] step 1/10 ...")
    bar.update(1, extra="pass 0.5", eta_cap_s=30)
    bar.close()
    text = stream.getvalue()
    assert "[train] step 1/10 ..." in text and "1/10 steps" in text and "eta" in text and "pass 0.5" in text
    assert lines == []  # on a terminal everything goes through the bar


def test_timings_are_learnt_from_earlier_runs(tmp_path):
    path = tmp_path / "timings.json"
    first = Timings(path, "model-a|local", {"rl_step": 2.5})
    assert first.rate("rl_step") == 2.5 and first.rate("eval_attempt") is None
    first.record("rl_step", 30.0, 10)
    first.record("eval_attempt", 5.0, 0)  # nothing done: nothing learnt
    assert Timings(path, "model-a|local").rate("rl_step") == 3.0
    assert Timings(path, "model-b|local").rate("rl_step") is None


@pytest.mark.parametrize("seconds, text", [(None, "?"), (0.4, "0s"), (42, "42s"), (185, "3m05s"), (3720, "1h02m")])
def test_durations_read_plainly(seconds, text):
    assert fmt_duration(seconds) == text
