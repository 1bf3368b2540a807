"""Sandboxes: a task's prepared environment (parent) and the isolated attempts forked from it.

``make_backend("local")`` is the isolated backend (namespaces + overlayfs + cgroups, needs root);
``make_backend("docker", engine="auto")`` makes each attempt a container of a Docker or Podman engine;
``make_backend("process")`` runs commands unisolated in a temporary directory (development only).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from albatross.sandbox.base import (
    LIMITS,
    Attempt,
    Backend,
    ExecResult,
    ForkError,
    Limits,
    SandboxDied,
    SandboxError,
)
from albatross.sandbox.build import EnvBuildError
from albatross.sandbox.docker import DockerBackend
from albatross.sandbox.dockerfile import DockerfileError, parse_dockerfile
from albatross.sandbox.local import LocalBackend, local_available, userns_available
from albatross.sandbox.process import ProcessBackend

if TYPE_CHECKING:
    from albatross.config import SandboxConfig

BACKENDS: dict[str, Callable[..., Backend]] = {"local": LocalBackend, "process": ProcessBackend, "docker": DockerBackend}

__all__ = [
    "LIMITS",
    "Attempt",
    "Backend",
    "DockerBackend",
    "DockerfileError",
    "EnvBuildError",
    "ExecResult",
    "ForkError",
    "Limits",
    "LocalBackend",
    "ProcessBackend",
    "SandboxDied",
    "SandboxError",
    "local_available",
    "make_backend",
    "parse_dockerfile",
    "userns_available",
]


def backend_from_config(sc: SandboxConfig, hide_paths: list[str] | None = None) -> Backend:
    """The backend a run's ``[sandbox]`` config section describes."""
    if sc.type == "local":
        return make_backend("local", hide_paths=hide_paths or [], base=sc.base, warm=sc.warm,
                            images_dir=sc.images or None, registries=sc.registries, layer_cache=sc.layer_cache,
                            build_min_free_mb=sc.build_min_free_mb, layer_cache_max_gb=sc.layer_cache_max_gb)
    if sc.type == "docker":
        return make_backend("docker", engine=sc.engine, images_dir=sc.images or None)
    return make_backend(sc.type, hide_paths=hide_paths or [])


def make_backend(kind: str, **kw: Any) -> Backend:
    """Create the sandbox backend named ``kind`` ("local", "docker" or "process") with its keyword options."""
    try:
        cls = BACKENDS[kind]
    except KeyError:
        raise ValueError(f"unknown sandbox backend {kind!r}; choose one of {sorted(BACKENDS)}") from None
    return cls(**kw)
