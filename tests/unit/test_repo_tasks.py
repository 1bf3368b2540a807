"""Repository tasks, the parts that run on the host: mutations as minimal edits, what is a test, the pytest
configuration, the pristine set, issue-style instructions that never name the change, patches that git applies,
the verifier's restore, clean-up and reward, sdist names and safe unpacking, SWE-bench instances read and
round-tripped, the order of difficulties."""

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from albatross.errors import UserError
from albatross.tasks.swe import mutate, project, runner
from albatross.tasks.swe.generate import Baseline, Bug, Candidate, Generator, SweOptions, _interleave
from albatross.tasks.swe.instruction import issue_text, leaks
from albatross.tasks.swe.sdist import Sdist, _pick, parse_requirement, unpack
from albatross.tasks.swe.writer import PLUGIN, RUNNER, pristine_dirs, unified_patch

SOURCE = '''\
import os


def clamp(x, low=0, high=10, strict=True):
    """Docstring."""
    if x < low and strict:
        return low
    if not x <= high:
        return high
    total = x + 1
    return min(max(low, x), total - 1)


class Box:
    @staticmethod
    def area(w, h):
        return os.path.join(w, h)[1:]
'''


def _edits(kind: str) -> list[mutate.Mutation]:
    fns = {f.name: f for f in mutate.functions(SOURCE)}
    return [m for f in fns.values() for m in mutate.mutations(SOURCE, "m.py", f) if m.kind == kind]


def _changed(m: mutate.Mutation) -> tuple[list[str], list[str]]:
    new = mutate.apply(SOURCE, [m]).splitlines()
    old = SOURCE.splitlines()
    return [a for a in old if a not in new], [b for b in new if b not in old]


def test_functions_know_their_lines_and_methods():
    fns = {f.qualname: f for f in mutate.functions(SOURCE)}
    assert set(fns) == {"clamp", "Box.area"}
    area = fns["Box.area"]
    assert (area.first, area.lineno) == (area.lineno - 1, 16)  # the decorator's line comes first
    assert mutate.functions("def broken(:\n") == [] and mutate.functions("(" * 100000) == []


@pytest.mark.parametrize("kind, old, new", [
    ("compare", "    if x < low and strict:", "    if x <= low and strict:"),
    ("bool_op", "    if x < low and strict:", "    if x < low or strict:"),
    ("negate", "    if not x <= high:", "    if x <= high:"),
    ("arith", "    total = x + 1", "    total = x - 1"),
    ("wrong_default", "def clamp(x, low=0, high=10, strict=True):", "def clamp(x, low=0, high=10, strict=False):"),
    ("swap_args", "    return min(max(low, x), total - 1)", "    return min(max(x, low), total - 1)"),
    ("off_by_one", "        return os.path.join(w, h)[1:]", "        return os.path.join(w, h)[2:]"),
])
def test_each_kind_is_a_minimal_edit_of_one_line(kind, old, new):
    found = [(o, n) for m in _edits(kind) for o, n in [_changed(m)] if o == [old]]
    assert found and [new] in [n for _o, n in found], [_changed(m) for m in _edits(kind)]
    for m in _edits(kind):
        assert mutate.valid(mutate.apply(SOURCE, [m]))


def test_dropped_statements_are_whole_lines_never_a_docstring_or_a_lone_statement():
    drops = _edits("drop_statement")
    removed = [_changed(m)[0] for m in drops]
    assert ["    total = x + 1"] in removed and ["    if x < low and strict:", "        return low"] in removed
    assert not any('"""Docstring."""' in line for r in removed for line in r)
    assert not any(line.strip() == "return low" for r in removed if len(r) == 1 for line in r)  # alone in its block
    block = next(m for m in drops if _changed(m)[0][0].startswith("    if x < low"))
    assert block.multiline and not next(m for m in drops if _changed(m)[0] == ["    total = x + 1"]).multiline


def test_edits_combine_unless_they_overlap():
    a = next(m for m in _edits("compare") if "x < low" in _changed(m)[0][0])
    b = next(m for m in _edits("arith"))
    both = mutate.apply(SOURCE, [b, a])
    assert "x <= low" in both and "x - 1" in both
    with pytest.raises(ValueError):
        mutate.apply(SOURCE, [a, a])


