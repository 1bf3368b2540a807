"""Built-in task families: generation, determinism, disjoint splits, and oracle / no-op / demo rewards.

Tasks run without a sandbox: ``DirAttempt`` maps the sandbox paths /app, /logs, /tests and /solution
under a temporary root (rewriting them in commands and in copied scripts) and runs real bash there.
git_repair (built by a RUN step) and job_control (background processes) run in the real sandbox, in
tests/integration/test_gates.py.
"""

from __future__ import annotations

import random
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from albatross.sandbox.base import ExecResult, VerifierExec, VerifierSpec, verify_in_place
from albatross.tasks import (
    Task,
    VerifierError,
    VerifyResult,
    load_task,
    load_tasks,
    run_oracle,
    verify_attempt,
    write_task,
)
from albatross.tasks.builtin import (
    DEMO_FAMILIES,
    DIFFICULTIES,
    FAMILIES,
    WORDS,
    corpus_strings,
    generate_tasks,
    instruction_words,
    list_families,
    split_words_of,
)

_SANDBOX_PATH = re.compile(r"(?<![\w.$/-])/(app|logs|tests|solution)\b")


class DirAttempt:
    """An attempt without isolation: sandbox paths live under ``root``; commands run in bash."""

    def __init__(self, root: Path, task: Task, cwd: str = "/app") -> None:
        self.root = root
        self.cwd = Path(self.map(cwd)) if cwd != "/" else root
        shutil.copytree(task.env_dir / "app", root / "app")

    def map(self, text: str) -> str:
        return _SANDBOX_PATH.sub(lambda m: f"{self.root}/{m.group(1)}", text)

    def exec(self, command: str, timeout_s: float | None = None) -> ExecResult:
        start = time.monotonic()
        proc = subprocess.run(
            ["bash", "-c", self.map(command)],
            cwd=self.cwd,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        return ExecResult(proc.stdout + proc.stderr, proc.returncode, seconds=time.monotonic() - start)

    def exec_clean(self, command: str, cwd: str, timeout_s: float | None = None) -> ExecResult:
        start = time.monotonic()
        proc = subprocess.run(["bash", "--noprofile", "--norc", "-c", self.map(command)],
                              cwd=self.map(cwd) if cwd != "/" else self.root, capture_output=True, text=True,
                              timeout=timeout_s)
        return ExecResult(proc.stdout + proc.stderr, proc.returncode, seconds=time.monotonic() - start)

    def kill_all(self) -> None:
        """Commands run to completion here: no process of the attempt outlives its ``exec``."""

    def put_dir(self, host_dir: Path, sandbox_path: str) -> None:
        dest = Path(self.map(sandbox_path))
        shutil.copytree(host_dir, dest, dirs_exist_ok=True)
        for script in [*dest.rglob("*.sh"), *dest.rglob("*.py")]:
            script.write_text(self.map(script.read_text()))

    def read_file(self, sandbox_path: str) -> bytes | None:
        path = Path(self.map(sandbox_path))
        return path.read_bytes() if path.is_file() else None

    def verify(self, spec: VerifierSpec) -> VerifierExec:
        return verify_in_place(self, spec)

    def refused_hosts(self) -> list[str]:
        return []

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


class DirBackend:
    """Forks untouched ``DirAttempt``s of one task (``verify_attempt``'s untouched-fork check)."""

    def __init__(self, root: Path, task: Task) -> None:
        self.root, self.task, self.forks = root, task, 0

    def fork(self, env_dir: Path, workdir: str, limits: object = None) -> DirAttempt:
        self.forks += 1
        return DirAttempt(self.root / f"fork-{self.forks}", self.task)


def verify(attempt: DirAttempt, task: Task) -> VerifyResult:
    """The attempt scored as every attempt is (``verify_attempt``)."""
    return verify_attempt(attempt, task, DirBackend(attempt.root.with_name(f"{attempt.root.name}-untouched"), task))


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Path]]:
    return generate_tasks(tmp_path_factory.mktemp("suite"), n_train=12, n_heldout=6, seed=3)


def _one_per_family(suite: dict[str, list[Path]]) -> list[Task]:
    tasks = load_tasks(suite["train"])
    return [next(t for t in tasks if t.metadata["family"] == name) for name in DEMO_FAMILIES]


