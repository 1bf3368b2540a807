import os
from pathlib import Path

import pytest

from background import Job, Result, startable

_JOBS = pytest.StashKey[dict[str, Job]]()


def pytest_collection_finish(session: pytest.Session) -> None:
    """The commands of the selected tests marked ``background`` start now, at the lowest priority
    (``background.py``)."""
    jobs: dict[str, Job] = {}
    if not session.config.option.collectonly:
        for item in session.items:
            marker = item.get_closest_marker("background")
            if marker is not None and startable(marker.args[0]):
                jobs[item.nodeid] = Job(*marker.args, **marker.kwargs)
    session.config.stash[_JOBS] = jobs


def pytest_sessionfinish(session: pytest.Session) -> None:
    for job in session.config.stash.get(_JOBS, {}).values():
        job.close()


@pytest.fixture
def background(request: pytest.FixtureRequest) -> Result:
    """The result of the test's ``background`` command, started when the session started."""
    job = request.config.stash.get(_JOBS, {}).get(request.node.nodeid)
    assert job is not None, "the test's background command did not start (its program is missing)"
    return job.result()


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    """The isolated sandbox, no warm pool, the tests' temporary files hidden from attempts. Modules that need
    another backend (a container engine, a warm pool, a private cache) define their own ``backend``."""
    from albatross.sandbox.local import LocalBackend

    b = LocalBackend(warm=0, hide_paths=[tmp_path_factory.getbasetemp()])
    yield b
    b.close()


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory) -> Path:
    """One cache of warm-started demo models shared by the tests that run the quick demo."""
    path = os.environ.get("ALBATROSS_TEST_CACHE")
    return Path(path) if path else tmp_path_factory.mktemp("albatross-cache")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2 model with the demo tokenizer, saved as a model directory (for servers and pools)."""
    from albatross.config import ModelConfig
    from albatross.harness.chat import TinyTokenizer
    from albatross.pipeline.demo import build_tiny, save_model

    tok = TinyTokenizer.from_corpus(["count the lines of notes in the file", "echo hello world"])
    cfg = ModelConfig(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
                      max_positions=256)
    return save_model(build_tiny(cfg, tok), tok, tmp_path_factory.mktemp("tiny-model") / "tiny")


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread, and it keeps tests quick on a loaded 2-core machine
    (modules use it with ``pytestmark = pytest.mark.usefixtures("one_thread")``)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


_ROOT = Path(__file__).resolve().parent.parent
_ROOT_ENTRIES = {p.name for p in _ROOT.iterdir()}


@pytest.fixture(autouse=True)
def _no_file_left_in_the_checkout():
    """Tests write under their own temporary folders: a test that leaves a file in the checkout's root fails."""
    yield
    new = sorted({p.name for p in _ROOT.iterdir()} - _ROOT_ENTRIES - {".pytest_cache", ".ruff_cache", ".benchmarks"})
    assert not new, f"left in the checkout: {new}"
