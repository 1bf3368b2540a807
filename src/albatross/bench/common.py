"""Shared output of benchmarks: an aligned table on stdout and a JSON file."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any


def machine() -> dict[str, Any]:
    import os

    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d")}


def print_table(title: str, rows: list[tuple[str, Any]]) -> None:
    width = max((len(k) for k, _ in rows), default=0)
    print(f"\n{title}\n" + "-" * (width + 16))
    for key, value in rows:
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        print(f"{key:<{width}}  {shown}")


def write_json(path: str | Path | None, data: dict[str, Any]) -> None:
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**data, "machine": machine()}, indent=2) + "\n")
    print(f"written: {path}")
