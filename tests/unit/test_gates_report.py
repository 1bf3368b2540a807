"""Gates without a sandbox: static checks, the report, partial-credit weights; probe scoring and the
difficulty filter (real GroupScorer, real CLI entry point)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from albatross.cli import main
from albatross.config import RLConfig
from albatross.pipeline.probe import probe
from albatross.records import STATUS_INFRA_ERROR, Reward, Trajectory
from albatross.rl.scoring import GroupScorer
from albatross.sandbox.base import ExecResult
from albatross.tasks import load_task, write_task
from albatross.tasks.buildable import dockerfile_notes, dockerfile_problem
from albatross.tasks.filter import filter_rows, format_report, zero_signal_probability
from albatross.tasks.gates import (
    FAIL,
    GATES,
    PASS,
    SKIP,
    Gate,
    GateOptions,
    Run,
    TaskReport,
    _Gater,
    format_table,
    load_test_weights,
    network_reason,
    partial_credit_weights,
    reports_json,
    resource_symptom,
)
from albatross.tasks.leakage import find_static_leaks
from albatross.tasks.probe import MIN_ATTEMPTS, ProbeRow, read_json, score_row, write_json
from albatross.tasks.verify import VerifierRun, VerifyResult

TEST_SH = "#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n"


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ALBATROSS_CACHE", str(tmp_path / ".cache"))


def _task(tmp_path: Path, dockerfile: str = "FROM debian:bookworm-slim\nWORKDIR /app\nCOPY app/ /app/\n",
          env_files: dict[str, str] | None = None):
    return load_task(write_task(tmp_path / "t", instruction="x\n", task_toml={},
                                env_files=env_files or {"app/a.txt": "a\n"}, dockerfile=dockerfile,
                                solve_sh="#!/bin/bash\necho the answer is 42 > out.txt\n", test_sh=TEST_SH))


# ------------------------------------------------------------------------------------ static gates


def test_clean_task_has_no_static_problem(tmp_path: Path) -> None:
    task = _task(tmp_path)
    assert dockerfile_problem(task) == "" and find_static_leaks(task) == []


@pytest.mark.parametrize(
    ("dockerfile", "problem"),
    [
        ("FROM alpine:3.19\nWORKDIR /app\n", ":1: FROM alpine:3.19: cannot be built here"),
        ("FROM debian:bookworm\nFROBNICATE true\n", ":2: unsupported instruction FROBNICATE"),
        ("FROM debian:bookworm\nSHELL /bin/bash -c\n", ":2: SHELL takes the JSON form"),
        ("FROM debian:bookworm AS build\nFROM build\nFROM alpine:3.19\n", ":3: FROM alpine:3.19: "),
    ],
)
def test_dockerfile_that_cannot_be_honoured_names_the_line(tmp_path: Path, dockerfile: str, problem: str) -> None:
    task = _task(tmp_path, dockerfile)
    assert dockerfile_problem(task).startswith(f"{task.dockerfile}{problem}")


def test_ignored_instructions_are_noted_with_their_line(tmp_path: Path) -> None:
    task = _task(tmp_path, "FROM debian:bookworm-slim\nWORKDIR /app\nUSER agent\nEXPOSE 80\nLABEL a=b\n")
    assert dockerfile_problem(task) == ""
    assert dockerfile_notes(task) == [
        "line 4 EXPOSE ignored (attempts have loopback networking only)",
        "line 5 LABEL ignored (metadata only)",
    ]


def test_tests_copied_into_the_environment_leak(tmp_path: Path) -> None:
    task = _task(tmp_path, "FROM debian:bookworm-slim\nWORKDIR /app\nCOPY app/ /app/\nCOPY check/ /tests/\n",
                 env_files={"app/a.txt": "a\n", "app/copy.sh": TEST_SH, "check/x.txt": "x\n"})
    assert find_static_leaks(task) == [
        "tests/test.sh would be readable in the image at /app/copy.sh (copied from environment/ by Dockerfile line 3)",
        f"{task.dockerfile}:4: COPY into /tests/, where the verifier's files go",
    ]


def test_solution_copied_into_the_environment_leaks(tmp_path: Path) -> None:
    task = _task(tmp_path, env_files={"app/solve.sh": "#!/bin/bash\necho the answer is 42 > out.txt\n"})
    assert find_static_leaks(task) == ["solution/solve.sh would be readable in the image at /app/solve.sh (copied "
                                       "from environment/ by Dockerfile line 3)"]


# ------------------------------------------------------------------------------------------ runs


def _exec(code: int = 0, timed_out: bool = False) -> ExecResult:
    return ExecResult("", code, timed_out)


@pytest.mark.parametrize(
    ("solve", "verifier", "symptom"),
    [(_exec(0), _exec(0), False), (_exec(-1, True), _exec(0), True), (_exec(137), _exec(1), True),
     (_exec(0), _exec(-1, True), True), (_exec(1), _exec(1), False),
     (ExecResult("Killed", 0, limit="oom"), _exec(1), True)],  # a step the memory limit killed; the script went on
)
def test_resource_symptoms(solve: ExecResult, verifier: ExecResult, symptom: bool) -> None:
    run = Run("oracle", solve=solve, verifier=VerifierRun(verifier, None, "no reward file"))
    assert resource_symptom(run) is symptom


@pytest.mark.parametrize(
    ("output", "refused", "reason"),
    [("fatal: unable to access 'https://github.com/a/b.git/': CONNECT tunnel failed, response 403", ["github.com"],
      "unable to access 'https://github.com/a/b.git/'"),
     ("E   OSError: Tunnel connection failed: 403 Blocked by network policy", ["github.com"],
      "(refused: github.com)"),
     ("[ERROR] Command exited with code 56", ["opam.ocaml.org"], "needs opam.ocaml.org, which the network policy"),
     ("AssertionError: wrong answer", [], "")],
)
def test_network_reason_names_the_refused_hosts(output: str, refused: list[str], reason: str) -> None:
    run = Run("oracle", solve=ExecResult(output, 1), verifier=VerifierRun(_exec(1), None, "no reward file"),
              refused=refused)
    found = network_reason(run)
    assert reason in found if reason else found == ""
    assert found.count("github.com") <= 1  # a host the evidence names is not named again


@pytest.mark.parametrize(("changes", "hint"), [
    (["/usr/local/bin/pmars"], 'passes with [verifier] toolchain = "attempt": its tests use what the oracle installed '
                               "in system paths (/usr/local/bin/pmars)"),
    ([], "result varies from run to run"),  # nothing the pristine toolchain hides: chance, not the toolchain
])
def test_toolchain_hint_blames_the_toolchain_only_for_changes_it_hides(tmp_path: Path, changes: list[str],
                                                                       hint: str) -> None:
    passed = VerifyResult({}, 1.0, True, system_changes=changes)
    asked: list[str] = []

    def attempt(task: object, kind: str, limits: object, scan: bool = False) -> Run:  # the oracle run again
        asked.append(task.toolchain)
        return Run(kind, solve=_exec(0), verifier=VerifierRun(_exec(0), passed))

    gater = _Gater(TaskReport("t", "/t"), None, GateOptions())  # type: ignore[arg-type]  # no run reaches it
    gater.attempt = attempt  # type: ignore[method-assign]
    failed = Run("oracle", solve=_exec(0), verifier=VerifierRun(_exec(1), VerifyResult({}, 0.0, False)))
    assert hint in gater.toolchain_hint(_task(tmp_path), failed)
    assert asked == ["attempt"]


# ---------------------------------------------------------------------------------------- report


def _report(name: str, failing: dict[str, str] | None = None, untouched: list[str] | None = None) -> TaskReport:
    failing = failing or {}
    gates = {g: Gate(FAIL, failing[g]) if g in failing else Gate(PASS) for g in GATES}
    if failing:
        gates["determinism"] = Gate(SKIP, "needs a reward from both the oracle and the no-op")
    return TaskReport(name, f"/tasks/{name}", gates, untouched=untouched or [])


def test_table_lists_reasons_and_a_total() -> None:
    reports = [_report("good", untouched=["tree_clean"]), _report("bad", {"oracle": "scored 0.5"})]
    table = format_table(reports)
    lines = table.splitlines()
    assert lines[0].split() == ["task", *[f"{i}:{g}" for i, g in enumerate(GATES, 1)]]
    assert lines[1].split() == ["good"] + ["pass"] * 9
    assert lines[2].split() == ["bad", "pass", "pass", "FAIL", "pass", "skip", "pass", "pass", "pass", "pass"]
    assert "  bad: gate 3 oracle: fail: scored 0.5" in lines
    assert "  bad: gate 5 determinism: skip: needs a reward from both the oracle and the no-op" in lines
    assert lines[-1] == "2 tasks: 1 passed all nine gates, 1 did not; failures by gate: oracle 1"


def test_tasks_sharing_an_id_are_shown_by_path() -> None:
    a, b = _report("same"), _report("same")
    b.path = "/other/same"
    lines = format_table([a, b, _report("solo")]).splitlines()
    assert [line.split()[0] for line in lines[1:4]] == ["/tasks/same", "/other/same", "solo"]


def test_partial_credit_weights_round_trip(tmp_path: Path) -> None:
    reports = [_report("good", untouched=["tree_clean", "history_kept"]), _report("other")]
    data = reports_json(reports)
    assert (data["summary"]["tasks"], data["summary"]["passed"], data["summary"]["failures_by_reason"]) == (2, 2, [])
    assert partial_credit_weights(reports) == {"good": {"tree_clean": 0.0, "history_kept": 0.0}}
    (tmp_path / "report.json").write_text(json.dumps(data))
    weights = load_test_weights(tmp_path / "report.json")
    scorer = GroupScorer(RLConfig(), weights)
    assert scorer.test_weights["good"] == {"tree_clean": 0.0, "history_kept": 0.0}


# ------------------------------------------------------------------------------------- probe rows


def _traj(task: str, i: int, success: bool, metrics: dict[str, float], status: str = "ok") -> Trajectory:
    traj = Trajectory(task_id=task, group_id=f"probe-{task}", attempt=i, status=status)
    traj.reward = Reward(metrics=dict(metrics), success=success)
    traj.completion_tokens = 10 + i
    return traj


def test_probe_row_scores_the_group_as_training_does(tmp_path: Path) -> None:
    task = _task(tmp_path)
    trajs = [_traj(task.id, 0, True, {"a": 1, "b": 1}), _traj(task.id, 1, False, {"a": 1, "b": 0}),
             _traj(task.id, 2, False, {"a": 0, "b": 0}), _traj(task.id, 3, False, {}, STATUS_INFRA_ERROR)]
    row = score_row(task, trajs, GroupScorer(RLConfig(), {task.id: {"a": 0.0}}), infra_errors=1)
    assert (row.attempts, row.successes, row.pass_rate, row.zero_signal) == (3, 1, 1 / 3, False)
    assert row.mean_score == pytest.approx((1.0 + 0.0 + 0.0) / 3, abs=1e-4)  # "a" passes untouched: weight 0
    assert (row.infra_errors, row.statuses) == (1, {"ok": 3, STATUS_INFRA_ERROR: 1})


def test_all_failed_group_with_equal_scores_is_zero_signal(tmp_path: Path) -> None:
    task = _task(tmp_path)
    trajs = [_traj(task.id, i, False, {"a": 1, "b": 0}) for i in range(4)]
    assert score_row(task, trajs, GroupScorer(RLConfig())).zero_signal


def test_probe_needs_four_attempts(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least 4"):
        probe(None, [_task(tmp_path)], MIN_ATTEMPTS - 1, GroupScorer(RLConfig()))


# ----------------------------------------------------------------------------------------- filter


def _rows(rates: dict[str, float], attempts: int = 8) -> list[ProbeRow]:
    return [ProbeRow(name, f"/tasks/{name}", attempts, round(rate * attempts), 0.0, rate in (0.0, 1.0))
            for name, rate in rates.items()]


def test_zero_signal_probability() -> None:
    assert zero_signal_probability(0.0, 8) == 1.0 and zero_signal_probability(1.0, 4) == 1.0
    assert zero_signal_probability(0.5, 4) == pytest.approx(2 / 16)


def test_filter_keeps_the_band_and_reports_both_fractions() -> None:
    rows = _rows({"zero": 0.0, "low": 0.125, "edge": 0.25, "mid": 0.5, "high": 0.875, "all": 1.0})
    result = filter_rows(rows, 0.15, 0.85, group_size=4)
    assert [r.task for r in result.kept] == ["edge", "mid"]
    assert [r.task for r in result.dropped] == ["zero", "low", "high", "all"]
    before = sum(zero_signal_probability(r.pass_rate, 4) for r in rows) / 6
    after = (zero_signal_probability(0.25, 4) + zero_signal_probability(0.5, 4)) / 2
    assert (result.expected_before, result.expected_after) == (pytest.approx(before), pytest.approx(after))
    assert (result.observed_before, result.observed_after) == (2 / 6, 0.0)
    assert "kept 2 of 6 tasks with pass rate in [0.15, 0.85]" in format_report(result)


def test_filter_rejects_a_bad_band() -> None:
    with pytest.raises(ValueError, match="0 <= low <= high <= 1"):
        filter_rows([], 0.9, 0.1)


def test_filter_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_json(tmp_path / "probe.json", _rows({"easy": 1.0, "good": 0.5}), {"group_size": 8})
    assert read_json(tmp_path / "probe.json")[0][1].pass_rate == 0.5
    code = main(["tasks", "filter", str(tmp_path / "probe.json"), "--out", str(tmp_path / "kept.txt"),
                 "--json", str(tmp_path / "filter.json")])
    assert code == 0
    assert (tmp_path / "kept.txt").read_text() == "/tasks/good\n"
    data = json.loads((tmp_path / "filter.json").read_text())
    assert data["kept"] == ["good"] and data["group_size"] == 8
    assert data["zero_signal_expected"] == {"before": round((1 + 2 / 256) / 2, 4), "after": round(2 / 256, 4)}
    assert "zero-signal groups of 8 expected: 50.4% before, 0.8% after" in capsys.readouterr().out


def test_filter_cli_user_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "bad.json").write_text('{"rows": []}')
    assert main(["tasks", "filter", str(tmp_path / "bad.json")]) == 2
    assert main(["tasks", "filter", str(tmp_path / "missing.json")]) == 2
    write_json(tmp_path / "ok.json", _rows({"a": 0.5}), {})
    assert main(["tasks", "filter", str(tmp_path / "ok.json"), "--low", "0.9", "--high", "0.2"]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert errors[0].startswith(f"albatross: error: {tmp_path / 'bad.json'}: not a probe table")
    assert len(errors) == 3 and all(e.startswith("albatross: error: ") for e in errors)


def test_report_round_trips_for_resume() -> None:
    from albatross.tasks.gates import TaskReport as Report

    report = Report(task="t", path="/x/t", gates={g: Gate(PASS, f"r {g}") for g in GATES}, untouched=["a"],
                    tests=["a", "b"], notes={"build_s": 1.5}, seconds=3.25)
    again = Report.from_dict(json.loads(json.dumps(report.to_dict())))
    assert again == report and again.passed


def test_task_limits_are_the_tasks_within_the_runs_ceiling(tmp_path: Path) -> None:
    import dataclasses

    from albatross.sandbox.base import Limits
    from albatross.tasks.gates import GateOptions, task_limits

    task = dataclasses.replace(_task(tmp_path), memory_mb=4096, storage_mb=10240, cpus=2.0)
    own = task_limits(task, GateOptions(network="registries"))
    assert (own.memory_mb, own.disk_mb, own.cpus, own.network) == (4096, 10240, 0.0, "registries")
    run = GateOptions(network="registries", ceiling=Limits(memory_mb=2048, disk_mb=20000, cpus=1.0))
    capped = task_limits(task, run)
    assert (capped.memory_mb, capped.disk_mb, capped.cpus, capped.network) == (2048, 10240, 1.0, "registries")
    assert task_limits(task, run, 3.0).memory_mb == 6144
