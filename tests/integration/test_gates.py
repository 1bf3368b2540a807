"""The nine gates on the real sandbox: every built-in family passes; each deliberately broken task fails
exactly the gate it breaks; `albatross tasks validate | new | families | probe | filter` end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from albatross.config import RunConfig
from albatross.engine.scripted import ScriptedEngine
from albatross.harness.agent import build_agent as make_agent
from albatross.harness.chat import TinyTokenizer
from albatross.pipeline.probe import probe
from albatross.rl.scoring import GroupScorer
from albatross.sandbox import LocalBackend, local_available
from albatross.tasks import load_task, load_tasks, write_task
from albatross.tasks.builtin import FAMILIES, corpus_strings, generate_tasks
from albatross.tasks.filter import filter_rows
from albatross.tasks.gates import FAIL, GATES, PASS, GateOptions, TaskReport, validate
from albatross.tasks.overrides import load_overrides

pytestmark = pytest.mark.skipif(not local_available(), reason="the local sandbox needs root, cgroup v1 "
                                "memory/pids controllers, namespaces and overlayfs")

ANSWER = "forty-two"
GOOD_TEST = f"""#!/bin/bash
mkdir -p /logs/verifier
e=0; c=0
if [ -f /app/answer.txt ]; then e=1; [ "$(cat /app/answer.txt)" = "{ANSWER}" ] && c=1; fi
echo "{{\\"answer_exists\\": $e, \\"answer_correct\\": $c}}" > /logs/verifier/reward.json
"""
FLAKY_TEST = f"""#!/bin/bash
mkdir -p /logs/verifier
if [ "$(cat /app/answer.txt 2>/dev/null)" = "{ANSWER}" ]; then
  echo '{{"answer_correct": 1, "stable": 1}}' > /logs/verifier/reward.json
else
  echo "{{\\"answer_correct\\": 0, \\"stable\\": 0.$(printf %03d $((RANDOM % 1000)))}}" > /logs/verifier/reward.json
