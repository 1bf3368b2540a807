"""Parse the subset of the Dockerfile language that task environments use.

Supported: ``FROM`` (one stage; the image is recorded, the sandbox maps it to its own base root),
``WORKDIR``, ``COPY``/``ADD`` of local files (``--chown``/``--chmod``/``--link`` ignored), ``RUN``
(shell form and JSON exec form), ``ENV`` (``K=V K2=V2`` and ``K V``), ``ARG`` with defaults, comments
and backslash line continuations. ``CMD``, ``ENTRYPOINT``, ``LABEL``, ``EXPOSE``, ``USER``,
``MAINTAINER`` and ``STOPSIGNAL`` are kept as :class:`Ignored` with a note. Everything else (``VOLUME``,
``HEALTHCHECK``, ``SHELL``, ``ONBUILD``, multi-stage builds, ``COPY --from``, ``ADD`` of a URL, heredocs,
a bare ``ARG``, no ``FROM``, an instruction other than ``ARG`` before ``FROM``, a file that is not UTF-8
text) raises :class:`DockerfileError` naming the file and line.
Which ``FROM`` images the sandbox can stand in for is decided by its callers (``tasks.offline``).

``$VAR``, ``${VAR}``, ``${VAR:-default}`` and ``${VAR:+alt}`` are substituted from ``ARG`` defaults
and ``ENV`` values in ``FROM``, ``WORKDIR``, ``COPY``/``ADD``, ``ENV`` and ``ARG``, as Docker does;
``RUN`` commands are left to the shell (ARGs and ENVs are in its environment).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path


class DockerfileError(ValueError):
    """The Dockerfile is malformed or uses an instruction this parser does not support."""


@dataclass(frozen=True)
class From:
    line: int
    image: str


@dataclass(frozen=True)
class Workdir:
    line: int
    path: str


@dataclass(frozen=True)
class Copy:
    line: int
    sources: tuple[str, ...]  # relative to the environment directory; may contain glob patterns
    dest: str
    keyword: str = "COPY"  # COPY or ADD (ADD of a local archive is copied, not extracted)


@dataclass(frozen=True)
class Run:
    line: int
    command: str | tuple[str, ...]  # shell form (run with bash -c) or exec form (argv)


@dataclass(frozen=True)
class Env:
    line: int
    pairs: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Arg:
    line: int
    name: str
    default: str | None


@dataclass(frozen=True)
class Ignored:
    line: int
    keyword: str
    text: str
    note: str


Instruction = From | Workdir | Copy | Run | Env | Arg | Ignored

_IGNORED_NOTES = {
    "CMD": "the agent drives the shell; no default command",
    "ENTRYPOINT": "the agent drives the shell; no entrypoint",
    "LABEL": "metadata only",
    "EXPOSE": "attempts have loopback networking only",
    "USER": "commands run as root inside the sandbox",
    "MAINTAINER": "metadata only",
    "STOPSIGNAL": "attempts are stopped by killing their pid namespace",
}
_VAR = re.compile(
    r"\$(?:\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::(?P<op>[-+])(?P<word>[^}]*))?\}|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))"
)


def parse_dockerfile(path: Path | str) -> list[Instruction]:
    """Parse ``path`` into instructions, raising :class:`DockerfileError` ("FILE:LINE: why")."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise DockerfileError(f"{path}: cannot read: {err}") from err
    parser = _Parser(path)
    for line_no, keyword, rest in _logical_lines(text):
        parser.add(line_no, keyword, rest)
    if not parser.seen_from:
        raise parser.error(1, "no FROM instruction: a Dockerfile starts FROM a base image")
    return parser.instructions


def _logical_lines(text: str) -> list[tuple[int, str, str]]:
    """Join continuations and drop comments; yield (first line number, KEYWORD, arguments)."""
    out: list[tuple[int, str, str]] = []
    parts: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if stripped.startswith("#") or (parts and not stripped):
            continue  # comment lines (also inside a continuation) and blank continuation lines
        if not parts:
            if not stripped:
                continue
            start = number
        body = raw.rstrip()
        if body.endswith("\\"):
            parts.append(body[:-1])
            continue
        parts.append(body)
        logical = "".join(parts).strip()
        parts = []
        keyword, _, rest = logical.partition(" ")
        out.append((start, keyword.upper(), rest.strip()))
    if parts:
        logical = "".join(parts).strip()
        keyword, _, rest = logical.partition(" ")
        out.append((start, keyword.upper(), rest.strip()))
    return out


