"""No traceback for any user input: each bad input to the real `albatross` CLI gives exactly one line on stderr,
no 'Traceback', exit code 2; every Dockerfile instruction the sandbox cannot honour is a named error naming the
file and line; one bad task in an eval is reported and skipped while the others are scored."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXIT_USER_ERROR = 2


def albatross(*args: str, cwd: Path, stdout: int | None = subprocess.PIPE) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "albatross.cli", *args], cwd=cwd, stdout=stdout,
                          stderr=subprocess.PIPE, text=True, errors="replace", timeout=300)


def assert_one_line_error(r: subprocess.CompletedProcess, *fragments: str) -> None:
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == EXIT_USER_ERROR, (r.returncode, r.stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith("albatross: error: "), lines
    for fragment in fragments:
        assert fragment in lines[0]


@pytest.fixture(scope="module")
def good_task(tmp_path_factory) -> Path:
    """One real generated task (count_lines): its Dockerfile starts FROM debian and copies app/."""
    root = tmp_path_factory.mktemp("generated")
    r = albatross("tasks", "new", "count_lines", "--count", "1", "--out", str(root), cwd=root)
    assert r.returncode == 0, r.stderr
    (task,) = (root / "train").iterdir()
    return task


def copy_task(good: Path, where: Path, dockerfile: bytes | str | None = None, task_toml: bytes | None = None) -> Path:
    import shutil

    shutil.copytree(good, where)
    if dockerfile is not None:
        data = dockerfile.encode() if isinstance(dockerfile, str) else dockerfile
        (where / "environment" / "Dockerfile").write_bytes(data)
    if task_toml is not None:
        (where / "task.toml").write_bytes(task_toml)
    return where


# ------------------------------------------------------------------------------------------ Dockerfiles

DEBIAN = "FROM debian:bookworm-slim\n"
UNSUPPORTED = {
    "copy-from": (DEBIAN + "COPY --from=build /x /y\n", ":2: COPY --from=build: the stage or image is not built"),
    "add-url": (DEBIAN + "ADD https://example.com/f.txt /f.txt\n", ":2: ADD https://example.com/f.txt: needs "
                "example.com"),
    "bare-arg": ("ARG\n" + DEBIAN, ":1: ARG needs a name"),
    "binary": (b"\x00\xff\xfe\x01" * 64, "Dockerfile: cannot read"),
    "alpine": ("FROM alpine:3.19\nRUN true\n", ":1: FROM alpine:3.19: cannot be built"),
    "scratch": ("FROM scratch\n", ":1: FROM scratch: cannot be built"),
    "no-from": ("WORKDIR /app\nRUN true\n", ":1: WORKDIR before FROM"),
    "empty": ("", ":1: no FROM instruction"),
    "unknown": (DEBIAN + "FROBNICATE /data\n", ":2: unsupported instruction FROBNICATE"),
    "shell": (DEBIAN + "SHELL /bin/sh -c\n", ":2: SHELL takes the JSON form"),
    "secret-mount": (DEBIAN + "RUN --mount=type=secret,id=k true\n", ":2: unsupported RUN flag --mount"),
    "heredoc": (DEBIAN + "RUN <<EOF\ntrue\n", ":2: heredoc EOF is not terminated"),
    "archive": (DEBIAN + "ADD app.tar.gz /app/\n", ":2: ADD source app.tar.gz not found"),
}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_sandbox_run_names_the_unsupported_dockerfile_line(good_task: Path, tmp_path: Path, name: str) -> None:
    dockerfile, message = UNSUPPORTED[name]
    task = copy_task(good_task, tmp_path / name, dockerfile)
    r = albatross("sandbox", "run", str(task), "--sandbox", "process", "--", "true", cwd=tmp_path)
    assert_one_line_error(r, str(task / "environment" / "Dockerfile"), message)


# ------------------------------------------------------------------------------------------ command line


def _cases(good: Path, tmp: Path) -> dict[str, tuple[list[str], tuple[str, ...]]]:
    (tmp / "file.txt").write_text("x\n")
    (tmp / "binary.toml").write_bytes(b"\xff\xfe\x00\x01 = 3")
    (tmp / "probe.json").write_text(json.dumps({"tasks": []}))
    (tmp / "run.toml").write_text(f'[model]\npath = "{tmp / "no-such-model"}"\n')
    run = tmp / "run"
    run.mkdir(exist_ok=True)
    (run / "attempts.jsonl").write_bytes(b"\xff\xfe\x00\n")
    task = str(good)
    return {
        "timeout-negative": (["sandbox", "run", task, "--timeout", "-5", "--", "true"], ("--timeout",)),
        "timeout-nan": (["sandbox", "run", task, "--timeout", "nan", "--", "true"], ("--timeout",)),
        "timeout-inf": (["sandbox", "run", task, "--timeout", "inf", "--", "true"], ("--timeout",)),
        "timeout-zero": (["sandbox", "run", task, "--timeout", "0", "--", "true"], ("--timeout",)),
        "timeout-word-after-task": (["sandbox", "run", task, "--timeout", "abc", "--", "true"], ("--timeout",)),
        "eval-out-is-a-file": (["eval", "--agent", "oracle", "--tasks", task, "--out", str(tmp / "file.txt")],
                               ("file.txt", "not a directory")),
        "eval-binary-config": (["eval", "--agent", "oracle", "--tasks", task, "--config",
                                str(tmp / "binary.toml")], ("binary.toml",)),
        "config-binary": (["config", str(tmp / "binary.toml")], ("binary.toml", "invalid TOML")),
        "train-binary": (["train", str(tmp / "binary.toml")], ("binary.toml",)),
        "tasks-new-unknown-family": (["tasks", "new", "no_such_family", "--out", str(tmp / "n1")],
                                     ("no_such_family",)),
        "tasks-new-negative-count": (["tasks", "new", "--count", "-1", "--out", str(tmp / "n2")], ("--count",)),
        "tasks-new-huge-count": (["tasks", "new", "--count", str(10**11), "--out", str(tmp / "n3")], ("--count",)),
        "tasks-new-out-is-a-file": (["tasks", "new", "--out", str(tmp / "file.txt")], ("file.txt",)),
        "tasks-filter-json-under-a-file": (["tasks", "filter", str(tmp / "probe.json"), "--json",
                                            str(tmp / "file.txt" / "x.json")], ("file.txt",)),
        "report-binary-attempts": (["report", str(run), "--out", str(tmp / "r.html")], ("not UTF-8",)),
        "full-disk": (["tasks", "filter", str(tmp / "probe.json"), "--json", "/dev/full"], ("no space left",)),
        "serve-bad-port": (["serve", str(tmp), "--port", "-1"], ("--port",)),
        "serve-zero-concurrency": (["serve", str(tmp), "--max-concurrency", "0"], ("--max-concurrency",)),
        "bench-sandbox-zero-concurrency": (["bench", "sandbox", "--concurrency", "0"], ("--concurrency",)),
        "train-missing-model": (["train", str(tmp / "run.toml")], ("model.path", "no-such-model")),
    }


CASES = ["timeout-negative", "timeout-nan", "timeout-inf", "timeout-zero", "timeout-word-after-task",
         "eval-out-is-a-file", "eval-binary-config", "config-binary", "train-binary", "tasks-new-unknown-family",
         "tasks-new-negative-count", "tasks-new-huge-count", "tasks-new-out-is-a-file",
         "tasks-filter-json-under-a-file", "report-binary-attempts", "full-disk", "serve-bad-port",
         "serve-zero-concurrency", "bench-sandbox-zero-concurrency", "train-missing-model"]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_and_exit_2(good_task: Path, tmp_path: Path, case: str) -> None:
    if case == "full-disk" and not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full (writes to it fail with ENOSPC)")
    argv, fragments = _cases(good_task, tmp_path)[case]
    r = albatross(*argv, cwd=tmp_path)
    assert_one_line_error(r, *fragments)
    assert not (tmp_path / "n3").exists()  # a refused count wrote nothing


def test_a_full_disk_behind_stdout_is_one_line(tmp_path: Path) -> None:
    if not os.path.exists("/dev/full"):
        pytest.skip("needs /dev/full")
    with open("/dev/full", "w") as full:
        r = albatross("config", cwd=tmp_path, stdout=full)
    assert_one_line_error(r, "no space left")


# ------------------------------------------------------------------------------------------ eval


def test_one_bad_task_in_an_eval_is_reported_and_skipped(good_task: Path, tmp_path: Path) -> None:
    tasks = tmp_path / "tasks"
    copy_task(good_task, tasks / "a-good")
    copy_task(good_task, tasks / "b-unknown", UNSUPPORTED["unknown"][0])
    copy_task(good_task, tasks / "c-binary-dockerfile", UNSUPPORTED["binary"][0])
    copy_task(good_task, tasks / "d-binary-toml", task_toml=b"\xff\xfe\x00")
    copy_task(good_task, tasks / "e-good")
    out = tmp_path / "out"
    r = albatross("eval", "--agent", "oracle", "--tasks", str(tasks), "--trials", "1", "--out", str(out),
                  "--workers", "2", cwd=tmp_path)
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.returncode == 0, r.stderr[-3000:]
    skipped = [line for line in r.stderr.splitlines() if line.startswith("albatross: skipping task")]
    assert len(skipped) == 3
    assert any("b-unknown/environment/Dockerfile:2: unsupported instruction FROBNICATE" in s for s in skipped)
    summary = json.loads((out / "summary.json").read_text())
    assert sorted(row["task"] for row in summary["per_task"]) == ["a-good", "e-good"]
    assert summary["pass_at_1"] == 1.0  # the oracle solves both good tasks


def test_an_eval_where_every_task_is_bad_is_one_line(good_task: Path, tmp_path: Path) -> None:
    task = copy_task(good_task, tmp_path / "only", UNSUPPORTED["scratch"][0])
    r = albatross("eval", "--agent", "oracle", "--tasks", str(task), "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert "Traceback" not in r.stderr
    assert r.returncode == EXIT_USER_ERROR
    assert r.stderr.splitlines()[-1].startswith("albatross: error: no task in")


def test_tasks_probe_skips_a_task_it_cannot_build(good_task: Path, tmp_path: Path) -> None:
    task = copy_task(good_task, tmp_path / "unknown", UNSUPPORTED["unknown"][0])
    r = albatross("tasks", "probe", str(task), "--model", str(tmp_path), "--attempts", "4", cwd=tmp_path)
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.returncode == EXIT_USER_ERROR
    first, last = r.stderr.strip().splitlines()
    assert first.startswith("albatross: skipping task") and ":2: unsupported instruction FROBNICATE" in first
    assert last.startswith("albatross: error: no task in")
