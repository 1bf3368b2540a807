"""Where albatross keeps what it builds once and reuses: warm-started models, adapted task environments,
engine venvs. ``$ALBATROSS_CACHE``, else ``~/.cache/albatross``. Two kinds are machine-wide whatever
``$ALBATROSS_CACHE`` says (a run's or a test's cache may be a fresh directory; rebuilding these would cost
minutes and gigabytes each time): engine venvs (``$ALBATROSS_ENGINES``) and sandbox base images with their
download caches (``$ALBATROSS_IMAGES``)."""

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


def images_root() -> Path:
    """Where sandbox base roots (``images/``, ``rootfs/``) and the builds' download caches (``build-cache/``)
    live: ``$ALBATROSS_IMAGES``, else ``~/.cache/albatross``. Content-addressed, so sharing them is safe."""
    return Path(os.environ.get("ALBATROSS_IMAGES", Path.home() / ".cache" / "albatross"))
