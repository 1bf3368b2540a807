"""The bash-block editor (`edit view|create|replace`), the task mix (its sampler keeps each source's share and
resumes exactly; its sources load from directories and families), and evaluation per source (Pass@1 and the share
of FAIL_TO_PASS tests fixed)."""

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from albatross.errors import UserError
from albatross.eval.run import by_source, fail_to_pass_share, summarize
from albatross.harness import edit_helper
from albatross.orchestrator.state import MixSampler, TaskSampler
from albatross.records import Trajectory

HELPER = Path(edit_helper.__file__)


def edit(*args: str, stdin: str = "", cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-I", str(HELPER), *args], input=stdin, capture_output=True, text=True,
                          cwd=cwd)


def block(old: str, new: str) -> str:
    return f"<<<<<<< SEARCH\n{old}=======\n{new}>>>>>>> REPLACE\n"


def test_edit_create_view_replace(tmp_path):
    r = edit("create", "pkg/m.py", stdin="def f():\n    return 1\n\ndef g():\n    return 1\n", cwd=tmp_path)
    assert (r.returncode, r.stdout) == (0, "wrote 45 bytes to pkg/m.py\n")
    assert edit("view", "pkg/m.py", "4", "5", cwd=tmp_path).stdout == "     4\tdef g():\n     5\t    return 1\n"
    assert edit("view", "pkg/m.py", "9", cwd=tmp_path).stdout == "[pkg/m.py: no lines in that range; it has 5 lines]\n"
    r = edit("replace", "pkg/m.py", stdin=block("def g():\n    return 1\n", "def g():\n    return 2\n"), cwd=tmp_path)
    assert (r.returncode, r.stdout) == (0, "edited pkg/m.py: replaced 1 occurrence (first at line 4)\n")
    assert (tmp_path / "pkg/m.py").read_text() == "def f():\n    return 1\n\ndef g():\n    return 2\n"
    two = block("    return 1\n", "    return 3\n") + block("def g():\n", "def h():\n")  # several blocks at once
    r = edit("replace", "pkg/m.py", stdin=two, cwd=tmp_path)
    assert r.returncode == 0 and (tmp_path / "pkg/m.py").read_text() == "def f():\n    return 3\n\ndef h():\n    return 2\n"


@pytest.mark.parametrize("stdin, args, message", [
    (block("nope\n", "x\n"), [], "SEARCH text not found in m.py"),
    (block("    return 1\n", "x\n"), [], "SEARCH text occurs 2 times in m.py"),
    ("just text\n", [], "no edit block"),
    (block("def f():\n", "def f2():\n") + block("absent\n", "x\n"), [], "SEARCH text not found"),  # all or nothing
])
def test_edit_refuses_what_it_cannot_do_and_writes_nothing(tmp_path, stdin, args, message):
    (tmp_path / "m.py").write_text("def f():\n    return 1\n\ndef g():\n    return 1\n")
    r = edit("replace", "m.py", *args, stdin=stdin, cwd=tmp_path)
    assert r.returncode == 1 and message in r.stderr
    assert (tmp_path / "m.py").read_text() == "def f():\n    return 1\n\ndef g():\n    return 1\n"


def test_edit_replace_all_and_usage(tmp_path):
    (tmp_path / "m.py").write_text("a\na\n")
    assert edit("replace", "m.py", "--all", stdin=block("a\n", "b\n"), cwd=tmp_path).returncode == 0
    assert (tmp_path / "m.py").read_text() == "b\nb\n"
    assert edit("frobnicate", "m.py", cwd=tmp_path).returncode == 2
    assert edit("view", "m.py", "x", cwd=tmp_path).returncode == 2
    assert "no such file: nope.py" in edit("view", "nope.py", cwd=tmp_path).stderr
    (tmp_path / "bin.dat").write_bytes(b"\xff\xfe\x00")
    assert "not a UTF-8 text file" in edit("view", "bin.dat", cwd=tmp_path).stderr


# ---- the mix ---------------------------------------------------------------------------------------------


def test_mix_sampler_keeps_each_share_within_one_draw():
    sampler = MixSampler([[0, 1, 2], [3, 4], [5]], [2.0, 1.0, 1.0], seed=0)
    drawn = [sampler.next() for _ in range(40)]
    source = {0: "a", 1: "a", 2: "a", 3: "b", 4: "b", 5: "c"}
    for n in range(1, 41):
        counts = Counter(source[i] for i in drawn[:n])
        assert abs(counts["a"] - n / 2) <= 1 and abs(counts["b"] - n / 4) <= 1 and abs(counts["c"] - n / 4) <= 1
    assert set(drawn[:12]) == {0, 1, 2, 3, 4, 5}  # each source cycles through its own tasks


