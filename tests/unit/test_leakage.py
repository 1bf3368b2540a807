"""The leakage gate's static check on small hand-made tasks: what the Dockerfile copies into the image is
judged, not what merely sits in environment/; inputs the instruction hands over are allowed."""

from __future__ import annotations

from pathlib import Path

from albatross.tasks import load_task, write_task
from albatross.tasks.format import Task
from albatross.tasks.leakage import copied_files, find_static_leaks, handed_over, scan_command

TEST_SH = "#!/bin/bash\npython3 /tests/check.py && echo 1 > /logs/verifier/reward.txt\n"
CHECK = "import sys\nassert open('/app/out.txt').read() == open('/tests/expected.txt').read()\n"
EXPECTED = "the expected output of the task\n"


def make(tmp_path: Path, dockerfile: str, env_files: dict[str, str], instruction: str = "Write /app/out.txt.\n",
         test_files: dict[str, str] | None = None) -> Task:
    files = {"expected.txt": EXPECTED, "check.py": CHECK, **(test_files or {})}
    return load_task(write_task(tmp_path / "t", instruction=instruction, task_toml={}, env_files=env_files,
                                dockerfile=dockerfile, solve_sh="#!/bin/bash\ncp /x /app/out.txt\n",
                                test_sh=TEST_SH, test_files=files))


def test_expected_output_copied_into_the_image_leaks(tmp_path: Path) -> None:
    task = make(tmp_path, "FROM debian:12\nWORKDIR /app\nCOPY data/ /app/\n",
                {"data/readme.txt": "read me first, please\n", "data/answer.txt": EXPECTED})
    assert find_static_leaks(task) == [
        "tests/expected.txt would be readable in the image at /app/answer.txt (copied from environment/ by "
        "Dockerfile line 3)"]


def test_a_test_directory_never_copied_is_no_leak(tmp_path: Path) -> None:
    # environment/tests/ holds copies of the tests, but the Dockerfile copies only src/
    task = make(tmp_path, "FROM debian:12\nWORKDIR /app\nCOPY src/ /app/src/\n",
                {"src/main.py": "print('hello world')\n", "tests/check.py": CHECK, "tests/expected.txt": EXPECTED})
    assert find_static_leaks(task) == []
    assert [f.path for f in copied_files(task)] == ["/app/src/main.py"]


def test_copy_into_the_workdir_follows_dockers_directory_rule(tmp_path: Path) -> None:
    # `WORKDIR /app` then `COPY check.py /app`: the file lands at /app/check.py (so the leak names that path)
    task = make(tmp_path, "FROM debian:12\nWORKDIR /app\nCOPY check.py /app\n", {"check.py": CHECK})
    assert find_static_leaks(task) == [
        "tests/check.py would be readable in the image at /app/check.py (copied from environment/ by "
        "Dockerfile line 3)"]


def test_an_input_the_instruction_hands_over_is_allowed(tmp_path: Path) -> None:
    # the agent must compress /app/data.txt; the tests keep the same file as their reference
    reference = "a long input file the agent must compress\n" * 4
    task = make(tmp_path, "FROM debian:12\nWORKDIR /app\nCOPY data.txt /app/\nCOPY in/ /app/in/\nCOPY x/ /app/\n",
                {"data.txt": reference, "in/table.csv": "a,b\n1,2\n3,4\n5,6\n", "x/copy.csv": "a,b\n1,2\n3,4\n5,6\n"},
                instruction="Compress data.txt into /app/data.gz. The tables are in /app/in/. Work in /app.\n",
                test_files={"reference.txt": reference, "ref/table.csv": "a,b\n1,2\n3,4\n5,6\n"})
    # data.txt is named; in/table.csv sits in a directory the instruction names; x/copy.csv lands in the
    # workdir itself, which every instruction names, so it is still a leak
    assert find_static_leaks(task) == [
        "tests/ref/table.csv would be readable in the image at /app/copy.csv (copied from environment/ by "
        "Dockerfile line 5)"]


def test_handed_over_needs_a_whole_name(tmp_path: Path) -> None:
    task = make(tmp_path, "FROM debian:12\n", {}, instruction="Fix /app/run_check.py and data.txt.gz.\n")
    assert not handed_over(task, "/app/check.py", from_env=True)
    assert not handed_over(task, "/app/data.txt", from_env=True)
    assert handed_over(task, "/srv/run_check.py", from_env=False)


def test_a_directory_the_instruction_names_relative_to_the_workdir_is_handed_over(tmp_path: Path) -> None:
    task = make(tmp_path, "FROM debian:12\nWORKDIR /app\n", {},
                instruction="Interpret each of the test programs in test/, e.g. test/calculator.scm.\n")
    assert handed_over(task, "/app/test/01-factorial.scm", from_env=True)
    assert handed_over(task, "/app/test/deep/02.scm", from_env=True)
    assert not handed_over(task, "/app/tests/01-factorial.scm", from_env=True)  # "test/" is not "tests/"
    assert not handed_over(task, "/app/test/01-factorial.scm", from_env=False)  # only inputs from environment/
    bare = make(tmp_path / "b", "FROM debian:12\nWORKDIR /app\n", {}, instruction="Pass the test programs.\n")
    assert not handed_over(bare, "/app/test/01-factorial.scm", from_env=True)  # the word alone names nothing


def test_copy_into_tests_is_flagged(tmp_path: Path) -> None:
    task = make(tmp_path, "FROM debian:12\nCOPY notes/ /tests/\n", {"notes/n.txt": "nothing secret in here\n"})
    assert find_static_leaks(task) == [f"{task.dockerfile}:2: COPY into /tests/, where the verifier's files go"]


def test_scan_hashes_only_files_of_a_secret_size(tmp_path: Path) -> None:
    task = make(tmp_path, "FROM debian:12\n", {})
    command = scan_command(task)
    sizes = sorted({len(EXPECTED), len(CHECK), len(TEST_SH), len("#!/bin/bash\ncp /x /app/out.txt\n")})
    assert f"\\( {' -o '.join(f'-size {n}c' for n in sizes)} \\)" in command
    assert "-path /proc" in command and "sha256sum" in command
