"""Bombs: a tiny compressed archive that expands to hundreds of MB (an ``ADD`` of a gzip bomb, an image
layer that is one) must not take albatross's own process with it: archives are streamed, never held
whole in memory, and their expansion is bounded. Each build or import runs in a child process whose
peak resident memory is measured."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from _probes import needs_local

from sandbox_util import task_env

EXPANDED = 256 << 20  # bytes of zeros inside each bomb
PEAK_MB = 300  # what a streamed build or import may take at most (python + albatross: ~80 MB)


def gzip_bomb(path: Path, name: str = "zeros.bin") -> Path:
    """A gzip-compressed tar holding one file of EXPANDED zero bytes (about 1 MB on disk)."""

    class Zeros:
        def __init__(self) -> None:
            self.left = EXPANDED

        def read(self, n: int = -1) -> bytes:
            n = self.left if n < 0 else min(n, self.left)
            self.left -= n
            return bytes(n)

    with gzip.open(path, "wb", compresslevel=1) as raw, tarfile.open(fileobj=raw, mode="w|") as tar:
        info = tarfile.TarInfo(name)
        info.size, info.mode = EXPANDED, 0o644
        tar.addfile(info, Zeros())  # type: ignore[arg-type]
    return path


def peak_mb(code: str, *args: str) -> tuple[int, str]:
    """Run ``code`` in a fresh python (argv: args); its peak RSS in MiB and its output."""
    script = code + "\nimport resource\nprint('peak_kb', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert "peak_kb" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]
    kb = int(proc.stdout.split("peak_kb")[-1].split()[0])
    return kb // 1024, proc.stdout + proc.stderr


@needs_local
def test_add_of_a_gzip_bomb_is_streamed(tmp_path: Path) -> None:
    env = task_env(tmp_path, "FROM python:3.11-slim-bookworm\nADD bomb.tar.gz /opt/\n")
    gzip_bomb(env / "bomb.tar.gz")
    code = ("import sys\nfrom albatross.sandbox import LocalBackend, EnvBuildError, Limits\n"
            "b = LocalBackend(warm=0, hide_paths=[sys.argv[2]], build_limits=Limits(memory_mb=1024, pids=512, "
            "disk_mb=64))\n"
            "try:\n    b.prepare(sys.argv[1]); print('built')\n"
            "except EnvBuildError as e:\n    print('refused:', e)\nfinally:\n    b.close()\n")
    peak, output = peak_mb(code, str(env), str(tmp_path))
    assert "Traceback" not in output, output[-3000:]
    assert peak < PEAK_MB, f"peak {peak} MiB building an ADD of a {EXPANDED >> 20} MiB bomb\n{output[-2000:]}"


def test_image_layer_bomb_is_streamed(tmp_path: Path) -> None:
    layer = gzip_bomb(tmp_path / "layer.tar.gz").read_bytes()
    layout = tmp_path / "img"
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def blob(data: bytes) -> dict[str, object]:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return {"digest": f"sha256:{digest}", "size": len(data)}

    config = blob(json.dumps({"config": {"Env": []}}).encode())
    manifest = blob(json.dumps({"schemaVersion": 2, "config": config, "layers": [blob(layer)]}).encode())
    manifest["annotations"] = {"org.opencontainers.image.ref.name": "bomb:1"}
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [manifest]}))
    code = ("import os, sys\nos.environ['ALBATROSS_IMAGES'] = sys.argv[2]\n"
            "from albatross.sandbox import images, EnvBuildError\n"
            "try:\n    images.import_image(sys.argv[1], 'bomb:1'); print('imported')\n"
            "except EnvBuildError as e:\n    print('refused:', e)\n")
    peak, output = peak_mb(code, str(layout), str(tmp_path / "cache"))
    assert "Traceback" not in output, output[-3000:]
    assert peak < PEAK_MB, f"peak {peak} MiB importing a {EXPANDED >> 20} MiB layer bomb\n{output[-2000:]}"