def test_mix_sampler_resumes_exactly():
    a = MixSampler([[0, 1, 2, 3], [4, 5, 6]], [1.5, 1.0], seed=3)
    [a.next() for _ in range(7)]
    saved = json.loads(json.dumps(a.state()))  # as state.json holds it
    b = MixSampler([[0, 1, 2, 3], [4, 5, 6]], [1.5, 1.0], seed=3)
    b.restore(saved)
    assert [a.next() for _ in range(30)] == [b.next() for _ in range(30)]
    with pytest.raises(ValueError, match="sources changed"):
        MixSampler([[0]], [1.0], seed=3).restore(saved)
    with pytest.raises(ValueError):
        MixSampler([[0], []], [1.0, 1.0], seed=0)
    plain = TaskSampler(3, 0)  # no mix: the sampler runs did before
    assert sorted(plain.next() for _ in range(3)) == [0, 1, 2]


def test_mix_sources_from_directories_and_families(tmp_path):
    from albatross.tasks.builtin import generate_tasks
    from albatross.tasks.format import load_tasks
    from albatross.tasks.mix import load_mix, source_of

    generate_tasks(tmp_path / "split", families=["grep_word"], n_train=2, n_heldout=1, seed=1)
    flat = generate_tasks(tmp_path / "other", families=["sort_unique"], n_train=2, n_heldout=0, seed=1)["train"]
    calls = []

    def generate(families):
        calls.append(families)
        made = generate_tasks(tmp_path / "gen", families=families, n_train=4, n_heldout=2, seed=5)
        return {split: load_tasks(paths) if paths else [] for split, paths in made.items()}

    mix = {str(tmp_path / "split"): 2.0, str(flat[0].parent): 1.0, "count_lines": 1.0, "follow_pointer": 1.0}
    sources = load_mix(mix, generate, [str(tmp_path / "split" / "heldout")])
    assert calls == [["count_lines", "follow_pointer"]]
    by_name = {s.name: s for s in sources}
    assert set(by_name) == {"split", "other", "count_lines", "follow_pointer"}
    assert (len(by_name["split"].train), len(by_name["split"].heldout)) == (2, 1)  # train/ and heldout/
    assert (len(by_name["other"].train), len(by_name["count_lines"].train), len(by_name["count_lines"].heldout)) \
        == (2, 2, 1)
    assert by_name["split"].weight == 2.0
    owner = source_of(sources)
    assert owner[by_name["count_lines"].train[0].id] == "count_lines"
    with pytest.raises(UserError, match="neither a directory nor a built-in family"):
        load_mix({"no/such/dir": 1.0}, generate)
    with pytest.raises(UserError, match="in both"):
        load_mix({str(tmp_path / "split" / "train"): 1.0, str(tmp_path / "split"): 1.0}, generate)


# ---- evaluation per source -------------------------------------------------------------------------------


def _record(task: str, success: bool, metrics: dict, source: str = "", status: str = "ok") -> dict:
    t = Trajectory(task_id=task, group_id="g", attempt=0, status=status)
    t.reward.success, t.reward.metrics = success, metrics
    return {**t.to_dict(), **({"source": source} if source else {})}


def test_fail_to_pass_share_and_pass_at_1_per_source():
    assert fail_to_pass_share({"fail_to_pass::a": 1.0, "fail_to_pass::b": 0.0, "pass_to_pass::c": 0.0}) == 0.5
    assert fail_to_pass_share({"count_correct": 1.0}) is None
    records = [_record("s1", True, {"fail_to_pass::a": 1.0}), _record("s1", False, {"fail_to_pass::a": 0.0}),
               _record("s2", False, {"fail_to_pass::a": 1.0, "fail_to_pass::b": 0.0, "pass_to_pass::c": 0.0}),
               _record("t1", True, {"ok": 1.0}), _record("t1", False, {}, status="infra_error")]
    rows = by_source(records, {"s1": "swe", "s2": "swe", "t1": "terminal"})
    swe, terminal = rows
    assert (swe["source"], swe["tasks"], swe["attempts"], swe["pass_at_1"]) == ("swe", 2, 3, 0.25)
    assert swe["fail_to_pass_fixed"] == pytest.approx((0.5 + 0.5) / 2)
    assert (terminal["pass_at_1"], terminal["attempts"], terminal["fail_to_pass_fixed"]) == (1.0, 1, None)
    named = [dict(r, attempt=i) for i, r in enumerate([_record("s1", True, {}, "swe"), _record("t1", False, {}, "tb")])]
    assert [r["source"] for r in summarize(named)["per_source"]] == ["swe", "tb"]
    assert "per_source" not in summarize([_record("x", True, {})])


def test_tasks_mix_in_config_and_on_the_command_line():
    from albatross.config import ConfigError, load_config

    assert load_config(None, ["tasks.mix=tasks/swe=2,count_lines=1"]).tasks.mix == {"tasks/swe": 2.0,
                                                                                     "count_lines": 1.0}
    assert load_config(None, ['tasks.mix={"a": 1}']).tasks.mix == {"a": 1.0}
    with pytest.raises(ConfigError, match="weight of 'a' must be a positive finite number"):
        load_config(None, ["tasks.mix=a=0"])
    with pytest.raises(ConfigError, match="tasks.mix replaces tasks.train"):
        load_config(None, ["tasks.mix=a=1", "tasks.train=x"])
