import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory) -> Path:
    """One cache of warm-started demo models shared by the tests that run the quick demo."""
    path = os.environ.get("ALBATROSS_TEST_CACHE")
    return Path(path) if path else tmp_path_factory.mktemp("albatross-cache")
