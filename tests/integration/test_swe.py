"""Repository tasks end to end, on a project made by the test (its sdist directory, its git history): `albatross tasks
swe` builds the project's image, injects bugs and keeps tasks that pass the nine gates; `tasks import swebench`
round-trips an instance; an agent fixes a task with the bash-block editor and its diff is recorded; and `albatross
train` with `tasks.mix` over terminal and repository tasks reports Pass@1 per source.

The image builds install the project and pytest from the package index (the builds' one network use); the tasks,
their oracle and every attempt run offline."""

import json
from pathlib import Path

import pytest

from albatross.sandbox import local_available
from model_dirs import albatross, model_dir, write_config
from swe_util import swebench_repo, write_project

pytestmark = pytest.mark.skipif(not local_available(), reason="needs root, namespaces and overlayfs")


@pytest.fixture(scope="module")
def swe_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("swe")
    project = write_project(root / "tinycalc-1.0")
    out = root / "swe"
    r = albatross("tasks", "swe", "--package", "tinycalc==1.0", "--sdist", str(project), "--count", "2",
                  "--heldout", "1", "--out", str(out), "--workers", "2", timeout=1200)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return out


def test_tasks_swe_keeps_bugs_that_pass_the_nine_gates(swe_dir):
    report = json.loads((swe_dir / "swe-tinycalc-1.0.json").read_text())
    assert report["tasks_validated"] == 2 and report["mutants_kept"] >= 2 and not report["rejected"], report
    assert report["mutations_tried"] >= report["mutants_kept"] and report["seconds"]["total"] > 0
    tasks = sorted((swe_dir / "train").iterdir()) + sorted((swe_dir / "heldout").iterdir())
    assert [len(list((swe_dir / s).iterdir())) for s in ("train", "heldout")] == [1, 1]
    for task in tasks:
        text = (task / "instruction.md").read_text()
        patch = (task / "solution" / "fix.patch").read_text()
        changed = [ln[1:].strip() for ln in patch.splitlines() if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
        assert "tinycalc/__init__.py" not in text and not any(c and c in text for c in changed), text
        assert "`tests/test_calc.py::" in text
        assert (task / "environment" / "Dockerfile").read_text().startswith("FROM albatross-swe/tinycalc:1.0-")
        config = json.loads((task / "tests" / "config.json").read_text())
        assert config["fail_to_pass"] and set(config["fail_to_pass"]).isdisjoint(config["pass_to_pass"])


def test_eval_reports_the_share_of_fail_to_pass_tests_fixed_per_source(swe_dir, tmp_path):
    """The oracle fixes every FAIL_TO_PASS test, the untouched repository none; `albatross eval` says so per source."""
    for agent, fixed in (("oracle", 1.0), ("noop", 0.0)):
        r = albatross("eval", "--agent", agent, "--tasks", str(swe_dir), "--trials", "1", "--out", str(tmp_path / agent))
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        summary = json.loads((tmp_path / agent / "summary.json").read_text())
        assert summary["per_source"] == [{**summary["per_source"][0], "source": "swe/tinycalc", "tasks": 2,
                                          "pass_at_1": fixed, "fail_to_pass_fixed": fixed}], summary["per_source"]
        assert "FAIL_TO_PASS fixed" in r.stdout


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("swebench")
    _repo, instance = swebench_repo(root / "repos")
    (root / "instances.jsonl").write_text(json.dumps(instance) + "\n")
    r = albatross("tasks", "import", "swebench", str(root / "instances.jsonl"), "--repos", str(root / "repos"),
                  "--out", str(root / "out"), "--validate", timeout=1200)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "1 tasks: 1 passed all nine gates" in r.stdout
    return root / "out" / "acme__tinycalc-1", instance


def test_import_swebench_round_trips_an_instance(imported):
    from albatross.tasks.swe.swebench import instance_of

    task, instance = imported
    assert instance_of(task) == instance


def _search_replace(patch: str) -> tuple[str, str, str]:
    """(file, text now, fixed text) of a one-hunk patch."""
    lines = patch.splitlines(keepends=True)
    file = next(ln for ln in lines if ln.startswith("+++ b/"))[6:].strip()
    body = lines[next(i for i, ln in enumerate(lines) if ln.startswith("@@")) + 1:]
    old = "".join(ln[1:] for ln in body if ln[:1] in " -")
    new = "".join(ln[1:] for ln in body if ln[:1] in " +")
    return file, old, new


def test_an_agent_fixes_a_task_with_the_bash_block_editor_and_its_diff_is_recorded(swe_dir):
    from albatross.bench.harness import ScriptedPolicy
    from albatross.config import HarnessConfig
    from albatross.engine.base import SamplingParams
    from albatross.harness.agent import Agent, AttemptSpec
    from albatross.harness.chat import TinyChatFormat, TinyTokenizer
    from albatross.sandbox import make_backend
    from albatross.sandbox.base import Limits
    from albatross.tasks.format import load_task

    one_hunk = [t for t in sorted(swe_dir.glob("*/*/solution/fix.patch"))
                if sum(ln.startswith("@@") for ln in t.read_text().splitlines()) == 1]
    assert one_hunk, "no task with a one-hunk fix"
    task = load_task(one_hunk[0].parents[1])
    file, old, new = _search_replace(one_hunk[0].read_text())
    fix = f"edit replace {file} <<'EOF'\n<<<<<<< SEARCH\n{old}=======\n{new}>>>>>>> REPLACE\nEOF"
    actions = [f"```bash\n{cmd}\n```" for cmd in (f"edit view {file} 1 3", fix, "submit")]
    fmt = TinyChatFormat(TinyTokenizer.from_corpus([task.instruction, *actions]))
    cfg = HarnessConfig(max_turns=5, max_tokens_per_turn=600, max_context_tokens=8192, action_format="bash_block")
    backend = make_backend("local")
    try:
        agent = Agent(None, backend, fmt, cfg, SamplingParams(), Limits(command_timeout_s=30))
        traj = agent.run(AttemptSpec(task, "g", 0), engine=ScriptedPolicy(actions, fmt))
        untouched = agent.run(AttemptSpec(task, "g", 1), engine=ScriptedPolicy(["```bash\nsubmit\n```"], fmt))
    finally:
        backend.close()
    assert traj.turns[0].observation.startswith('     1\t"""Small functions with tests."""'), traj.turns[0]
    assert traj.turns[1].observation.startswith(f"edited {file}: replaced 1 occurrence"), traj.turns[1].observation
    assert traj.status == "ok" and traj.success, (traj.error, traj.reward)
    assert traj.reward.metrics and all(k.startswith("fail_to_pass::") and v == 1.0 for k, v in traj.reward.metrics.items())
    changed = [ln for ln in one_hunk[0].read_text().splitlines() if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]
    assert changed and all(ln in traj.diff.splitlines() for ln in changed), traj.diff  # the diff is the fix
    assert traj.to_dict()["diff"] == traj.diff
    assert not untouched.success and untouched.diff == ""  # the untouched repository: nothing changed, no success


def test_train_with_a_task_mix_reports_pass_at_1_per_source(tmp_path, swe_dir):
    out = tmp_path / "out"
    cfg = write_config(tmp_path / "run.toml", model_dir(tmp_path, "qwen3"), tmp_path, out, context_tokens=2048,
                       warm_steps=40, check_every=40, groups_per_step=1, max_steps=2)
    text = cfg.read_text().replace(f'train = ["{tmp_path / "train"}"]\nheldout = ["{tmp_path / "heldout"}"]\n',
                                   f'mix = {{ "{swe_dir}" = 1, "count_lines" = 1 }}\nn_train = 8\nn_heldout = 2\n')
    cfg.write_text(text.replace("check_tasks = 8", "check_tasks = 4"))
    r = albatross("train", str(cfg), env={"ALBATROSS_CACHE": str(tmp_path / "cache")}, timeout=1800)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "[tasks] mix of 2 sources: swe (1 train, 1 held-out, weight 1)" in r.stdout
    summary = json.loads((out / "summary.json").read_text())
    for split in ("base", "trained"):
        rows = {row["source"]: row for row in summary["heldout_by_source"][split]}
        assert set(rows) == {"swe", "count_lines"}, rows
        assert rows["swe"]["tasks"] == 1 and rows["count_lines"]["tasks"] == 2
        assert rows["swe"]["fail_to_pass_fixed"] is not None and rows["count_lines"]["fail_to_pass_fixed"] is None
        assert 0.0 <= rows["swe"]["pass_at_1"] <= 1.0
    trajectories = [json.loads(line) for line in (out / "run" / "trajectories.jsonl").read_text().splitlines()]
    assert {t["source"] for t in trajectories} == {"swe", "count_lines"}  # both sources drawn
    assert any("fail_to_pass::" in k for t in trajectories for k in t["reward"]["metrics"])
    metrics = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("source/count_lines/groups" in m for m in metrics)
    assert "Per source" in (out / "report.html").read_text()
