"""The command line as a user types it: config fields as flags anywhere, list fields, typos, one meaning per flag,
whole help texts, and runs that never clobber each other."""

import argparse
import hashlib
import json
import re
from pathlib import Path

import pytest

from albatross.cli import build_parser, main
from albatross.config import load_config


def _config(capsys, *argv: str) -> dict:
    assert main(["config", *argv]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture
def minimal(tmp_path) -> Path:
    p = tmp_path / "mine.toml"
    p.write_text("[orchestrator]\ngroup_size = 4\n")
    return p


def test_field_flags_work_before_and_after_the_config_path(capsys, minimal):
    for argv in (["--harness.max_turns", "8", str(minimal)], [str(minimal), "--harness.max_turns", "8"],
                 ["--harness.max_turns=8", str(minimal)], [str(minimal), "--set", "harness.max_turns=8"]):
        cfg = _config(capsys, *argv)
        assert cfg["harness"]["max_turns"] == 8 and cfg["orchestrator"]["group_size"] == 4, argv
    assert _config(capsys, "--trainer.lr", "1e-5")["trainer"]["lr"] == 1e-5  # no config file at all


def test_list_fields_take_a_comma_list_or_a_single_path(capsys, minimal):
    assert _config(capsys, str(minimal), "--tasks.train", "/data/a,/data/b")["tasks"]["train"] == ["/data/a", "/data/b"]
    assert _config(capsys, str(minimal), "--tasks.train=/data/x")["tasks"]["train"] == ["/data/x"]
    assert _config(capsys, str(minimal), "--tasks.train", '["/data/j"]')["tasks"]["train"] == ["/data/j"]


def test_an_unknown_field_suggests_the_nearest_names(capsys, minimal):
    assert main(["config", str(minimal), "--rl.lrr", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "rl.lrr: unknown field" in err and "trainer.lr" in err
    assert main(["train", str(minimal), "--harness.max_turn", "3"]) == 2
    assert "did you mean harness.max_turns" in capsys.readouterr().err


def test_a_field_flag_without_value_or_on_a_command_without_config_is_refused(capsys, minimal):
    assert main(["config", str(minimal), "--trainer.lr"]) == 2
    assert "--trainer.lr needs a value" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["tasks", "families", "--trainer.lr", "1"])
    assert e.value.code == 2


def test_defaults_suit_a_real_model_and_the_demo_keeps_its_own(minimal):
    from albatross.pipeline.demo import demo_config

    cfg = load_config(minimal)
    assert cfg.name == "mine" and cfg.out == ""  # the run directory is runs/mine-<time>
    assert (cfg.harness.max_turns, cfg.harness.max_tokens_per_turn, cfg.harness.max_context_tokens) == (30, 2048, 16384)
    assert cfg.trainer.lr == 1e-6 and cfg.orchestrator.max_minutes >= 60
    demo = demo_config(None, False, None, [])
    assert demo.name == "demo" and demo.harness.max_turns == 4 and demo.harness.max_context_tokens == 512
    assert demo.trainer.lr > 1e-5 and demo.orchestrator.max_minutes <= 15


def test_config_shows_the_resolved_values(capsys, minimal):
    cfg = _config(capsys, str(minimal))
    assert cfg["name"] == "mine" and cfg["out"].startswith("runs/mine-")
    assert cfg["harness"]["max_turns"] == 30 and cfg["trainer"]["lr"] == 1e-6


def test_version(capsys):
    from albatross import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"albatross {__version__}"


def _flags(parser: argparse.ArgumentParser, path: str = ""):
    for action in parser._actions:
        yield path, action
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _flags(sub, f"{path} {name}".strip())


def test_one_meaning_per_flag_name_across_commands():
    meanings: dict[str, dict] = {}
    for command, action in _flags(build_parser()):
        for flag in action.option_strings:
            meaning = (action.dest, action.type, type(action).__name__)
            meanings.setdefault(flag, {}).setdefault(meaning, []).append(command or "albatross")
    clashes = {flag: m for flag, m in meanings.items() if len(m) > 1}
    assert clashes == {}


_CUT = re.compile(r"\b(the|a|an|of|in|to|and|or|with|for|by|at|from)$", re.I)  # "on" ends "off / on"


def _whole(text: str) -> bool:
    text = text.strip()
    pairs = [("(", ")"), ("[", "]"), ("{", "}")]
    return (not _CUT.search(text) and all(text.count(a) == text.count(b) for a, b in pairs)
            and text.count("`") % 2 == 0 and text.count('"') % 2 == 0)


def test_every_help_text_is_whole(capsys):
    parser = build_parser()
    texts = []
    for command, action in _flags(parser):
        if action.help and action.help != argparse.SUPPRESS:
            texts.append((command, action.option_strings, action.help))
        if isinstance(action, argparse._SubParsersAction):  # each subcommand's line in its group's list
            texts += [(command, choice.dest, choice.help) for choice in action._choices_actions if choice.help]
    assert len(texts) > 100
    cut = [t for t in texts if not _whole(str(t[2]))]
    assert cut == []
    with pytest.raises(SystemExit):
        main(["bench", "recipe", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "measured in miniature on the demo's workload" in out and ".md" not in out.split("options:")[0]


def _tree_hash(root: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(root)).encode() + f.read_bytes())
    return h.hexdigest()


def test_a_second_run_into_a_used_out_is_refused_and_the_first_is_intact(tmp_path, capsys, minimal):
    out = tmp_path / "run1"
    (out / "run" / "checkpoints").mkdir(parents=True)
    (out / "config.json").write_text(load_config(minimal).model_dump_json())
    (out / "run" / "checkpoints" / "step-3.pt").write_bytes(b"weights")
    (out / "summary.json").write_text("{}")
    before = _tree_hash(out)
    assert main(["train", str(minimal), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "already holds files" in err and f"--resume {out}" in err
    assert "--overwrite" in err
    assert _tree_hash(out) == before
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "notes.txt").write_text("mine")
    assert main(["train", str(minimal), "--out", str(stray), "--overwrite"]) == 2
    assert "only a run directory" in capsys.readouterr().err and (stray / "notes.txt").is_file()


def test_no_out_is_a_new_directory_per_run(tmp_path, minimal):
    from albatross.pipeline.driver import Pipeline, default_out

    first = default_out("mine", tmp_path)
    Path(first).mkdir()
    second = default_out("mine", tmp_path)
    assert Path(first).name.startswith("mine-2") and second != first and not Path(second).exists()
    pipeline = Pipeline(load_config(minimal))
    assert re.fullmatch(r"mine-\d{8}-\d{6}(-\d+)?", pipeline.out.name) and pipeline.out.parent.name == "runs"