fi
"""
DOCKERFILE = "FROM debian:bookworm-slim\nWORKDIR /app\nCOPY app/ /app/\n"
# The answer comes from a tool the oracle installs under /usr/local/bin: only the attempt's toolchain has it.
TOOL = {"solve_sh": f"#!/bin/bash\nprintf '#!/bin/sh\\necho {ANSWER}\\n' > /usr/local/bin/answer-tool\n"
                    "chmod +x /usr/local/bin/answer-tool\n",
        "test_sh": GOOD_TEST.replace("if [ -f /app/answer.txt ]; then e=1; [ \"$(cat /app/answer.txt)\"",
                                     "if command -v answer-tool; then e=1; [ \"$(answer-tool)\"")}

# name -> (changes to the good task, the gates it must fail)
BROKEN: dict[str, tuple[dict, set[str]]] = {
    "good": ({}, set()),
    "no-oracle": ({"solve_sh": None}, {"schema"}),
    "alpine-image": ({"dockerfile": DOCKERFILE.replace("debian:bookworm-slim", "alpine:3.19")}, {"build"}),
    "unknown-instruction": ({"dockerfile": DOCKERFILE + "FROBNICATE true\n"}, {"build"}),
    "oracle-fails": ({"solve_sh": "#!/bin/bash\necho forty-one > answer.txt\n"}, {"oracle"}),
    "noop-passes": ({"test_sh": "#!/bin/bash\nmkdir -p /logs/verifier\necho 1 > /logs/verifier/reward.txt\n"},
                    {"noop"}),
    "flaky": ({"test_sh": FLAKY_TEST}, {"determinism"}),
    "readable-tests": ({"env_files": {"app/readme.txt": "hello\n", "app/tests/test.sh": GOOD_TEST}}, {"leakage"}),
    # copied in, then removed by a later RUN (a generator the tests run again): not readable, so no leak
    "tests-removed-in-build": ({"env_files": {"app/readme.txt": "hello\n", "app/tests/test.sh": GOOD_TEST},
                                "dockerfile": DOCKERFILE + "RUN rm -r /app/tests\n"}, set()),
    "tests-in-image": ({"env_files": {"app/readme.txt": "hello\n", "check/notes.txt": "notes\n"},
                        "dockerfile": DOCKERFILE + "COPY check/ /tests/\n"}, {"leakage"}),
    "slow-oracle": ({"agent_timeout": 1, "solve_sh": f"#!/bin/bash\nsleep 2\necho {ANSWER} > answer.txt\n"},
                    {"resources"}),
    "needs-network": ({"allow_internet": True,
                       "solve_sh": "#!/bin/bash\ncurl -fsS https://example.com/answer.txt -o answer.txt\n"},
                      {"offline"}),
    # builds may use the package registries, but a step that needs a host this machine cannot reach (here: the
    # words git prints when github.com does not resolve) is named, and fails the offline gate
    "build-needs-github": ({"dockerfile": DOCKERFILE + "RUN echo \"fatal: unable to access "
                            "'https://github.com/example/repo.git/': Could not resolve host: github.com\" >&2; "
                            "exit 128\n"}, {"offline"}),
    "nan-reward": ({"test_sh": "#!/bin/bash\nmkdir -p /logs/verifier\necho nan > /logs/verifier/reward.txt\n"},
                   {"reward"}),
    "tool-in-usr": (TOOL, {"oracle"}),
    "tool-in-usr-overridden": (TOOL, set()),  # named in OVERRIDES: its verifier runs in the attempt's toolchain
}
OVERRIDES = '[tool-in-usr-overridden]\nreason = "its tests run answer-tool"\nverifier.toolchain = "attempt"\n'


def write_variant(root: Path, name: str, changes: dict) -> Path:
    """The good task ("write forty-two to answer.txt"), with ``changes`` applied."""
    toml = {"agent": {"timeout_sec": changes.get("agent_timeout", 30)}, "verifier": {"timeout_sec": 30},
            "environment": {"memory_mb": 512, "storage_mb": 256, "allow_internet": changes.get("allow_internet",
                                                                                               False)}}
    solve = changes.get("solve_sh", f"#!/bin/bash\necho {ANSWER} > answer.txt\n")
    task_dir = write_task(root / name, instruction=f"Write {ANSWER} to answer.txt.\n", task_toml=toml,
                          env_files=changes.get("env_files", {"app/readme.txt": "hello\n"}),
                          dockerfile=changes.get("dockerfile", DOCKERFILE), solve_sh=solve or "",
                          test_sh=changes.get("test_sh", GOOD_TEST))
    if solve is None:
        (task_dir / "solution" / "solve.sh").unlink()
    return task_dir


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ALBATROSS_CACHE", str(root))
        yield root


@pytest.fixture(scope="module")
def backend(cache: Path) -> Iterator[LocalBackend]:
    backend = LocalBackend(hide_paths=[cache])
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def broken(tmp_path_factory: pytest.TempPathFactory, backend: LocalBackend) -> dict[str, TaskReport]:
    root = tmp_path_factory.mktemp("broken")
    paths = [write_variant(root, name, changes) for name, (changes, _) in BROKEN.items()]
    (root / "overrides.toml").write_text(OVERRIDES)
    options = GateOptions(parallelism=2, overrides=load_overrides(root / "overrides.toml"))
    return {r.task: r for r in validate(paths, backend, options)}


def _failed(report: TaskReport) -> set[str]:
    return {g for g, gate in report.gates.items() if gate.status == FAIL}


@pytest.mark.parametrize("name", list(BROKEN))
def test_each_broken_task_fails_exactly_the_gate_it_breaks(broken: dict[str, TaskReport], name: str) -> None:
    report = broken[name]
    assert set(report.gates) == set(GATES)
    assert _failed(report) == BROKEN[name][1], {g: (x.status, x.reason) for g, x in report.gates.items()}


@pytest.mark.parametrize(
    ("name", "gate", "reason"),
    [
        ("no-oracle", "schema", "solution/solve.sh: missing (the oracle gates need it)"),
        ("alpine-image", "build", "Dockerfile:1: FROM alpine:3.19: cannot be built here"),
        ("unknown-instruction", "build", "Dockerfile:4: unsupported instruction FROBNICATE"),
        ("oracle-fails", "oracle", "scored 0.5, failing answer_correct"),
        ("noop-passes", "noop", "the untouched environment already scores 1 (reward=1)"),
        ("flaky", "determinism", "noop results differ over 3 runs"),
        ("readable-tests", "leakage", "tests/test.sh is readable in the image at /app/tests/test.sh"),
        ("tests-removed-in-build", "leakage", "tests and solution not visible"),
        ("tests-in-image", "leakage", "/tests exists before verification"),
        ("slow-oracle", "resources", "the oracle needs more than [agent] timeout_sec 1 s"),
        ("needs-network", "offline", "the oracle needs the network: albatross-offline: needs the network: "
         "curl https://example.com/answer.txt"),
        ("build-needs-github", "offline", "Dockerfile:4: RUN needs github.com, which the build cannot reach"),
        ("nan-reward", "reward", "reward.txt: nan is not a finite number in [0, 1]"),
        ("tool-in-usr", "oracle", "passes with [verifier] toolchain = \"attempt\": its tests use what the oracle "
         "installed in system paths (/usr/local/bin/answer-tool"),
        ("tool-in-usr-overridden", "schema", "overridden: toolchain = 'attempt' (its tests run answer-tool)"),
    ],
)
def test_failures_say_why(broken: dict[str, TaskReport], name: str, gate: str, reason: str) -> None:
    assert reason in broken[name].gates[gate].reason


def test_good_task_records_timings_and_no_untouched_tests(broken: dict[str, TaskReport]) -> None:
    good = broken["good"]
    assert good.passed and good.untouched == [] and good.tests == ["answer_correct", "answer_exists"]
    assert set(good.notes) == {"build_s", "oracle_s", "verify_s"}


def test_every_builtin_family_passes_the_nine_gates(tmp_path: Path, backend: LocalBackend) -> None:
    hard = generate_tasks(tmp_path / "hard", families=["all"], n_train=len(FAMILIES), n_heldout=0, seed=9,
                          difficulty="hard")
    medium = generate_tasks(tmp_path / "medium", families=["git_repair", "job_control"], n_train=2,
                            n_heldout=0, seed=9, difficulty="medium")
    reports = validate([*hard["train"], *medium["train"]], backend, GateOptions(parallelism=2))
    assert {r.task: r.gates[g].reason for r in reports for g in GATES if r.gates[g].status != PASS} == {}
    untouched = {r.task.split("-", 2)[2]: r.untouched for r in reports[: len(FAMILIES)]}
    assert untouched["fs_surgery"] == ["other_files_kept"]
    assert untouched["git_repair"] == ["history_kept", "tree_clean"]
    assert {"tests_unchanged"} < set(untouched["py_fix"]) and untouched["count_lines"] == []


# ---------------------------------------------------------------------------------------------- CLI


def _cli(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "ALBATROSS_CACHE": str(cache)}
    return subprocess.run([sys.executable, "-m", "albatross.cli", *args], capture_output=True, text=True, env=env,
                          timeout=600)


def test_validate_cli_prints_the_table_and_fails_on_a_bad_task(tmp_path: Path, cache: Path) -> None:
    good = write_variant(tmp_path / "suite", "good", {})
    write_variant(tmp_path / "suite", "oracle-fails", BROKEN["oracle-fails"][0])
    (tmp_path / "o.toml").write_text('[other-task]\nreason = "not in this suite"\nverifier.toolchain = "attempt"\n')
    run = _cli("tasks", "validate", str(good.parent), "--json", str(tmp_path / "gates.json"), "--parallel", "2",
               "--overrides", str(tmp_path / "o.toml"), cache=cache)
    assert run.returncode == 1, run.stderr
    lines = run.stdout.splitlines()
    assert lines[-1] == "2 tasks: 1 passed all nine gates, 1 did not; failures by gate: oracle 1"
    assert any(line.split()[:4] == ["good", "pass", "pass", "pass"] for line in lines)
    report = json.loads((tmp_path / "gates.json").read_text())
    assert [t["passed"] for t in report["tasks"]] == [True, False]
    assert report["tasks"][1]["gates"]["oracle"]["status"] == "fail"
    assert report["summary"]["failures_by_reason"] == [
        {"gate": "oracle", "reason": "oracle scores below 1", "count": 1, "tasks": ["oracle-fails"]}]
    assert "failures by reason:" in lines
    assert report["options"]["overrides"] == str(tmp_path / "o.toml")  # the flag reached the gates
    again = _cli("tasks", "validate", str(good.parent), "--parallel", "2", "--overrides", str(tmp_path / "o.toml"),
                 "--resume", str(tmp_path / "gates.json"), cache=cache)  # a checkpoint: nothing gated again
    assert again.returncode == 1 and again.stdout.splitlines()[-1] == lines[-1], again.stderr
    assert f"[gates] resuming {tmp_path / 'gates.json'}: 2 tasks already gated, 0 to go" in again.stdout
    other = _cli("tasks", "validate", str(good.parent), "--json", str(tmp_path / "gates.json"), "--resume",
                 str(tmp_path / "gates.json"), cache=cache)  # without the overrides: other options
    assert other.returncode == 2 and "written with other options" in other.stderr


def test_validate_cli_user_error_is_one_line(tmp_path: Path, cache: Path) -> None:
    run = _cli("tasks", "validate", str(tmp_path / "missing"), cache=cache)
    assert run.returncode == 2
    assert run.stderr.strip() == f"albatross: error: {tmp_path / 'missing'}: no such directory"


def test_families_and_new_cli(tmp_path: Path, cache: Path) -> None:
    families = _cli("tasks", "families", cache=cache)
    assert families.stdout.split() == list(FAMILIES)
    new = _cli("tasks", "new", "find_key", "log_errors", "--count", "4", "--heldout", "2", "--out",
               str(tmp_path / "out"), cache=cache)
    assert new.returncode == 0, new.stderr
    train = load_tasks(tmp_path / "out" / "train")
    assert [t.metadata["family"] for t in train] == ["find_key", "log_errors"] * 2
    assert len(load_tasks(tmp_path / "out" / "heldout")) == 2


# -------------------------------------------------------------------------------------- probe, filter


def test_probe_in_the_training_harness_then_filter(tmp_path: Path, backend: LocalBackend) -> None:
    """A scripted policy that solves only its first attempt: pass rate 1/4, kept by the filter."""
    task = load_tasks(generate_tasks(tmp_path, families=["count_lines"], n_train=1, n_heldout=0, seed=1)["train"])
    cfg = RunConfig()
    agent = make_agent(cfg, None, backend, TinyTokenizer.from_corpus(corpus_strings()))
    agent.engine = ScriptedEngine([f"```bash\n{task[0].demo_steps[0]}\n```", "```bash\nsubmit\n```"],
                                  agent.fmt.action)
    rows = probe(agent, task, 4, GroupScorer(cfg.rl), workers=1)
    assert [(r.attempts, r.successes, r.zero_signal, r.infra_errors) for r in rows] == [(4, 1, False, 0)]
    result = filter_rows(rows, 0.15, 0.85, group_size=4)
    assert [r.task for r in result.kept] == [task[0].id]
    assert result.expected_after == pytest.approx(0.25**4 + 0.75**4)


def test_probe_and_filter_cli_with_a_tiny_model(tmp_path: Path, cache: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The real entry point, in this process (torch is imported once)."""
    from albatross.cli import main
    from albatross.config import ModelConfig
    from albatross.pipeline.demo import build_tiny, save_model

    tokenizer = TinyTokenizer.from_corpus(corpus_strings())
    model = build_tiny(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                   intermediate_size=64, max_positions=512), tokenizer)
    save_model(model, tokenizer, tmp_path / "model")
    tasks = generate_tasks(tmp_path / "tasks", n_train=2, n_heldout=0, seed=2)["train"]
    code = main(["tasks", "probe", *map(str, tasks), "--model", str(tmp_path / "model"), "--attempts", "4",
                 "--json", str(tmp_path / "probe.json"), "--set", "harness.max_turns=2",
                 "--set", "harness.max_tokens_per_turn=8", "--set", "sandbox.type=local"])
    assert code == 0
    rows = json.loads((tmp_path / "probe.json").read_text())["tasks"]
    assert [(r["task"], r["attempts"], r["infra_errors"]) for r in rows] == [(t.name, 4, 0) for t in tasks]
    assert all(0.0 <= r["pass_rate"] <= 1.0 for r in rows)
    assert main(["tasks", "probe", str(tasks[0]), "--model", str(tmp_path / "model"), "--attempts", "3"]) == 2
    assert main(["tasks", "filter", str(tmp_path / "probe.json"), "--out", str(tmp_path / "kept.txt")]) == 0
    out = capsys.readouterr()
    assert "zero-signal groups of 8 expected" in out.out and "--attempts must be at least 4, got 3" in out.err
    assert (tmp_path / "kept.txt").is_file()
    assert load_task(tasks[0]).id == rows[0]["task"]
