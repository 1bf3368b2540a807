"""Weight sync over the filesystem: the trainer exports versioned safetensors with an atomic LATEST
marker; engines load a version when the orchestrator tells them to."""

from __future__ import annotations

from pathlib import Path


def version_dir(weights_root: str | Path, version: int) -> Path:
    return Path(weights_root) / f"v{version:06d}"


def read_latest(weights_root: str | Path) -> int | None:
    path = Path(weights_root) / "LATEST"
    try:
        return int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
