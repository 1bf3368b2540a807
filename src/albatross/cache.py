"""Where albatross keeps what it builds once and reuses: warm-started models, adapted task environments,
engine venvs. ``$ALBATROSS_CACHE``, else ``~/.cache/albatross``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("ALBATROSS_CACHE", Path.home() / ".cache" / "albatross"))
