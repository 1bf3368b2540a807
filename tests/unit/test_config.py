import subprocess
import sys
from pathlib import Path

import pytest

from albatross.config import ConfigError, RunConfig, describe_fields, load_config

ROOT = Path(__file__).resolve().parents[2]


def test_demo_toml_loads_and_matches_fields():
    cfg = load_config(ROOT / "configs" / "demo.toml")
    assert cfg.orchestrator.group_size == 8
    assert cfg.sandbox.type == "local"


def test_overrides_any_field():
    cfg = load_config(None, ["trainer.lr=0.5", "sandbox.type=process", "tasks.families=[\"count_lines\"]"])
    assert cfg.trainer.lr == 0.5
    assert cfg.sandbox.type == "process"
    assert cfg.tasks.families == ["count_lines"]


@pytest.mark.parametrize("override, needle", [
    ("trainer.lr=-1", "trainer.lr"),
    ("trainer.nope=1", "trainer.nope: unknown field"),
    ("sandbox.type=kvm", "sandbox.type"),
])
def test_bad_override_is_one_line_naming_field(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_bad_toml_names_file(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("[trainer]\nlr = 'fast'\n")
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert str(p) in str(e.value) and "trainer.lr" in str(e.value)


def test_every_field_documented():
    rows = describe_fields(RunConfig)
    assert len(rows) > 40
    missing = [name for name, _, desc in rows if not desc]
    assert missing == []


def test_cli_bad_config_exit_code_2(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text("[orchestrator]\ngroup_size = 1\n")
    r = subprocess.run([sys.executable, "-m", "albatross.cli", "train", str(p)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2
    assert "orchestrator.group_size" in r.stderr and str(p) in r.stderr
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_cli_help_is_fast_and_lists_commands():
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "albatross.cli", "--help"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    for cmd in ("demo", "train", "tasks", "config"):
        assert cmd in r.stdout
    assert "torch" not in r.stderr.split()  # no heavy import for --help
