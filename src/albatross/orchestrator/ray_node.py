"""What a Ray actor of a run knows of its node: Ray itself (imported when a run asks for it), the node's id, the
directories below ``ray_files.node_root()`` where it writes what was shipped to it, and how loaded the node is."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from types import ModuleType

from albatross.orchestrator.ray_files import node_root


def ray_module() -> ModuleType:
    try:
        import ray
    except ImportError as e:
        raise RuntimeError("orchestrator.backend = 'ray' needs Ray: pip install 'albatross[ray]'") from e
    return ray


def node_id() -> str:
    return str(ray_module().get_runtime_context().get_node_id())


def node_dir(tag: str, part: str) -> Path:
    """``part``'s own directory for run ``tag`` on this node (emptied: a restarted actor starts clean)."""
    path = node_root() / node_id()[:12] / tag / part
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def models_dir() -> Path:
    return node_root() / "models"


def inside(root: Path, rel: str) -> Path:
    """``root / rel``, refusing a ``rel`` that leaves ``root``."""
    path = (root / rel).resolve()
    if not path.is_relative_to(root.resolve()):
        raise ValueError(f"{rel}: outside {root}")
    return path


def node_load() -> dict[str, float]:
    """This node's free cores (CPUs less the 1-minute load) and available memory in GiB."""
    cpus = len(os.sched_getaffinity(0))
    mem = 0.0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                mem = int(line.split()[1]) / 2**20
    except OSError:
        pass
    return {"free_cores": max(0.0, cpus - os.getloadavg()[0]), "mem_gib": mem}