def test_test_paths_and_node_ids():
    assert project.is_test_path("tests/test_x.py") and project.is_test_path("pkg/tests/data/x.json")
    assert project.is_test_path("pkg/util_test.py") and project.is_test_path("conftest.py")
    assert not project.is_test_path("pkg/testing_utils.py") and not project.is_test_path("src/pkg/core.py")
    assert project.test_file_of("tests/test_x.py::TestA::test_b[1]") == "tests/test_x.py"
    assert project.test_file_of("pkg/core.py::pkg.core.f") is None  # a doctest of a library module
    assert project.module_name("src/pkg/sub/__init__.py") == "pkg.sub"


def test_config_file_follows_pytests_order(tmp_path):
    (tmp_path / "setup.cfg").write_text("[tool:pytest]\naddopts = -q\n")
    assert project.config_file(tmp_path) == "setup.cfg"
    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    assert project.config_file(tmp_path) == "setup.cfg"  # no [tool.pytest...]: not pytest's
    (tmp_path / "pyproject.toml").write_text("[tool.pytest.ini_options]\naddopts = '-q'\n")
    assert project.config_file(tmp_path) == "pyproject.toml"
    (tmp_path / "pytest.ini").write_text("")
    assert project.config_file(tmp_path) == "pytest.ini"


