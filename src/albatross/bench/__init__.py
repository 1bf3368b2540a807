"""`albatross bench NAME`: one module per headline figure; each prints a table and writes JSON."""

from __future__ import annotations

import importlib.util

BENCHES = {
    "sandbox": "albatross.bench.sandbox",
    "trainer": "albatross.bench.trainer",
    "engine": "albatross.bench.engine",
    "harness": "albatross.bench.harness",
    "loop": "albatross.bench.loop",
    "packing": "albatross.bench.packing",
    "replay": "albatross.bench.replay",
    "recipe": "albatross.bench.recipe",
    "learn": "albatross.bench.learn",
    "gpu": "albatross.bench.gpu",
    "lora": "albatross.bench.lora",
}


def available() -> list[str]:
    """Benchmarks whose module exists in this installation."""
    out = []
    for name, mod in BENCHES.items():
        if importlib.util.find_spec(mod) is not None:
            out.append(name)
    return out
