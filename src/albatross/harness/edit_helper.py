"""The ``edit`` helper of the sandbox shell: view, replace and create files from a fenced bash block.

Installed into every attempt by ``Toolbox.setup`` (as ``$ALBATROSS_DIR/bin/edit``, run by the image's python3;
standard library only) so that bash-block models have what tool-call models get from ``read_file``,
``edit_file`` and ``write_file``, with the same rules and messages::

    edit view FILE [START [END]]        numbered lines, all or START..END
    edit create FILE <<'EOF'            write FILE from stdin (its directories are made; an existing file is
    ...                                 overwritten)
    EOF
    edit replace FILE [--all] <<'EOF'   replace exact text, given as one or more blocks:
    <<<<<<< SEARCH
    the exact text now in the file
    =======
    its replacement
    >>>>>>> REPLACE
    EOF

A SEARCH text must occur exactly once (``--all``: every occurrence is replaced); otherwise nothing is written and
the message says why. Exit codes: 0 done, 1 the edit cannot be made, 2 bad usage.
"""

from __future__ import annotations

import os
import re
import sys

HELP = """\
  edit view FILE [START [END]]       show FILE with line numbers (lines START..END)
  edit create FILE <<'EOF'           write FILE from the lines up to EOF
  edit replace FILE [--all] <<'EOF'  replace text; the input holds one or more blocks:
  <<<<<<< SEARCH
  exact text now in the file
  =======
  replacement
  >>>>>>> REPLACE"""
USAGE = "usage:\n" + HELP
_BLOCK = re.compile(r"^<<<<<<< SEARCH\n(.*?)^=======\n(.*?)^>>>>>>> REPLACE$", re.DOTALL | re.MULTILINE)
_MAX_BYTES = 4 << 20


class EditError(Exception):
    """The edit cannot be made; the message says why."""


def _read(path: str) -> str:
    if not os.path.exists(path):
        raise EditError(f"no such file: {path}")
    if not os.path.isfile(path):
        raise EditError(f"not a regular file: {path}")
    if os.path.getsize(path) > _MAX_BYTES:
        raise EditError(f"{path} is too large to edit ({_MAX_BYTES} bytes at most); use sed")
    try:
        with open(path, encoding="utf-8", newline="") as f:
            return f.read()
    except UnicodeDecodeError:
        raise EditError(f"{path} is not a UTF-8 text file") from None


def view(path: str, start: int = 1, end: int | None = None) -> str:
    lines = _read(path).splitlines()
    first = max(1, start)
    last = len(lines) if end is None else min(len(lines), max(first, end))
    if first > len(lines):
        return f"[{path}: no lines in that range; it has {len(lines)} lines]\n"
    return "".join(f"{n:6d}\t{lines[n - 1]}\n" for n in range(first, last + 1))


def blocks(text: str) -> list[tuple[str, str]]:
    """The (search, replace) pairs of the replace input."""
    found = [(m.group(1), m.group(2)) for m in _BLOCK.finditer(text if text.endswith("\n") else text + "\n")]
    if not found:
        raise EditError("no edit block: write <<<<<<< SEARCH, the exact text, =======, the replacement, "
                        ">>>>>>> REPLACE, each marker on a line of its own")
    return found


def replace(path: str, text: str, replace_all: bool = False) -> str:
    """Make every block's replacement (all or nothing); the message says what changed."""
    content = _read(path)
    notes = []
    for search, new in blocks(text):
        if not search:
            raise EditError("a SEARCH text is empty; to write a whole file use: edit create FILE")
        count = content.count(search)
        if count == 0:
            raise EditError(f"SEARCH text not found in {path}; view the file and copy the text exactly, including "
                            "whitespace and indentation")
        if count > 1 and not replace_all:
            raise EditError(f"SEARCH text occurs {count} times in {path}; include more surrounding lines to make it "
                            "unique, or use --all")
        line = content[: content.index(search)].count("\n") + 1
        content = content.replace(search, new)
        notes.append(f"replaced {count} occurrence{'s' if count > 1 else ''} (first at line {line})")
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(content)
    return f"edited {path}: " + "; ".join(notes) + "\n"


def create(path: str, text: str) -> str:
    directory = os.path.dirname(path)
    if directory:
        os.makedirs(directory, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write(text)
    return f"wrote {len(text.encode())} bytes to {path}\n"


def main(argv: list[str]) -> int:
    args = [a for a in argv if a != "--all"]
    if len(args) < 2 or args[0] not in ("view", "create", "replace"):
        print(USAGE, file=sys.stderr)
        return 2
    try:
        if args[0] == "view":
            numbers = [int(a) for a in args[2:4]]
            sys.stdout.write(view(args[1], *numbers))
        elif args[0] == "create":
            sys.stdout.write(create(args[1], sys.stdin.read()))
        else:
            sys.stdout.write(replace(args[1], sys.stdin.read(), "--all" in argv))
    except EditError as e:
        print(f"edit: {e}", file=sys.stderr)
        return 1
    except ValueError:
        print(USAGE, file=sys.stderr)
        return 2
    except OSError as e:
        print(f"edit: {e.strerror}: {e.filename}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