def test_pristine_set_and_its_tar_is_deterministic(tmp_path):
    for rel in ("pkg/core.py", "pkg/tests/test_core.py", "pkg/tests/data.json", "conftest.py", "tox.ini",
                "docs/conf.py", "pkg/__pycache__/x.pyc"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(rel)
    (tmp_path / "pkg" / "tests" / "loop").symlink_to(tmp_path)  # never followed (nor listed)
    (tmp_path / "pkg" / "tests" / "test_link.py").symlink_to(tmp_path / "tox.ini")
    files = project.pristine_files(tmp_path)
    assert files == ["conftest.py", "pkg/tests/data.json", "pkg/tests/test_core.py", "tox.ini"]
    assert project.library_files(tmp_path) == ["pkg/core.py"]
    one = project.pristine_tar(tmp_path, files, {"pkg/tests/new.py": b"x"})
    assert one == project.pristine_tar(tmp_path, files, {"pkg/tests/new.py": b"x"})
    with tarfile.open(fileobj=io.BytesIO(one)) as tar:
        assert sorted(tar.getnames()) == sorted([*files, "pkg/tests/new.py"])
    assert pristine_dirs(one) == ["pkg/tests"]  # what the verifier keeps exactly as the tar has it


def test_the_issue_names_the_tests_but_never_the_change():
    failures = {"tests/test_a.py::test_clamp": {"line": "assert clamp(0) == 0", "message": "AssertionError: 1 != 0"},
                "tests/test_a.py::test_deep": {"line": "assert top() == 3",
                                               "message": "TypeError: _helper() in pkg/core.py failed"}}
    hidden = ["pkg/core.py", "core.py", "pkg.core", "if x <= low and strict:", "_helper"]
    text = issue_text("pkg", "1.0", "/repo", sorted(failures), failures, hidden, ["clamp"])
    assert "`tests/test_a.py::test_clamp`" in text and "AssertionError: 1 != 0" in text
    assert "assert top() == 3" in text and "_helper" not in text and "pkg/core.py" not in text
    assert not leaks(text, hidden) and "/repo" in text
    assert leaks("see pkg.core for details", ["pkg.core"]) and not leaks("mypkg.core2", ["pkg.core"])
    assert leaks("File pkg/core.py, line 3", ["core.py"]) and not leaks("tests/test_core.py::t", ["core.py"])


def test_patches_apply_with_git_both_ways(tmp_path):
    old, new = "a\nb\nc", "a\nB\nc"  # no newline at the end of the file
    (tmp_path / "f.txt").write_text(new)
    patch = unified_patch({"f.txt": (new, old)})
    assert "\\ No newline at end of file" in patch
    subprocess.run(["git", "apply", "-"], input=patch.encode(), cwd=tmp_path, check=True)
    assert (tmp_path / "f.txt").read_text() == old


def test_the_verifier_puts_tests_back_safely_and_cleans(tmp_path):
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    (repo / "tests" / "test_x.py").write_text("def test(): assert True  # edited by the agent\n")
    (tmp_path / "outside").mkdir()
    (repo / "link").symlink_to(tmp_path / "outside")
    (repo / "pkg" / "__pycache__").mkdir(parents=True)
    (repo / "pkg" / "conftest.py").write_text("planted")
    (repo / "tests" / "conftest.py").write_text("kept")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in (("tests/test_x.py", b"original"), ("../escape.py", b"x"), ("link/evil.py", b"x")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    (tmp_path / "p.tar").write_bytes(buf.getvalue())
    written = runner.restore(str(repo), str(tmp_path / "p.tar"))
    assert written == ["tests/test_x.py", "link/evil.py"]
    assert (repo / "tests" / "test_x.py").read_text() == "original"
    assert not (tmp_path / "escape.py").exists() and not (tmp_path / "outside" / "evil.py").exists()
    (repo / "tests" / "__init__.py").write_text("planted: imported before the tests")
    (repo / "sitecustomize.py").write_text("planted: imported at start-up")
    (repo / "pkg" / "core.py").write_text("the agent's fix")
    runner.clean(str(repo), {*written, "tests/conftest.py"}, ["tests"])
    assert not (repo / "pkg" / "conftest.py").exists() and (repo / "tests" / "conftest.py").exists()
    assert not (repo / "tests" / "__init__.py").exists() and not (repo / "sitecustomize.py").exists()
    assert (repo / "tests" / "test_x.py").exists() and (repo / "pkg" / "core.py").exists()
    assert not (repo / "pkg" / "__pycache__").exists()


def test_reward_counts_fail_to_pass_and_only_broken_pass_to_pass():
    config = {"fail_to_pass": ["a", "b"], "pass_to_pass": ["c", "d"]}
    assert runner.reward(config, {"a": "passed", "b": "failed", "c": "passed", "d": "passed"}) == \
        {"fail_to_pass::a": 1.0, "fail_to_pass::b": 0.0}
    assert runner.reward(config, {"a": "passed", "b": "passed", "c": "failed"}) == \
        {"fail_to_pass::a": 1.0, "fail_to_pass::b": 1.0, "pass_to_pass::c": 0.0, "pass_to_pass::d": 0.0}
    assert runner.reward(config, {}) == {"fail_to_pass::a": 0.0, "fail_to_pass::b": 0.0,
                                         "pass_to_pass::c": 0.0, "pass_to_pass::d": 0.0}


def test_a_job_runs_only_the_tests_it_names_past_a_module_that_does_not_collect(tmp_path):
    scripts, repo = tmp_path / "scripts", tmp_path / "repo"
    scripts.mkdir()
    (repo / "tests").mkdir(parents=True)
    here = Path(runner.__file__).parent
    (scripts / RUNNER).write_text((here / "runner.py").read_text())
    (scripts / PLUGIN).write_text((here / "plugin.py").read_text())
    (repo / "pytest.ini").write_text("[pytest]\n")
    (repo / "tests" / "test_a.py").write_text("def test_one(): pass\n\n\ndef test_two(): assert False\n\n\n"
                                              "def test_three(): pass\n")
    (repo / "tests" / "test_broken.py").write_text("import no_such_module\n")
    ids = [f"tests/test_a.py::test_{n}" for n in ("one", "two", "three")]
    job = {"files": {}, "tests": ["tests/test_a.py"], "timeout": 60}
    (tmp_path / "jobs.json").write_text(json.dumps({
        "repo": str(repo), "config_file": str(repo / "pytest.ini"), "pytest_args": [],
        "jobs": [{**job, "id": "only", "only": ids[:2]},
                 {**job, "id": "all", "tests": ["tests/test_broken.py", "tests/test_a.py"]}]}))
    subprocess.run([sys.executable, str(scripts / RUNNER), "jobs", str(tmp_path / "jobs.json"),
                    str(tmp_path / "out.json")], check=True, cwd=repo)
    only, everything = json.loads((tmp_path / "out.json").read_text())
    assert only["tests"] == {ids[0]: "passed", ids[1]: "failed"}
    # a module that does not import is one failed collection; the other modules still run
    assert everything["tests"] == {ids[0]: "passed", ids[1]: "failed", ids[2]: "passed",
                                   "tests/test_broken.py::collect": "failed"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["jobs.json", "out.json", "repo", "scripts"]


def test_a_mutant_is_judged_by_the_tests_that_call_it():
    gen = Generator.__new__(Generator)  # the judging rule alone: no project, no sandbox
    gen.opts = SweOptions()
    a, b, c, d = "tests/test_a.py::a", "tests/test_a.py::b", "tests/test_a.py::c", "tests/test_b.py::d"
    gen.base = Baseline({a: 0.1, b: 0.1, c: 0.1, d: 0.1}, {}, 1.0)
    candidate = Candidate([], ["tests/test_a.py"], [a, b])  # c does not call the edited function
    bug = gen._judge(candidate, {"status": "ok", "tests": {a: "failed", b: "passed"}})
    assert bug is not None and bug.fail_to_pass == [a] and bug.pass_to_pass == [b, c] and bug.calling == [a, b]
    assert gen._judge(candidate, {"status": "ok", "tests": {a: "passed", b: "passed"}}) is None  # breaks nothing
    assert gen._judge(candidate, {"status": "timeout", "tests": {a: "failed", b: "passed"}}) is None
    # the file no longer imports: the tests it did not run fail too, so nothing of it passes
    assert gen._judge(candidate, {"status": "ok", "tests": {"tests/test_a.py::collect": "failed"}}) is None
    # another file that no longer imports leaves this one's unrun tests passing
    both = Candidate([], ["tests/test_a.py", "tests/test_b.py"], [a, b])
    bug = gen._judge(both, {"status": "ok", "tests": {a: "failed", b: "passed", "tests/test_b.py::collect": "failed"}})
    assert bug is not None and bug.fail_to_pass == [a, d] and bug.pass_to_pass == [b, c]


def test_the_runner_and_plugin_use_only_the_standard_library():
    for module in ("runner", "plugin", "install"):
        path = Path(project.__file__).with_name(f"{module}.py")
        code = ("import sys; sys.modules['albatross'] = None; import runpy; "
                f"runpy.run_path({str(path)!r}, run_name='not_main')")
        subprocess.run([sys.executable, "-I", "-c", code], check=True)


def test_requirements_and_versions():
    assert parse_requirement("Toolz==1.0.0") == ("toolz", "1.0.0")
    assert parse_requirement("more_itertools") == ("more-itertools", None)
    with pytest.raises(UserError, match="--package"):
        parse_requirement("toolz>=1")
    files = [{"filename": f"toolz-{v}.tar.gz", "url": v} for v in ("0.9", "1.0.0", "1.1.0rc1")] + \
            [{"filename": "toolz-1.0.0-py3-none-any.whl", "url": "w"}, {"filename": "toolz-0.10.tar.gz", "url": "y",
                                                                          "yanked": True}]
    assert _pick(files, "toolz", None, "toolz")["url"] == "1.0.0"  # newest final release with an sdist
    assert _pick(files, "toolz", "1.1.0rc1", "toolz")["url"] == "1.1.0rc1"
    with pytest.raises(UserError, match="no source distribution of version 2"):
        _pick(files, "toolz", "2", "toolz==2")


def test_unpack_strips_the_top_directory_and_refuses_escapes(tmp_path):
    def sdist(entries: dict[str, bytes], name: str) -> Sdist:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            for entry, data in entries.items():
                info = tarfile.TarInfo(entry)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        (tmp_path / name).write_bytes(buf.getvalue())
        return Sdist("p", "1", tmp_path / name, "")

    out = unpack(sdist({"p-1/setup.py": b"x", "p-1/p/__init__.py": b""}, "ok.tar.gz"), tmp_path / "ok")
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == ["p", "p/__init__.py", "setup.py"]
    with pytest.raises(UserError, match="cannot unpack"):
        unpack(sdist({"p-1/../../evil": b"x"}, "bad.tar.gz"), tmp_path / "bad")
    assert not (tmp_path.parent / "evil").exists()


def test_difficulties_interleave_in_their_shares():
    bugs = [Bug([], [], [], {}, d) for d in ["easy"] * 20 + ["medium"] * 12 + ["hard"] * 8]
    order = [b.difficulty for b in _interleave(bugs, (0.5, 0.3, 0.2))]
    first = order[:10]
    assert (first.count("easy"), first.count("medium"), first.count("hard")) == (5, 3, 2)
    only_easy = _interleave([Bug([], [], [], {}, "easy")] * 3 + [Bug([], [], [], {}, "hard")], (0.5, 0.3, 0.2))
    assert len(only_easy) == 4  # a difficulty that runs out leaves its turns to the others


# ---- SWE-bench instances --------------------------------------------------------------------------------


def test_instances_are_checked_line_by_line(tmp_path):
    from albatross.tasks.swe.swebench import read_instances

    good = {"instance_id": "a-1", "repo": "o/a", "base_commit": "abcdef1", "patch": "", "test_patch": "",
            "problem_statement": "x", "FAIL_TO_PASS": "[\"t::a\"]", "PASS_TO_PASS": []}
    path = tmp_path / "i.jsonl"
    path.write_text(json.dumps(good) + "\n\n" + json.dumps({**good, "FAIL_TO_PASS": "nope"}) + "\n")
    with pytest.raises(UserError, match=r"i.jsonl:3: FAIL_TO_PASS must be a list"):
        read_instances(path)
    path.write_text(json.dumps({k: v for k, v in good.items() if k != "patch"}) + "\n")
    with pytest.raises(UserError, match=r"i.jsonl:1: the instance has no patch"):
        read_instances(path)
    path.write_text("{not json\n")
    with pytest.raises(UserError, match=r"i.jsonl:1: not JSON"):
        read_instances(path)


def test_an_instance_becomes_a_task_and_back(tmp_path):
    from albatross.tasks.swe.swebench import import_instances, instance_of
    from swe_util import swebench_repo

    _repo, inst = swebench_repo(tmp_path / "repos")
    (tmp_path / "i.jsonl").write_text(json.dumps(inst) + "\n")
    [task] = import_instances(tmp_path / "i.jsonl", tmp_path / "repos", tmp_path / "out", log=lambda m: None)
    assert instance_of(task) == inst
    config = json.loads((task / "tests" / "config.json").read_text())
    assert config["fail_to_pass"] == ["tests/test_calc.py::test_window"] and config["tests"] == ["tests/test_calc.py"]
    with tarfile.open(task / "tests" / "pristine.tar") as tar:
        restored = tar.extractfile("tests/test_calc.py").read().decode()
    image_tests = (task / "environment" / "repo" / "tests" / "test_calc.py").read_text()
    assert "def test_window()" in restored and "def test_window()" not in image_tests  # the new test stays hidden
    assert "len(seq) - n)" in (task / "environment" / "repo" / "tinycalc" / "__init__.py").read_text()  # the bug
    assert (task / "solution" / "fix.patch").read_text() == inst["patch"]
    assert "window() drops the last window" in (task / "instruction.md").read_text()
    with pytest.raises(UserError, match="no clone of acme/other"):
        import_instances_missing = {**inst, "repo": "acme/other"}
        (tmp_path / "j.jsonl").write_text(json.dumps(import_instances_missing) + "\n")
        import_instances(tmp_path / "j.jsonl", tmp_path / "repos", tmp_path / "out2", log=lambda m: None)


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    from albatross.cli import main

    assert main(["tasks", "swe", "--package", "toolz>=1", "--sdist", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert main(["tasks", "swe", "--package", "toolz", "--sdist", str(tmp_path / "nope"), "--out",
                 str(tmp_path / "o")]) == 2
    assert main(["tasks", "swe", "--package", "toolz", "--count", "0", "--out", str(tmp_path / "o")]) == 2
    (tmp_path / "i.jsonl").write_text('{"instance_id": "x"}\n')
    assert main(["tasks", "import", "swebench", str(tmp_path / "i.jsonl"), "--repos", str(tmp_path), "--out",
                 str(tmp_path / "o")]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 4 and all(e.startswith("albatross: error: ") for e in errors), errors
    assert "--package 'toolz>=1'" in errors[0] and "no such file" in errors[1] and "--count" in errors[2]
    assert "i.jsonl:1: the instance has no repo" in errors[3]
