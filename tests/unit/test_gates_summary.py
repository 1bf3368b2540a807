"""`tasks validate`'s per-reason summary: failures counted per gate and reason category, in the JSON
report and as a table."""

from __future__ import annotations

import pytest

from albatross.tasks.gates import (
    FAIL,
    GATES,
    PASS,
    SKIP,
    Gate,
    TaskReport,
    format_table,
    reason_category,
    reason_summary,
    reports_json,
)


@pytest.mark.parametrize(
    ("gate", "reason", "category"),
    [
        ("offline", "the build needs the network: fatal: unable to access 'https://github.com/a/b/': Could not "
         "resolve host: github.com", "needs github.com"),
        ("build", "/t/Dockerfile:2: ADD https://huggingface.co/m.bin: needs huggingface.co (the build has no "
         "network)", "needs huggingface.co"),
        ("offline", "the build needs the network: apt-get install albatross-no-such-package",
         "needs the network: apt-get install"),
        ("offline", "the build needs the network", "needs the network"),
        ("offline", "the oracle needs the network: fatal: unable to access 'https://github.com/a/b.git/': CONNECT "
         "tunnel failed, response 403", "needs github.com"),  # refused by the registries policy's proxy
        ("oracle", "passed on a second run, whose verifier saw no change of the oracle's in system paths: its "
         "result varies from run to run (a timing or load-dependent test?); scored 0", "the oracle's result varies"),
        ("oracle", "passes with [verifier] toolchain = \"attempt\": its tests use what the oracle installed",
         "needs the attempt's toolchain (an override)"),
        ("offline", "the oracle needs the network: albatross-offline: needs the network: apt-get install curl (not "
         "installed on the local base)", "needs the network: apt-get install"),
        ("oracle", "scored 0; solve.sh exited with 1: qemu-system-x86_64: Could not access KVM kernel module",
         "needs KVM"),
        ("oracle", "scored 0; RuntimeError: Found no NVIDIA driver on your system", "needs a GPU"),
        ("build", "/t/Dockerfile:4: unsupported instruction FROBNICATE", "unsupported instruction FROBNICATE"),
        ("build", "/t/Dockerfile:3: RUN exited with 2: make: *** [all] Error 2", "a RUN step fails"),
        ("build", "/t/Dockerfile:1: FROM alpine:3.19: no base for alpine", "no base for the FROM image"),
        ("oracle", "scored 0.5, failing answer_correct", "oracle scores below 1"),
        ("determinism", "noop results differ over 3 runs: reward 0 {} vs reward 0.5 {}",
         "noop results differ between runs"),
        ("leakage", "tests/expected.txt is readable in the image at /app/out.txt",
         "a test or solution file is readable in the image"),
        ("resources", "the oracle needs more than [agent] timeout_sec 10 s (took 31.0 s with more time)",
         "the oracle needs more time"),
        ("reward", "oracle: reward.txt: nan is not a finite number in [0, 1]", "malformed reward"),
    ],
)
def test_reason_categories(gate: str, reason: str, category: str) -> None:
    assert reason_category(gate, reason) == category


def report(name: str, failing: dict[str, str]) -> TaskReport:
    gates = {g: Gate(FAIL, failing[g]) if g in failing else Gate(PASS) for g in GATES}
    if failing:
        gates["reward"] = Gate(SKIP, "an earlier gate failed")  # skips are not failures
    return TaskReport(name, f"/tasks/{name}", gates)


REPORTS = [
    report("a", {"offline": "the build needs the network: Could not resolve host: github.com"}),
    report("b", {"offline": "the oracle needs the network: curl: (6) Could not resolve host: github.com"}),
    report("c", {"oracle": "scored 0", "leakage": "tests/x is readable in the image at /app/x"}),
    report("d", {}),
    report("e", {"offline": "the build needs the network: Could not resolve host: huggingface.co"}),
]


def test_summary_counts_tasks_per_gate_and_reason() -> None:
    assert reason_summary(REPORTS) == [
        {"gate": "offline", "reason": "needs github.com", "count": 2, "tasks": ["a", "b"]},
        {"gate": "oracle", "reason": "oracle scores below 1", "count": 1, "tasks": ["c"]},
        {"gate": "leakage", "reason": "a test or solution file is readable in the image", "count": 1,
         "tasks": ["c"]},
        {"gate": "offline", "reason": "needs huggingface.co", "count": 1, "tasks": ["e"]},
    ]
    summary = reports_json(REPORTS)["summary"]
    assert summary["failures_by_gate"] == {**{g: 0 for g in GATES}, "offline": 3, "oracle": 1, "leakage": 1}
    assert summary["failures_by_reason"] == reason_summary(REPORTS)
    assert (summary["tasks"], summary["passed"]) == (5, 1)


def test_table_shows_the_reasons_before_the_total() -> None:
    lines = format_table(REPORTS).splitlines()
    start = lines.index("failures by reason:")
    assert lines[start + 1].split() == ["gate", "tasks", "reason"]
    assert lines[start + 2].split() == ["offline", "2", "needs", "github.com", "(a,", "b)"]
    assert lines[start + 5].split() == ["offline", "1", "needs", "huggingface.co", "(e)"]
    assert lines[-1].startswith("5 tasks: 1 passed all nine gates, 4 did not")


def test_no_failures_no_reason_table() -> None:
    assert "failures by reason:" not in format_table([report("d", {})])
    assert reason_summary([report("d", {})]) == []


def _timed_gater(calls: list[str]):  # stands in for gate_task: each "task" is its gating time in seconds
    import time as _time

    def gate(path, backend, options, stop=None):  # noqa: ANN001, ANN202
        calls.append(str(path))
        if str(path) == "until-stopped":  # a long task: it stops at its next step once told to
            stopped = stop.wait(10)
            calls.append(f"stopped={stopped}")
        else:
            _time.sleep(float(str(path)))
        return TaskReport(task=str(path), path=str(path))

    return gate


def test_tasks_are_reported_as_they_finish_and_returned_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    from albatross.tasks import gates

    calls: list[str] = []
    monkeypatch.setattr(gates, "gate_task", _timed_gater(calls))
    seen: list[str] = []
    reports = gates.validate(["0.6", "0.05"], None, gates.GateOptions(parallelism=2),  # type: ignore[arg-type]
                             progress=lambda r: seen.append(r.task))
    assert seen == ["0.05", "0.6"]  # the fast task's checkpoint does not wait for the slow one
    assert [r.task for r in reports] == ["0.6", "0.05"]


def test_an_interrupt_drops_the_queued_tasks(monkeypatch: pytest.MonkeyPatch) -> None:
    from albatross.tasks import gates

    calls: list[str] = []
    monkeypatch.setattr(gates, "gate_task", _timed_gater(calls))

    def interrupt(report: TaskReport) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        gates.validate(["0.05"] * 20, None, gates.GateOptions(parallelism=1),  # type: ignore[arg-type]
                       progress=interrupt)
    assert len(calls) <= 2  # the one reported, perhaps the next already started; never the other 18


def test_an_interrupt_stops_the_tasks_being_gated(monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from albatross.tasks import gates

    calls: list[str] = []
    monkeypatch.setattr(gates, "gate_task", _timed_gater(calls))

    def interrupt(report: TaskReport) -> None:
        raise KeyboardInterrupt

    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        gates.validate(["until-stopped", "0.05"], None, gates.GateOptions(parallelism=2),  # type: ignore[arg-type]
                       progress=interrupt)
    deadline = time.monotonic() + 5
    while "stopped=True" not in calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "stopped=True" in calls and time.monotonic() - start < 5, calls
