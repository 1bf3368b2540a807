"""docs/architecture.md is true to the tree: its layers are the imports' (down only), it names every package and
top-level module, and every file it names exists."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "albatross"
DOC = ROOT / "docs" / "architecture.md"
LAYERS = [  # top to bottom, as the document draws them
    {"cli"}, {"bench"}, {"pipeline"}, {"orchestrator", "eval"}, {"trainer", "harness"}, {"engine", "tasks", "rl"},
    {"models", "sandbox"}, {"records", "config", "cache", "devices", "progress"}, {"errors"},
]


def _imports() -> dict[str, set[str]]:
    """package (or top-level module) -> the albatross packages its code imports, anywhere in a file."""
    graph: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        part = path.relative_to(SRC).parts[0].removesuffix(".py")
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            for name in names:
                if name.startswith("albatross.") and name.split(".")[1] != part:
                    graph.setdefault(part, set()).add(name.split(".")[1])
    return graph


def test_imports_go_down_the_documented_layers() -> None:
    level = {name: i for i, layer in enumerate(LAYERS) for name in layer}
    assert set(level) == {p.name.removesuffix(".py") for p in SRC.iterdir()
                          if p.name != "__init__.py" and (p.suffix == ".py" or (p / "__init__.py").exists())}
    upward = [f"{a} -> {b}" for a, targets in _imports().items() for b in targets if level[b] <= level[a]]
    assert upward == []
    text = DOC.read_text()
    for layer in LAYERS:  # each layer is one line of the picture
        assert any(set(line.split()[: len(layer)]) == layer for line in text.splitlines()), layer


def test_every_package_is_named_and_every_named_file_exists() -> None:
    text = DOC.read_text()
    for layer in LAYERS:
        for name in layer:
            assert f"`{name}/`" in text or f"`{name}.py`" in text, name
    named = set(re.findall(r"`((?:[a-z_]+/)*[a-z_]+\.py)`", text))
    missing = [n for n in named if not list(SRC.rglob(n))]
    assert named and missing == []