def _files(task_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(task_dir)): p.read_bytes() for p in sorted(task_dir.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------- generation


def test_vocabulary_has_no_word_inside_another() -> None:
    assert len(set(WORDS)) == len(WORDS) >= 20
    assert [(a, b) for a in WORDS for b in WORDS if a != b and a in b] == []


def test_generated_tasks_load_with_the_builtin_settings(suite: dict[str, list[Path]]) -> None:
    assert [len(suite["train"]), len(suite["heldout"])] == [12, 6]
    for split, dirs in suite.items():
        for task in load_tasks(dirs):
            assert task.metadata["split"] == split and task.metadata["family"] in FAMILIES
            assert (task.agent_timeout_s, task.verifier_timeout_s) == (60.0, 30.0)
            assert (task.cpus, task.memory_mb, task.storage_mb, task.allow_internet) == (1.0, 512, 256, False)
            assert task.workdir == "/app" and task.demo_steps and task.demo_steps[-1] == "submit"
            assert (task.env_dir / "Dockerfile").read_text().startswith("FROM python:3.11-slim-bookworm\n")


def test_families_are_interleaved_evenly(suite: dict[str, list[Path]]) -> None:
    names = list(DEMO_FAMILIES)
    for dirs in suite.values():
        families = [load_task(d).metadata["family"] for d in dirs]
        assert families == [names[i % len(names)] for i in range(len(dirs))]


def test_generation_is_deterministic_for_a_seed(tmp_path: Path) -> None:
    first = generate_tasks(tmp_path / "a", n_train=6, n_heldout=3, seed=11)
    second = generate_tasks(tmp_path / "b", n_train=6, n_heldout=3, seed=11)
    other = generate_tasks(tmp_path / "c", n_train=6, n_heldout=3, seed=12)
    for split in ("train", "heldout"):
        assert [d.name for d in first[split]] == [d.name for d in second[split]]
        assert [_files(d) for d in first[split]] == [_files(d) for d in second[split]]
        assert [_files(d) for d in first[split]] != [_files(d) for d in other[split]]


def test_heldout_does_not_depend_on_train_size(tmp_path: Path) -> None:
    small = generate_tasks(tmp_path / "small", n_train=2, n_heldout=4, seed=5)
    large = generate_tasks(tmp_path / "large", n_train=30, n_heldout=4, seed=5)
    assert [_files(d) for d in small["heldout"]] == [_files(d) for d in large["heldout"]]


def test_splits_share_no_instance(tmp_path: Path) -> None:
    out = generate_tasks(tmp_path, families=["count_lines"], n_train=150, n_heldout=60, seed=0)
    keys = {}
    for split, dirs in out.items():
        keys[split] = set()
        for task in load_tasks(dirs):
            rng = random.Random(task.metadata["seed"])
            instance = FAMILIES["count_lines"].generate(rng, task.metadata["difficulty"])
            assert instance.instruction + "\n" == task.instruction  # the seed reproduces the task
            keys[split].add(instance.key)
    assert len(keys["train"]) == 150 and len(keys["heldout"]) == 60
    assert keys["train"].isdisjoint(keys["heldout"])


def test_refuses_to_overwrite_unless_asked(tmp_path: Path) -> None:
    generate_tasks(tmp_path, n_train=3, n_heldout=0, seed=1)
    with pytest.raises(FileExistsError, match="already holds tasks"):
        generate_tasks(tmp_path, n_train=1, n_heldout=0, seed=1)
    out = generate_tasks(tmp_path, n_train=1, n_heldout=0, seed=1, overwrite=True)
    assert sorted(p.name for p in (tmp_path / "train").iterdir()) == [d.name for d in out["train"]]


def test_unknown_family_and_difficulty(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown task family 'sort_words'"):
        generate_tasks(tmp_path, families=["sort_words"], n_train=1, n_heldout=0, seed=0)
    with pytest.raises(ValueError, match="difficulty must be one of"):
        FAMILIES["grep_word"].generate(random.Random(0), "extreme")


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
@pytest.mark.parametrize("name", sorted(DEMO_FAMILIES))
def test_instances_follow_their_templates(name: str, difficulty: str) -> None:
    family = FAMILIES[name]
    word = "(" + "|".join(WORDS) + ")"
    instruction_re = re.escape(family.instruction_template).replace(r"\{a\}", word).replace(r"\{w\}", word)
    for seed in range(30):
        instance = family.generate(random.Random(seed), difficulty)
        assert re.fullmatch(instruction_re, instance.instruction), instance.instruction
        assert len(instance.demo_steps) == len(family.demo_templates)
        assert len(instance.files) == len(family.generate(random.Random(seed), "easy").files) + (
            DIFFICULTIES.index(difficulty)
        )
        names = {re.sub(r"\.(txt|log)$", "", f) for f in instance.files}
        assert names <= set(WORDS)
        assert not {"answer.txt", "out.txt", "result.txt"} & set(instance.files)


def test_count_lines_files_have_distinct_line_counts() -> None:
    for seed in range(50):
        instance = FAMILIES["count_lines"].generate(random.Random(seed), "hard")
        counts = [content.count("\n") for content in instance.files.values()]
        assert len(set(counts)) == len(counts) and all(1 <= c <= 9 for c in counts)


def test_grep_word_target_appears_in_one_to_three_lines() -> None:
    for seed in range(50):
        instance = FAMILIES["grep_word"].generate(random.Random(seed), "easy")
        a, w = re.fullmatch(
            r"Write the lines of (\w+)\.log that contain (\w+) to out\.txt\.", instance.instruction
        ).groups()
        lines = instance.files[f"{a}.log"].splitlines()
        assert 4 <= len(lines) <= 8 and all(len(line.split()) == 3 for line in lines)
        assert 1 <= sum(w in line.split() for line in lines) <= 3


def test_follow_pointer_contents_are_distinct() -> None:
    for seed in range(50):
        instance = FAMILIES["follow_pointer"].generate(random.Random(seed), "easy")
        a = instance.instruction.split()[2]
        target = instance.files[a].strip()
        assert target in instance.files and target != a and len(instance.files) == 4
        assert len(set(instance.files.values())) == 4


def test_corpus_covers_templates_and_words() -> None:
    corpus = corpus_strings()
    for family in FAMILIES.values():
        assert family.instruction_template in corpus
        assert set(family.demo_templates) <= set(corpus)
        assert set(family.vocabulary) <= set(corpus)
        assert set(family.split_templates.values()) <= set(corpus)
    assert set(WORDS) <= set(corpus) and len(corpus) == len(set(corpus))
    demo = [s for name in DEMO_FAMILIES for s in (FAMILIES[name].instruction_template,
                                                  *FAMILIES[name].demo_templates)]
    demo = list(dict.fromkeys([*demo, *WORDS]))
    assert corpus_strings(DEMO_FAMILIES) == demo  # the demo's original corpus: same tokenizer as before
    assert corpus[: len(demo)] == demo and len(corpus) > len(demo)
    with pytest.raises(ValueError, match="unknown task family 'nope'"):
        corpus_strings(["nope"])


@pytest.mark.parametrize("name", DEMO_FAMILIES)
def test_the_demo_tokenizer_copies_a_word_as_the_same_token(name: str) -> None:
    """Every word an oracle command names is, in that command, the very token it is in the instruction or in
    a file the agent can print: a copy, never a word-by-word mapping (" lemon" vs "lemon") the tiny model would
    have to learn for each word, and could not for a held-out one."""
    from albatross.pipeline.demo import demo_tokenizer

    tok = demo_tokenizer()
    for seed in range(20):
        inst = FAMILIES[name].generate(random.Random(seed), "easy")
        seen = set(tok.encode(inst.instruction, add_special_tokens=False))
        for content in inst.files.values():
            seen |= set(tok.encode(content, add_special_tokens=False))
        for step in inst.demo_steps:
            command = tok.encode(step, add_special_tokens=False)
            for word in instruction_words(step):
                (word_id,) = tok.encode(word, add_special_tokens=False)
                assert word_id in command and word_id in seen, (name, step, word)


def test_expected_answers_are_only_in_tests(suite: dict[str, list[Path]]) -> None:
    for task in load_tasks(suite["train"]):
        test_sh = (task.tests_dir / "test.sh").read_text()
        assert "python" not in test_sh and "/logs/verifier/reward.json" in test_sh
        env_files = {p.name for p in task.env_dir.rglob("*") if p.is_file()}
        assert not {"answer.txt", "out.txt", "result.txt", "test.sh", "solve.sh"} & env_files


# ---------------------------------------------------------------------------- running the tasks


def _attempt(tmp_path: Path, task: Task) -> DirAttempt:
    return DirAttempt(tmp_path / f"root-{task.id}", task)


def test_oracle_scores_one(suite: dict[str, list[Path]], tmp_path: Path) -> None:
    for task in _one_per_family(suite):
        attempt = _attempt(tmp_path, task)
        assert run_oracle(attempt, task).exit_code == 0
        result = verify(attempt, task)
        assert (result.reward, result.success, result.error) == (1.0, True, ""), task.id
        assert set(result.metrics) == {
            f"{stem}_{kind}" for stem in [_stem(task)] for kind in ("exists", "correct")
        }


def _stem(task: Task) -> str:
    return {"count_lines": "answer", "grep_word": "out", "follow_pointer": "result"}[task.metadata["family"]]


def test_noop_scores_zero(suite: dict[str, list[Path]], tmp_path: Path) -> None:
    for task in _one_per_family(suite):
        result = verify(_attempt(tmp_path, task), task)
        assert (result.reward, result.success) == (0.0, False), task.id


def test_demo_steps_score_one(suite: dict[str, list[Path]], tmp_path: Path) -> None:
    for task in load_tasks(suite["heldout"]):
        attempt = _attempt(tmp_path, task)
        for step in task.demo_steps or []:
            if step != "submit":
                assert attempt.exec(step).exit_code == 0, step
        assert verify(attempt, task).success, task.id


@pytest.mark.parametrize(
    ("family", "mistake"),
    [
        ("count_lines", "echo 0 > answer.txt"),
        ("grep_word", "cat *.log > out.txt"),
        ("follow_pointer", "for f in *.txt; do cp $f result.txt; break; done; echo x >> result.txt"),
    ],
)
def test_wrong_answer_gets_partial_credit_only(
    suite: dict[str, list[Path]], tmp_path: Path, family: str, mistake: str
) -> None:
    task = next(t for t in _one_per_family(suite) if t.metadata["family"] == family)
    attempt = _attempt(tmp_path, task)
    attempt.exec(mistake)
    result = verify(attempt, task)
    assert (result.reward, result.success) == (0.5, False)


def test_follow_pointer_copying_the_pointer_itself_fails(
    suite: dict[str, list[Path]], tmp_path: Path
) -> None:
    task = next(t for t in _one_per_family(suite) if t.metadata["family"] == "follow_pointer")
    attempt = _attempt(tmp_path, task)
    attempt.exec(task.demo_steps[0].replace("cat ", "cp ") + " result.txt")
    assert verify(attempt, task).success is False


def test_answers_are_compared_after_trimming_whitespace(suite: dict[str, list[Path]], tmp_path: Path) -> None:
    task = next(t for t in _one_per_family(suite) if t.metadata["family"] == "count_lines")
    attempt = _attempt(tmp_path, task)
    attempt.exec(
        task.demo_steps[0].replace("> answer.txt", "| sed 's/^/  /' > answer.txt; echo >> answer.txt")
    )
    assert verify(attempt, task).success


def test_test_script_runs_from_any_cwd(suite: dict[str, list[Path]], tmp_path: Path) -> None:
    task = next(t for t in _one_per_family(suite) if t.metadata["family"] == "grep_word")
    attempt = _attempt(tmp_path, task)
    run_oracle(attempt, task)
    attempt.put_dir(task.tests_dir, "/tests")
    script = attempt.map("/tests/test.sh")
    subprocess.run(["bash", script], cwd="/", check=True, capture_output=True)
    reward = attempt.read_file("/logs/verifier/reward.json")
    assert reward == b'{"out_exists": 1, "out_correct": 1}\n'


# -------------------------------------------------------------------------- verifier edge cases


def _custom_task(tmp_path: Path, test_sh: str) -> Task:
    task_dir = write_task(
        tmp_path / "custom",
        instruction="Nothing.\n",
        task_toml={"agent": {"timeout_sec": 10}, "verifier": {"timeout_sec": 10}},
        env_files={"app/keep.txt": "x\n"},
        dockerfile="FROM debian:bookworm-slim\nWORKDIR /app\nCOPY app/ /app/\n",
        solve_sh="#!/bin/bash\ntrue\n",
        test_sh=test_sh,
    )
    return load_task(task_dir)


def test_a_reward_file_left_by_the_agent_is_not_trusted(tmp_path: Path) -> None:
    task = _custom_task(tmp_path, "#!/bin/bash\necho crashed; exit 3\n")
    attempt = _attempt(tmp_path, task)
    attempt.exec("mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt")
    with pytest.raises(VerifierError, match=r"custom: no reward file.*exited with code 3: crashed"):
        verify(attempt, task)


def test_out_of_range_reward_is_a_verifier_error(tmp_path: Path) -> None:
    task = _custom_task(tmp_path, "#!/bin/bash\necho 2 > /logs/verifier/reward.txt\n")
    with pytest.raises(VerifierError, match=r"reward.txt: 2.0 is not a finite number in \[0, 1\]"):
        verify(_attempt(tmp_path, task), task)


def test_verifier_runs_in_the_workdir_and_notes_a_failing_exit(tmp_path: Path) -> None:
    task = _custom_task(
        tmp_path, "#!/bin/bash\n[ -f keep.txt ] && echo 1 > /logs/verifier/reward.txt\nexit 1\n"
    )
    attempt = DirAttempt(tmp_path / "root", task, cwd="/")  # a shell that is not in the workdir
    result = verify(attempt, task)
    assert (result.reward, result.success, result.error) == (1.0, True, "test.sh exited with code 1")


# ----------------------------------------------------------------------------- the other families

NEW_FAMILIES = [name for name in FAMILIES if name not in DEMO_FAMILIES]
HOST_SAFE = ["sort_unique", "fs_surgery", "log_errors", "csv_to_json", "py_fix", "find_key"]


def test_default_is_the_demo_and_all_families_are_available_by_name(tmp_path: Path) -> None:
    assert DEMO_FAMILIES == ("count_lines", "grep_word", "follow_pointer")
    assert list_families()[:3] == list(DEMO_FAMILIES) and len(list_families()) >= 11
    default = generate_tasks(tmp_path / "d", n_train=6, n_heldout=0, seed=0)
    assert {load_task(d).metadata["family"] for d in default["train"]} == set(DEMO_FAMILIES)
    every = generate_tasks(tmp_path / "a", families=["all"], n_train=len(FAMILIES), n_heldout=0, seed=0)
    assert [load_task(d).metadata["family"] for d in every["train"]] == list_families()


def test_families_cover_the_eight_kinds_of_terminal_work() -> None:
    categories = {f.category for f in FAMILIES.values()}
    assert {"text-processing", "file-operations", "log-analysis", "software-engineering", "version-control",
            "data-conversion", "process-management", "investigation"} <= categories


@pytest.mark.parametrize("name", NEW_FAMILIES)
def test_new_family_is_seeded_and_its_splits_share_no_instance(tmp_path: Path, name: str) -> None:
    out = generate_tasks(tmp_path / "a", families=[name], n_train=12, n_heldout=6, seed=4, difficulty="medium")
    again = generate_tasks(tmp_path / "b", families=[name], n_train=12, n_heldout=6, seed=4, difficulty="medium")
    keys: dict[str, set] = {}
    for split, dirs in out.items():
        assert [_files(d) for d in dirs] == [_files(d) for d in again[split]]
        keys[split] = set()
        for task in load_tasks(dirs):
            instance = FAMILIES[name].generate(random.Random(task.metadata["seed"]), "medium")
            assert FAMILIES[name].split_templates.get(split, instance.instruction) + "\n" == task.instruction
            keys[split].add(instance.key)
    assert len(keys["train"]) == 12 and len(keys["heldout"]) == 6 and keys["train"].isdisjoint(keys["heldout"])


def _size(name: str, difficulty: str) -> float:
    instances = [FAMILIES[name].generate(random.Random(seed), difficulty) for seed in range(20)]
    return sum(sum(map(len, i.files.values())) + len(i.setup_sh) for i in instances) / len(instances)


@pytest.mark.parametrize("name", NEW_FAMILIES)
def test_difficulty_knob_makes_instances_larger(name: str) -> None:
    assert _size(name, "easy") < _size(name, "medium") < _size(name, "hard")


@pytest.mark.parametrize("name", HOST_SAFE)
def test_new_family_oracle_demo_and_noop(tmp_path: Path, name: str) -> None:
    for difficulty in ("easy", "hard"):  # all three run in the sandbox in tests/integration/test_gates.py
        out = generate_tasks(tmp_path / difficulty, families=[name], n_train=1, n_heldout=0, seed=2,
                             difficulty=difficulty)
        task = load_task(out["train"][0])
        oracle = _attempt(tmp_path / difficulty, task)
        assert run_oracle(oracle, task).exit_code == 0
        result = verify(oracle, task)
        assert result.success and len(result.metrics) >= 2, (difficulty, result)
        noop = verify(_attempt(tmp_path / f"{difficulty}-noop", task), task)
        assert not noop.success and noop.reward < 1.0
        demo = _attempt(tmp_path / f"{difficulty}-demo", task)
        for step in (task.demo_steps or [])[:-1]:
            demo.exec(step)
        assert verify(demo, task).success, (difficulty, task.demo_steps)


def _family_task(tmp_path: Path, name: str, difficulty: str = "hard") -> Task:
    out = generate_tasks(tmp_path / name, families=[name], n_train=1, n_heldout=0, seed=5, difficulty=difficulty)
    return load_task(out["train"][0])


@pytest.mark.parametrize(
    ("name", "attempt", "passed"),
    [
        ("sort_unique", "sort {file} > sorted.txt", {"sorted_exists", "sorted_complete", "sorted_order"}),
        ("sort_unique", "touch sorted.txt", set()),
        ("fs_surgery", "rm -rf data", set()),
        ("fs_surgery", "find data -name '*.tmp' -delete", {"tmp_deleted", "other_files_kept"}),
        ("log_errors", "grep -c ERROR app.log > errors.txt", {"errors_exists"}),
        ("csv_to_json", "echo '[{{\"x\": 1}}]' > {stem}.json", {"json_exists", "json_valid"}),
        ("find_key", "head -1 candidates.txt > answer.txt", {"answer_exists"}),
    ],
)
def test_per_test_partial_credit(tmp_path: Path, name: str, attempt: str, passed: set[str]) -> None:
    task = _family_task(tmp_path, name)
    stem = next(iter(sorted(f.stem for f in (task.env_dir / "app").iterdir() if f.suffix in (".csv", ".py")
                            and not f.name.startswith("test_"))), "")
    first = next(iter(sorted(p.name for p in (task.env_dir / "app").glob("*.txt"))), "")
    session = _attempt(tmp_path, task)
    session.exec(attempt.format(file=_sort_input(task) or first, stem=stem))
    result = verify(session, task)
    assert {k for k, v in result.metrics.items() if v == 1.0} == passed and not result.success


def _sort_input(task: Task) -> str:
    words = task.instruction.split()
    return words[words.index("of") + 1].rstrip(",") if task.metadata["family"] == "sort_unique" else ""


def test_py_fix_hard_has_two_bugs_and_fixing_one_earns_partial_credit(tmp_path: Path) -> None:
    task = _family_task(tmp_path, "py_fix")
    fixes = [s for s in task.demo_steps if s.startswith("sed ")]
    assert len(fixes) == 2
    session = _attempt(tmp_path, task)
    session.exec(fixes[0])
    result = verify(session, task)
    failed = {k for k, v in result.metrics.items() if v == 0.0}
    assert not result.success and len(failed) == 2 and "unittest_passes" in failed
    session.exec(fixes[1])
    assert verify(session, task).success


def test_py_fix_editing_the_tests_earns_nothing_for_them(tmp_path: Path) -> None:
    task = _family_task(tmp_path, "py_fix", "easy")
    module = next(p.stem for p in (task.env_dir / "app").glob("*.py") if not p.name.startswith("test_"))
    session = _attempt(tmp_path, task)
    session.exec(f"echo 'import unittest' > test_{module}.py")
    result = verify(session, task)
    assert result.metrics["tests_unchanged"] == 0.0 and result.metrics["unittest_passes"] == 0.0


# ------------------------------------------------------------------------------------- honest splits


def _by_split(out: dict[str, list[Path]]) -> dict[str, list[Task]]:
    return {split: load_tasks(dirs) for split, dirs in out.items()}


def _oracle_lines(task: Task) -> set[str]:
    return {line for line in (task.solution_dir / "solve.sh").read_text().splitlines()[3:] if line.strip()}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_each_family_sets_aside_its_own_words(name: str) -> None:
    lists = [set(split_words_of(name, s)) for s in ("train", "validation", "heldout")]
    assert [len(x) for x in lists] == [len(WORDS) - 8, 3, 5] and set().union(*lists) == set(WORDS)
    assert instruction_words("Fix test_kiwi.py and kiwi.txt; leave teapot.txt") == {"kiwi"}


def test_a_word_held_out_by_one_demo_family_is_a_training_word_of_the_others() -> None:
    held = {name: set(split_words_of(name, "heldout")) | set(split_words_of(name, "validation"))
            for name in DEMO_FAMILIES}
    assert set().union(*held.values()) == set(WORDS)  # the three blocks cover the vocabulary once
    for name, words in held.items():
        for other in DEMO_FAMILIES:
            if other != name:
                assert words <= set(split_words_of(other, "train"))


@pytest.mark.parametrize("seed", [0, 1, 7, 23])
def test_heldout_and_validation_instructions_never_appear_in_training(tmp_path: Path, seed: int) -> None:
    """Regression (issue 18): 13 of 21 held-out instructions of a default demo run were training ones."""
    tasks = _by_split(generate_tasks(tmp_path, families=["all"], n_train=240, n_heldout=44, n_validation=22,
                                     seed=seed))
    train = [t.instruction.strip() for t in tasks["train"]]
    for split in ("heldout", "validation"):
        assert len(tasks[split]) == {"heldout": 44, "validation": 22}[split]
        for task in tasks[split]:
            text = task.instruction.strip()
            assert not [t for t in train if text in t or t in text], (split, text)
    heldout = {t.instruction for t in tasks["heldout"]}
    assert heldout.isdisjoint(t.instruction for t in tasks["validation"])


def test_an_instruction_names_only_its_splits_words(tmp_path: Path) -> None:
    tasks = _by_split(generate_tasks(tmp_path, n_train=60, n_heldout=12, n_validation=9, seed=3))
    for split, split_tasks in tasks.items():
        for task in split_tasks:
            named = instruction_words(task.instruction)
            assert named and named <= set(split_words_of(task.metadata["family"], split)), (split, task.id)


def test_demo_oracles_differ_between_splits(tmp_path: Path) -> None:
    tasks = _by_split(generate_tasks(tmp_path, n_train=240, n_heldout=12, n_validation=9, seed=0))
    train = set().union(*(_oracle_lines(t) for t in tasks["train"]))
    for split in ("heldout", "validation"):
        for task in tasks[split]:
            assert _oracle_lines(task) and _oracle_lines(task).isdisjoint(train), (split, task.id)


def test_validation_is_a_third_split_that_does_not_move_the_heldout_set(tmp_path: Path) -> None:
    plain = generate_tasks(tmp_path / "a", n_train=6, n_heldout=6, seed=2)
    more = generate_tasks(tmp_path / "b", n_train=6, n_heldout=6, n_validation=6, seed=2)
    assert plain["validation"] == [] and len(more["validation"]) == 6
    assert [_files(d) for d in plain["heldout"]] == [_files(d) for d in more["heldout"]]
    assert {load_task(d).metadata["split"] for d in more["validation"]} == {"validation"}
    said = {s: {load_task(d).instruction for d in dirs} for s, dirs in more.items()}
    assert said["validation"].isdisjoint(said["train"]) and said["validation"].isdisjoint(said["heldout"])


def test_a_heldout_family_appears_only_in_heldout(tmp_path: Path) -> None:
    out = generate_tasks(tmp_path / "a", n_train=12, n_heldout=8, n_validation=6, seed=1,
                         heldout_families=["sort_unique"])
    families = {s: [load_task(d).metadata["family"] for d in dirs] for s, dirs in out.items()}
    assert families["heldout"] == [[*DEMO_FAMILIES, "sort_unique"][i % 4] for i in range(8)]
    assert "sort_unique" not in families["train"] + families["validation"]
    assert set(families["train"]) == set(families["validation"]) == set(DEMO_FAMILIES)
    inner = generate_tasks(tmp_path / "b", n_train=6, n_heldout=4, seed=1, heldout_families=["grep_word"])
    assert {load_task(d).metadata["family"] for d in inner["train"]} == {"count_lines", "follow_pointer"}
    assert "grep_word" in {load_task(d).metadata["family"] for d in inner["heldout"]}
    with pytest.raises(ValueError, match="no family to train on"):
        generate_tasks(tmp_path / "c", families=["count_lines"], n_train=2, n_heldout=2, seed=1,
                       heldout_families=["count_lines"])
