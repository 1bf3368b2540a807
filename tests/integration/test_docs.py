"""The docs' commands run as written: every `albatross ...` line of a ```bash block in README.md and docs/*.md parses
with the real command line; the blocks marked `<!-- docs-test: quick -->` run, in order per page, in a fresh
directory, as a user would paste them. And the docs speak to users: no file outside the repository, no issue
numbers."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from albatross.cli import build_parser, cmd_config, cmd_demo, cmd_train, split_overrides
from albatross.sandbox import local_available

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARK = "<!-- docs-test: quick -->"
QUICK_PAGES = ["first-task.md", "quickstart-docker.md", "own-agent.md"]


def _blocks(page: Path) -> list[tuple[bool, str]]:
    """(marked quick, body) of every fenced block that holds shell (```bash, ```sh, ```console or bare ```)."""
    out, lines, i = [], page.read_text().splitlines(), 0
    while i < len(lines):
        fence = re.match(r"^(`{3,})(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == fence.group(1)), len(lines))
        if fence.group(2) in ("", "bash", "sh", "console"):
            out.append((i > 0 and lines[i - 1].strip() == MARK, "\n".join(lines[i + 1:end]) + "\n"))
        i = end + 1
    return out


def _commands(body: str) -> list[str]:
    """The `albatross ...` command lines of a block (continuations joined, heredoc bodies skipped)."""
    lines, out, heredoc = body.replace("\\\n", " ").splitlines(), [], None
    for line in lines:
        if heredoc is not None:
            heredoc = None if line.strip() == heredoc else heredoc
            continue
        if m := re.search(r"<<'?(\w+)'?", line):
            heredoc = m.group(1)
        text = line.strip()
        synopsis = "..." in text or re.search(r"\[-", text)  # a usage line (placeholders, [--optional]), not a command
        if text.startswith("albatross ") and not synopsis:
            out.append(text)
    return out


def _documented_commands() -> list[tuple[str, str]]:
    return [(page.name, cmd) for page in PAGES for _quick, body in _blocks(page) for cmd in _commands(body)]


def test_the_docs_have_commands_and_quick_blocks():
    assert len(_documented_commands()) > 30
    for name in QUICK_PAGES:
        assert any(quick for quick, _ in _blocks(ROOT / "docs" / name)), name


@pytest.mark.parametrize("page, command", _documented_commands())
def test_every_documented_command_parses(page, command):
    argv = shlex.split(command, comments=True)[1:]
    argv, overrides = split_overrides(argv)
    try:
        args, extra = build_parser().parse_known_args(argv)
    except SystemExit as e:  # --help and --version exit 0; a bad flag exits 2
        assert e.code == 0, f"{page}: {command}"
        return
    takes_fields = args.fn in (cmd_demo, cmd_train, cmd_config) or hasattr(args, "set")
    assert not overrides or takes_fields, f"{page}: {command}: config fields on a command that takes none"
    assert not extra or args.fn in (cmd_demo, cmd_train, cmd_config), f"{page}: {command}: unknown {extra}"


OUTSIDE = re.compile(r"DESIGN\.md|\.\./shared|/work/|\b[Ii]ssue \d+|the seeds?'s? (?:families|figure)|86-task")


@pytest.mark.parametrize("page", [p for p in PAGES if p.name not in ("recipe.md", "sandbox.md", "gpu.md")],
                         ids=lambda p: p.name)
def test_the_docs_name_nothing_outside_the_repository(page):
    assert OUTSIDE.findall(page.read_text()) == []


@pytest.mark.skipif(not local_available(), reason="needs root, namespaces and overlayfs (the tasks' gates)")
@pytest.mark.parametrize("name", QUICK_PAGES)
def test_the_quick_commands_run_as_written(tmp_path, name):
    """Each page's quick blocks as one script in a fresh directory (the repository's examples/ and configs/ beside
    it, `albatross` and `python` of this interpreter first on PATH)."""
    for sub in ("examples", "configs"):
        (tmp_path / sub).symlink_to(ROOT / sub)
    script = "set -euo pipefail\n" + "\n".join(body for quick, body in _blocks(ROOT / "docs" / name) if quick)
    bin_dir = Path(sys.executable).parent
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONPATH": str(ROOT / "src")}
    r = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, f"{name}:\n{script}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}"
