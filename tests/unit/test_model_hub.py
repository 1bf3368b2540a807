"""`model.path` as a Hugging Face id, resolved through a local hub cache laid out here as huggingface_hub lays it
out (models--ORG--NAME/refs/main -> snapshots/<commit>/), with the hub unreachable (HF_HUB_OFFLINE)."""

from pathlib import Path

import pytest

from albatross.cli import main
from albatross.config import ConfigError, load_config
from albatross.errors import UserError
from albatross.pipeline.model import resolve_model_path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hf")
    repo = root / "hub" / "models--acme--tiny-agent"
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text('{"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}')
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return root / "hub"


@pytest.fixture
def offline(hub, monkeypatch) -> Path:
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub


def test_a_hub_id_resolves_to_its_cached_snapshot(offline):
    snapshot = offline / "models--acme--tiny-agent" / "snapshots" / COMMIT
    assert load_config(None, ["model.path=acme/tiny-agent"]).model.path == "acme/tiny-agent"
    assert resolve_model_path("acme/tiny-agent") == snapshot
    assert resolve_model_path(str(snapshot)) == snapshot  # a directory stays itself


def test_a_missing_id_is_one_line_saying_where_it_looked(offline):
    with pytest.raises(UserError) as e:
        resolve_model_path("acme/not-there")
    msg = str(e.value)
    assert "\n" not in msg and str(offline / "models--acme--not-there") in msg and "HF_HUB_OFFLINE" in msg
    with pytest.raises(ConfigError) as e:  # a path that is no id is refused when the config loads
        load_config(None, ["model.path=/no/such/dir"])
    assert "does not exist" in str(e.value)


def test_train_with_a_hub_id_uses_the_cached_model(offline, tmp_path, capsys):
    """The run's model stage: the id becomes the snapshot directory, which the run then uses everywhere (the
    directory's own checks are those of any model directory, tests/integration/test_train_model_path.py)."""
    from albatross.pipeline.driver import Pipeline
    from albatross.tasks.builtin import generate_tasks

    generate_tasks(tmp_path / "tasks", families=["count_lines"], n_train=2, n_heldout=0, seed=0)
    cfg = load_config(None, ["model.path=acme/tiny-agent", f"tasks.train={tmp_path / 'tasks' / 'train'}",
                             f"out={tmp_path / 'out'}", "harness.action_format=bash_block"])
    pipeline = Pipeline(cfg, log=print)
    pipeline.prepare_out()
    path = pipeline._resolve_model()
    assert path == offline / "models--acme--tiny-agent" / "snapshots" / COMMIT and pipeline.cfg.model.path == str(path)
    assert pipeline.model_name == "acme/tiny-agent" and str(path) in (tmp_path / "out" / "config.json").read_text()
    missing = tmp_path / "missing.toml"
    missing.write_text(f'out = "{tmp_path / "out2"}"\n[model]\npath = "acme/gone"\n[tasks]\n'
                       f'train = ["{tmp_path / "tasks" / "train"}"]\n')
    assert main(["train", str(missing)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "models--acme--gone" in err