class _Parser:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.instructions: list[Instruction] = []
        self.vars: dict[str, str] = {}
        self.seen_from = False

    def error(self, line: int, why: str) -> DockerfileError:
        return DockerfileError(f"{self.path}:{line}: {why}")

    def sub(self, text: str) -> str:
        def one(match: re.Match[str]) -> str:
            name = match.group("name") or match.group("bare")
            value = self.vars.get(name, "")
            if match.group("op") == "-":
                return value or match.group("word")
            if match.group("op") == "+":
                return match.group("word") if value else ""
            return value

        return _VAR.sub(one, text)

    def add(self, line: int, keyword: str, rest: str) -> None:
        handler = {
            "FROM": self.from_,
            "WORKDIR": self.workdir,
            "COPY": self.copy,
            "ADD": self.copy,
            "RUN": self.run,
            "ENV": self.env,
            "ARG": self.arg,
        }.get(keyword)
        if not self.seen_from and keyword not in ("ARG", "FROM"):
            raise self.error(line, f"{keyword} before FROM: only ARG may come before the FROM instruction")
        if handler is not None:
            handler(line, keyword, rest)
        elif keyword in _IGNORED_NOTES:
            self.instructions.append(Ignored(line, keyword, rest, _IGNORED_NOTES[keyword]))
        else:
            raise self.error(line, f"unsupported instruction {keyword}")

    def from_(self, line: int, keyword: str, rest: str) -> None:
        if self.seen_from:
            raise self.error(line, "unsupported instruction FROM (multi-stage builds)")
        words = [w for w in rest.split() if not w.startswith("--platform")]
        if not words:
            raise self.error(line, "FROM needs an image")
        self.seen_from = True
        self.instructions.append(From(line, self.sub(words[0])))

    def workdir(self, line: int, keyword: str, rest: str) -> None:
        if not rest:
            raise self.error(line, "WORKDIR needs a path")
        self.instructions.append(Workdir(line, self.sub(rest)))

    def copy(self, line: int, keyword: str, rest: str) -> None:
        words = _json_list(rest) or shlex.split(rest)
        args = []
        for word in words:
            flag = word.split("=", 1)[0]
            if flag == "--from":
                raise self.error(line, f"unsupported instruction {keyword} --from (multi-stage builds)")
            if flag in ("--chown", "--chmod", "--link"):
                continue  # ownership and mode are not modelled; files keep the host's
            if word.startswith("--"):
                raise self.error(line, f"unsupported {keyword} flag {flag}")
            args.append(self.sub(word))
        if len(args) < 2:
            raise self.error(line, f"{keyword} needs at least one source and a destination")
        if any(re.match(r"^[a-z]+://", s) for s in args[:-1]):
            raise self.error(line, f"unsupported instruction {keyword} from a URL")
        self.instructions.append(Copy(line, tuple(args[:-1]), args[-1], keyword))

    def run(self, line: int, keyword: str, rest: str) -> None:
        if not rest:
            raise self.error(line, "RUN needs a command")
        if rest.startswith("<<"):
            raise self.error(line, "unsupported instruction RUN with a heredoc")
        if rest.startswith("--"):
            raise self.error(line, f"unsupported RUN flag {rest.split()[0]}")
        argv = _json_list(rest)
        self.instructions.append(Run(line, tuple(argv) if argv else rest))

    def env(self, line: int, keyword: str, rest: str) -> None:
        first = rest.split(None, 1)
        if not first:
            raise self.error(line, "ENV needs a name and a value")
        if "=" not in first[0]:
            if len(first) < 2:
                raise self.error(line, f"ENV {first[0]} needs a value")
            pairs = [(first[0], self.sub(first[1].strip()))]
        else:
            pairs = []
            for word in _split(rest, line, self):
                name, eq, value = word.partition("=")
                if not eq or not name:
                    raise self.error(line, f"ENV expects NAME=VALUE, got {word!r}")
                pairs.append((name, self.sub(value)))
        self.vars.update(pairs)
        self.instructions.append(Env(line, tuple(pairs)))

    def arg(self, line: int, keyword: str, rest: str) -> None:
        words = _split(rest, line, self)
        if not words:
            raise self.error(line, "ARG needs a name")
        for word in words:
            name, eq, value = word.partition("=")
            default = self.sub(value) if eq else None
            if name not in self.vars or default is not None:
                self.vars[name] = default or ""
            self.instructions.append(Arg(line, name, default))


def _split(text: str, line: int, parser: _Parser) -> list[str]:
    try:
        return shlex.split(text)
    except ValueError as err:
        raise parser.error(line, f"cannot split arguments: {err}") from err


def _json_list(text: str) -> list[str] | None:
    """The exec (JSON array of strings) form, or None when ``text`` is not one (shell form)."""
    if not text.startswith("["):
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return value
    return None
