"""Where albatross keeps what it builds once and reuses: warm-started models, adapted task environments,
engine venvs. ``$ALBATROSS_CACHE``, else ``~/.cache/albatross``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("ALBATROSS_CACHE", Path.home() / ".cache" / "albatross"))


def engines_root() -> Path:
    """Where ``albatross engines install`` puts the engines' venvs (several GB, installed once per machine):
    ``$ALBATROSS_ENGINES``, else ``~/.cache/albatross``, whatever ``$ALBATROSS_CACHE`` says (a run's cache may
    be a fresh directory; its engines are not)."""
    return Path(os.environ.get("ALBATROSS_ENGINES", Path.home() / ".cache" / "albatross"))
