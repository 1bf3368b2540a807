"""Parse a Dockerfile into instructions, with Docker's (BuildKit's) rules for what each one means.

Every instruction Terminal-Bench tasks use is understood:

- ``FROM [--platform=P] image [AS name]``, several of them (multi-stage builds; ``split_stages``);
- ``COPY``/``ADD`` with ``--from``, ``--chown``, ``--chmod`` and ``--link`` (the last changes nothing in the
  result), JSON form, heredocs (``COPY <<EOF /dest``); ADD sources that are URLs are kept (the build
  needs the network for them);
- ``RUN`` in shell form (run by the current ``SHELL``, default ``/bin/sh -c``), exec form and with
  heredocs (``RUN <<EOF``); ``--mount=type=cache`` and ``--network`` are accepted (a cache mount only
  speeds Docker up), other mounts are refused;
- ``WORKDIR``, ``ENV`` (``K=V ...`` and the legacy ``K V``), ``ARG`` (global ARGs before the first FROM
  are seen only by FROM lines and by a stage that declares them again, as in Docker; the platform
  ARGs ``TARGETARCH`` ... are predefined), ``USER``, ``SHELL`` (JSON form), ``CMD``/``ENTRYPOINT``;
- ``LABEL``, ``EXPOSE``, ``VOLUME``, ``HEALTHCHECK``, ``STOPSIGNAL``, ``ONBUILD`` and ``MAINTAINER`` are
  kept as :class:`Ignored` with a note (they change no file of the image).

Variables (``$V``, ``${V}``, ``${V:-x}``, ``${V-x}``, ``${V:+x}``, ``${V+x}``, ``${V:?msg}``) are expanded
as Docker does, with quotes and backslash escapes, in FROM, COPY/ADD, WORKDIR, ENV, ARG, USER and the
unquoted heredocs of COPY; the value of a variable the Dockerfile does not set comes from the base
image's environment (``image_env``; by default only ``PATH``). RUN commands are left to the shell.
Backslash continuations, comment lines, the ``# escape=`` directive and heredocs are handled; anything
else (an unknown instruction, no FROM, an instruction other than ARG before FROM, text that is not UTF-8)
raises :class:`DockerfileError` naming the file and line.
"""

from __future__ import annotations

import json
import platform
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DEFAULT_SHELL = ("/bin/sh", "-c")  # Docker's default SHELL on Linux


class DockerfileError(ValueError):
    """The Dockerfile is malformed or uses an instruction this parser does not support."""


@dataclass(frozen=True)
class From:
    line: int
    image: str  # the image reference, or the name of an earlier stage
    name: str | None = None  # ``AS name``, lower-cased as Docker does


@dataclass(frozen=True)
class Workdir:
    line: int
    path: str


@dataclass(frozen=True)
class Copy:
    line: int
    sources: tuple[str, ...]  # context paths (may be globs), stage paths with ``from_``, or ADD URLs
    dest: str
    keyword: str = "COPY"  # COPY or ADD (ADD extracts local tar archives and fetches URLs)
    from_: str | None = None  # --from: a stage name, a stage index or an image reference
    chown: str | None = None  # --chown=user[:group]
    chmod: int | None = None  # --chmod=octal
    inline: tuple[tuple[str, str], ...] = ()  # heredoc files (name, content), written before ``sources``


@dataclass(frozen=True)
class Run:
    line: int
    command: str | tuple[str, ...]  # shell form (a script for ``shell``) or exec form (argv)
    shell: tuple[str, ...] = DEFAULT_SHELL


@dataclass(frozen=True)
class Env:
    line: int
    pairs: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Arg:
    line: int
    name: str
    default: str | None  # the value the build uses (the expanded default, or the global ARG's value)


@dataclass(frozen=True)
class User:
    line: int
    user: str  # "name", "uid", "name:group" or "uid:gid", resolved in the image's /etc/passwd


@dataclass(frozen=True)
class Command:
    line: int
    keyword: str  # CMD or ENTRYPOINT
    argv: tuple[str, ...]  # the shell form is stored as [*SHELL, text], as Docker stores it


@dataclass(frozen=True)
class Ignored:
    line: int
    keyword: str
    text: str
    note: str


Instruction = From | Workdir | Copy | Run | Env | Arg | User | Command | Ignored

_IGNORED_NOTES = {
    "LABEL": "metadata only",
    "MAINTAINER": "metadata only",
    "EXPOSE": "attempts have loopback networking only",
    "VOLUME": "attempts keep every path in their own layer; no volume is mounted",
    "HEALTHCHECK": "the agent drives the attempt; nothing polls it",
    "STOPSIGNAL": "attempts are stopped by killing their pid namespace",
    "ONBUILD": "a trigger for images built FROM this one; it changes nothing here",
}
_HEREDOC_KEYWORDS = ("RUN", "COPY", "ADD")
_HEREDOC = re.compile(r"^(\d*)<<(-?)([^<].*)$")
_STAGE_NAME = re.compile(r"^[a-z][a-z0-9._-]*$")
URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://|^git@")


@dataclass(frozen=True)
class Stage:
    """One stage of a (multi-stage) Dockerfile, as ``split_stages`` cuts it."""

    index: int
    name: str | None
    base: str  # the FROM reference: an image, or an earlier stage's name
    instructions: list[Instruction]  # starting with the stage's From
    base_stage: int | None = None  # index of the earlier stage named by FROM, if any
    copies_from: tuple[str, ...] = field(default=())  # the --from references of its COPY/ADD

    def ref_keys(self) -> tuple[str, ...]:
        """The ``--from`` values that name this stage: its index and its name."""
        return (str(self.index),) + ((self.name,) if self.name else ())


def split_stages(instructions: list[Instruction]) -> list[Stage]:
    """The stages of a parsed Dockerfile, in order. The ARGs before the first FROM belong to no stage
    (the parser has already used them in FROM lines and in stages that declare them again)."""
    stages: list[Stage] = []
    names: dict[str, int] = {}
    current: list[Instruction] | None = None
    for ins in instructions:
        if isinstance(ins, From):
            current = [ins]
            base_stage = names.get(ins.image.lower())
            stages.append(Stage(len(stages), ins.name, ins.image, current, base_stage))
            if ins.name:
                names[ins.name] = len(stages) - 1
        elif current is not None:
            current.append(ins)
    return [
        Stage(s.index, s.name, s.base, s.instructions, s.base_stage,
              tuple(i.from_ for i in s.instructions if isinstance(i, Copy) and i.from_ is not None))
        for s in stages
    ]


def required_stages(stages: list[Stage]) -> list[int]:
    """Indexes of the stages the last stage needs (itself included, through FROM and COPY --from),
    in build order; a --from that names no stage is an image reference and needs none."""
    keys = {k: s.index for s in stages for k in s.ref_keys()}
    needed: set[int] = set()

    def visit(index: int) -> None:
        if index in needed:
            return
        needed.add(index)
        stage = stages[index]
        deps = [stage.base_stage] + [keys.get(ref.lower()) for ref in stage.copies_from]
        for dep in deps:
            if dep is not None and dep < index:
                visit(dep)

    if stages:
        visit(len(stages) - 1)
    return sorted(needed)


def platform_args() -> dict[str, str]:
    """Docker's predefined platform ARGs for this machine (TARGETARCH, BUILDPLATFORM, ...)."""
    machine = platform.machine().lower()
    arch = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "ppc64le": "ppc64le",
            "s390x": "s390x"}.get(machine, machine)
    values = {"PLATFORM": f"linux/{arch}", "OS": "linux", "ARCH": arch, "VARIANT": ""}
    return {f"{side}{k}": v for side in ("TARGET", "BUILD") for k, v in values.items()}


def default_image_env(image: str) -> dict[str, str]:
    """The environment assumed for a base image when the caller knows no better: Docker's PATH."""
    return {"PATH": DEFAULT_PATH}


def parse_dockerfile(
    path: Path | str, image_env: Callable[[str], dict[str, str]] | None = None
) -> list[Instruction]:
    """Parse ``path`` into instructions, raising :class:`DockerfileError` ("FILE:LINE: why").

    ``image_env(image)``: the environment of a FROM image, used to expand variables the Dockerfile
    does not set (``ENV PATH=/opt/bin:$PATH``); default :func:`default_image_env`."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise DockerfileError(f"{path}: cannot read: {err}") from err
    parser = _Parser(path, image_env or default_image_env)
    for logical in _logical_lines(text, parser):
        parser.add(logical)
    if not parser.seen_from:
        raise parser.error(1, "no FROM instruction: a Dockerfile starts FROM a base image")
    return parser.instructions


# ------------------------------------------------------------------------------------------ lines


@dataclass
class Heredoc:
    name: str
    body: str  # the lines between the marker line and the terminator, each ending in "\n"
    raw: str  # body and terminator line exactly as written (handed to the shell for RUN)
    expand: bool  # the delimiter was not quoted


@dataclass
class _Logical:
    line: int
    keyword: str
    rest: str
    heredocs: list[Heredoc]


def _directive_escape(rows: list[str]) -> str:
    """The ``# escape=`` parser directive (backslash unless changed), read from the leading comments."""
    for row in rows:
        match = re.match(r"^\s*#\s*([a-zA-Z]+)\s*=\s*(\S+)\s*$", row)
        if not match:
            break
        if match.group(1).lower() == "escape" and match.group(2) in ("\\", "`"):
            return match.group(2)
    return "\\"


def _logical_lines(text: str, parser: _Parser) -> list[_Logical]:
    """Join continuations, drop comment lines, read heredoc bodies; (first line number, KEYWORD, rest)."""
    rows = text.splitlines()
    escape = _directive_escape(rows)
    out: list[_Logical] = []
    parts: list[str] = []
    start, i = 0, 0
    while i < len(rows):
        raw, number = rows[i], i + 1
        i += 1
        stripped = raw.strip()
        if stripped.startswith("#") or (parts and not stripped):
            continue  # comment lines (also inside a continuation) and blank continuation lines
        if not parts:
            if not stripped:
                continue
            start = number
        body = raw.rstrip()
        if body.endswith(escape):
            parts.append(body[:-1])
            continue
        parts.append(body)
        logical = _split_keyword(start, "".join(parts).strip())
        parts = []
        if logical.keyword in _HEREDOC_KEYWORDS:
            i = _read_heredocs(logical, rows, i, parser)
        out.append(logical)
    if parts:
        out.append(_split_keyword(start, "".join(parts).strip()))
    return out


def _split_keyword(line: int, text: str) -> _Logical:
    keyword, _, rest = text.partition(" ")
    return _Logical(line, keyword.upper(), rest.strip(), [])


def _read_heredocs(logical: _Logical, rows: list[str], i: int, parser: _Parser) -> int:
    """Read the bodies of the heredocs the instruction opens (BuildKit: words ``<<[-]NAME``, a quoted
    ``"a <<b"`` or ``$((1<<2))`` being no such word)."""
    for word in _split_raw(logical.rest)[0]:
        match = _HEREDOC.match(word)
        if not match:
            continue
        strip_tabs, spec = match.group(2) == "-", match.group(3)
        name = spec.strip("'\"")
        if not name:
            raise parser.error(logical.line, f"heredoc {word!r} has no delimiter")
        lines: list[str] = []
        while True:
            if i >= len(rows):
                raise parser.error(logical.line, f"heredoc {name} is not terminated (no line {name!r})")
            row = rows[i]
            i += 1
            if (row.lstrip("\t") if strip_tabs else row) == name:
                raw = "".join(f"{r}\n" for r in lines) + row
                break
            lines.append(row)
        body = "".join(f"{r.lstrip(chr(9)) if strip_tabs else r}\n" for r in lines)
        logical.heredocs.append(Heredoc(name, body, raw, expand=spec == name))
    return i


# ------------------------------------------------------------------------------------- expansion


class _LexError(ValueError):
    pass


Lookup = Callable[[str], "str | None"]


def expand_words(text: str, lookup: Lookup) -> list[str]:
    """Split ``text`` into words as Docker does: quotes group and are removed, backslash escapes,
    variables are expanded (an unquoted expansion to nothing makes no word)."""
    return _process(text, lookup, split=True)


def expand_word(text: str, lookup: Lookup) -> str:
    """``text`` as one word: quotes removed, backslash escapes and variables expanded."""
    words = _process(text, lookup, split=False)
    return words[0] if words else ""


def expand_vars(text: str, lookup: Lookup) -> str:
    """Only the variables of ``text`` expanded (quotes kept): an unquoted COPY heredoc's body."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("\\$", i):
            out.append("$")
            i += 2
        elif text[i] == "$":
            value, i = _dollar(text, i, lookup)
            out.append(value)
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def _process(text: str, lookup: Lookup, split: bool) -> list[str]:
    words: list[str] = []
    cur: list[str] = []
    started = False
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if split and c.isspace():
            if started:
                words.append("".join(cur))
            cur, started, i = [], False, i + 1
        elif c == "'":
            end = text.find("'", i + 1)
            if end < 0:
                raise _LexError("unclosed single quote")
            cur.append(text[i + 1 : end])
            started, i = True, end + 1
        elif c == '"':
            i = _double_quoted(text, i + 1, lookup, cur)
            started = True
        elif c == "\\":
            cur.append(text[i + 1 : i + 2])
            started, i = True, i + 2
        elif c == "$":
            value, i = _dollar(text, i, lookup)
            cur.append(value)
            started = started or bool(value)
        else:
            cur.append(c)
            started, i = True, i + 1
    if started:
        words.append("".join(cur))
    return words


def _double_quoted(text: str, i: int, lookup: Lookup, cur: list[str]) -> int:
    while i < len(text):
        c = text[i]
        if c == '"':
            return i + 1
        if c == "\\" and text[i + 1 : i + 2] in ('"', "$", "\\"):
            cur.append(text[i + 1])
            i += 2
        elif c == "$":
            value, i = _dollar(text, i, lookup)
            cur.append(value)
        else:
            cur.append(c)
            i += 1
    raise _LexError("unclosed double quote")


def _dollar(text: str, i: int, lookup: Lookup) -> tuple[str, int]:
    """Expand the ``$...`` at ``text[i]``; returns (value, index after it)."""
    if text[i + 1 : i + 2] == "{":
        return _braced(text, i + 2, lookup)
    match = re.compile(r"[A-Za-z_][A-Za-z0-9_]*").match(text, i + 1)
    if not match:
        return "$", i + 1
    return lookup(match.group()) or "", match.end()


def _braced(text: str, i: int, lookup: Lookup) -> tuple[str, int]:
    match = re.compile(r"[A-Za-z_][A-Za-z0-9_]*").match(text, i)
    if not match:
        raise _LexError(f"bad substitution at {text[i - 2:i + 10]!r}")
    name, i = match.group(), match.end()
    depth, j = 1, i
    while j < len(text) and depth:
        if text.startswith("${", j):
            depth, j = depth + 1, j + 2
            continue
        depth -= text[j] == "}"
        j += 1
    if depth:
        raise _LexError(f"missing '}}' after ${{{name}")
    modifier = text[i : j - 1]
    value = lookup(name)
    if not modifier:
        return value or "", j
    op = re.match(r":?[-+?]", modifier)
    if not op:
        raise _LexError(f"unsupported substitution ${{{name}{modifier}}}")
    word = expand_word(modifier[op.end():], lookup)
    colon, kind = op.group().startswith(":"), op.group()[-1]
    present = bool(value) if colon else value is not None
    if kind == "-":
        return (value or "") if present else word, j
    if kind == "+":
        return word if present else "", j
    if not present:
        raise _LexError(f"{name}: {word or 'parameter not set'}")
    return value or "", j


# ---------------------------------------------------------------------------------------- parser


class _Parser:
    def __init__(self, path: Path, image_env: Callable[[str], dict[str, str]]) -> None:
        self.path = path
        self.image_env = image_env
        self.instructions: list[Instruction] = []
        self.seen_from = False
        self.global_scope = True  # expanding with the global ARGs (before the first FROM, and in FROM lines)
        self.global_args: dict[str, str | None] = dict(platform_args())
        self.stage_names: dict[str, tuple[dict[str, str], tuple[str, ...]]] = {}  # name -> (env, shell)
        self.stage_env: dict[str, str] = {}
        self.stage_args: dict[str, str | None] = {}
        self.shell: tuple[str, ...] = DEFAULT_SHELL
        self.line = 0

    def error(self, line: int, why: str) -> DockerfileError:
        return DockerfileError(f"{self.path}:{line}: {why}")

    def lookup(self, name: str) -> str | None:
        if self.global_scope:
            return self.global_args.get(name)
        if name in self.stage_env:
            return self.stage_env[name]
        return self.stage_args.get(name)

    def words(self, text: str) -> list[str]:
        try:
            return expand_words(text, self.lookup)
        except _LexError as err:
            raise self.error(self.line, f"cannot split arguments: {err}") from err

    def word(self, text: str) -> str:
        try:
            return expand_word(text, self.lookup)
        except _LexError as err:
            raise self.error(self.line, f"cannot expand {text!r}: {err}") from err

    def add(self, logical: _Logical) -> None:
        line, keyword, rest = logical.line, logical.keyword, logical.rest
        self.line = line
        handler = {
            "FROM": self.from_, "WORKDIR": self.workdir, "COPY": self.copy, "ADD": self.copy, "RUN": self.run,
            "ENV": self.env, "ARG": self.arg, "USER": self.user, "SHELL": self.shell_, "CMD": self.command,
            "ENTRYPOINT": self.command,
        }.get(keyword)
        if not self.seen_from and keyword not in ("ARG", "FROM"):
            raise self.error(line, f"{keyword} before FROM: only ARG may come before the FROM instruction")
        if handler is not None:
            handler(line, keyword, rest, logical.heredocs)
        elif keyword in _IGNORED_NOTES:
            self.instructions.append(Ignored(line, keyword, rest, _IGNORED_NOTES[keyword]))
        else:
            raise self.error(line, f"unsupported instruction {keyword}")

    def from_(self, line: int, keyword: str, rest: str, heredocs: list[Heredoc]) -> None:
        self.global_scope = True  # FROM lines see the global ARGs only
        words = [w for w in self.words(rest) if not w.startswith("--platform")]
        if not words:
            raise self.error(line, "FROM needs an image")
        name = None
        if len(words) == 3 and words[1].upper() == "AS":
            name = words[2].lower()
            if not _STAGE_NAME.match(name):
                raise self.error(line, f"FROM ... AS {words[2]}: a stage name starts with a letter and "
                                 "has only letters, digits, '.', '_' and '-'")
            if name in self.stage_names:
                raise self.error(line, f"stage name {name} is used twice")
        elif len(words) != 1:
            raise self.error(line, f"FROM expects 'image [AS name]', got {rest!r}")
        image = words[0]
        env, shell = self.stage_names.get(image.lower()) or (dict(self.image_env(image)), DEFAULT_SHELL)
        self.stage_env, self.stage_args, self.shell = dict(env), {}, shell
        self.seen_from, self.global_scope = True, False
        self.instructions.append(From(line, image, name))
        if name:
            self.stage_names[name] = (self.stage_env, self.shell)

    def _remember_stage(self) -> None:
        """Keep the named current stage's env and shell for a later ``FROM <name>``."""
        current = next((i for i in reversed(self.instructions) if isinstance(i, From)), None)
        if current is not None and current.name:
            self.stage_names[current.name] = (dict(self.stage_env), self.shell)

    def workdir(self, line: int, keyword: str, rest: str, heredocs: list[Heredoc]) -> None:
        path = self.word(rest)
        if not path:
            raise self.error(line, "WORKDIR needs a path")
        self.instructions.append(Workdir(line, path))

    def copy(self, line: int, keyword: str, rest: str, heredocs: list[Heredoc]) -> None:
        flags, rest = _leading_flags(rest)
        options: dict[str, str] = {}
        for flag, value in flags:
            allowed = ("--from", "--chown", "--chmod", "--link") + (("--checksum",) if keyword == "ADD" else ())
            if flag not in allowed:
                raise self.error(line, f"unsupported {keyword} flag {flag}")
            options[flag] = self.word(value)
        argv = _json_list(rest)
        words = [self.word(w) for w in argv] if argv is not None else self.words(rest)
        if len(words) < 2:
            raise self.error(line, f"{keyword} needs at least one source and a destination")
        inline, sources = self._inline_sources(words[:-1], heredocs)
        chmod = options.get("--chmod")
        if chmod is not None and not re.fullmatch(r"[0-7]{3,4}", chmod):
            raise self.error(line, f"{keyword} --chmod={chmod}: only octal modes are supported")
        if options.get("--from") and (inline or any(URL.match(s) for s in sources)):
            raise self.error(line, f"{keyword} --from copies paths of a stage or image, not URLs or heredocs")
        if keyword == "COPY" and any(URL.match(s) for s in sources):
            raise self.error(line, "COPY cannot copy a URL (ADD can)")
        self.instructions.append(Copy(line, tuple(sources), words[-1], keyword, options.get("--from") or None,
                                      options.get("--chown") or None, int(chmod, 8) if chmod else None,
                                      tuple(inline)))

    def _inline_sources(self, words: list[str], heredocs: list[Heredoc]) -> tuple[list[tuple[str, str]], list[str]]:
        by_name = {h.name: h for h in heredocs}
        inline, sources = [], []
        for word in words:
            match = _HEREDOC.match(word)
            doc = by_name.get(match.group(3).strip("'\"")) if match else None
            if doc is None:
                sources.append(word)
                continue
            body = doc.body
            if doc.expand:
                try:
                    body = expand_vars(body, self.lookup)
                except _LexError as err:
                    raise self.error(self.line, f"heredoc {doc.name}: {err}") from err
            inline.append((doc.name, body))
        return inline, sources

    def run(self, line: int, keyword: str, rest: str, heredocs: list[Heredoc]) -> None:
        flags, rest = _leading_flags(rest)
        for flag, value in flags:
            if flag == "--network" and value in ("default", "none", "host"):
                continue
            if flag == "--mount" and "type=cache" in value.split(","):
                continue  # a cache mount only speeds Docker's rebuilds up
            raise self.error(line, f"unsupported RUN flag {flag}={value}")
        if not rest:
            raise self.error(line, "RUN needs a command")
        if heredocs:
            self.instructions.append(Run(line, _heredoc_script(rest, heredocs), self.shell))
            return
        argv = _json_list(rest)
        self.instructions.append(Run(line, tuple(argv) if argv else rest, self.shell))

    def env(self, line: int, keyword: str, rest: str, heredocs: list[Heredoc]) -> None:
        first = rest.split(None, 1)
        if not first:
            raise self.error(line, "ENV needs a name and a value")
        if "=" not in first[0]:
            if len(first) < 2:
                raise self.error(line, f"ENV {first[0]} needs a value")
            pairs = [(first[0], self.word(first[1].strip()))]
        else:
            pairs = []
            for word in _raw_words(rest, self, line):  # all see the ENVs before this line, as in Docker
                name, eq, value = word.partition("=")
                if not eq or not name:
                    raise self.error(line, f"ENV expects NAME=VALUE, got {word!r}")
                pairs.append((name, self.word(value)))
        self.stage_env.update(pairs)
        self._remember_stage()
        self.instructions.append(Env(line, tuple(pairs)))

    def arg(self, line: int, keyword: str, rest: str, heredocs: list[Heredoc]) -> None:
        words = _raw_words(rest, self, line)
        if not words:
            raise self.error(line, "ARG needs a name")
        for word in words:
            name, eq, value = word.partition("=")
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise self.error(line, f"ARG {name!r}: not a variable name")
            default = self.word(value) if eq else None
            if not self.seen_from:
                self.global_args[name] = default
            else:
                if default is None:
                    default = self.global_args.get(name)
                self.stage_args[name] = default
            self.instructions.append(Arg(line, name, default))

    def user(self, line: int, keyword: str, rest: str, heredocs: list[Heredoc]) -> None:
        user = self.word(rest)
        if not user:
            raise self.error(line, "USER needs a user")
        self.instructions.append(User(line, user))

    def shell_(self, line: int, keyword: str, rest: str, heredocs: list[Heredoc]) -> None:
        argv = _json_list(rest)
        if not argv:
            raise self.error(line, 'SHELL takes the JSON form, e.g. SHELL ["/bin/bash", "-c"]')
        self.shell = tuple(argv)
        self._remember_stage()

    def command(self, line: int, keyword: str, rest: str, heredocs: list[Heredoc]) -> None:
        argv = _json_list(rest)
        self.instructions.append(Command(line, keyword, tuple(argv) if argv is not None
                                         else ((*self.shell, rest) if rest else ())))


def _heredoc_script(rest: str, heredocs: list[Heredoc]) -> str:
    """The shell script a RUN with heredocs runs, as BuildKit builds it: a RUN that is only a heredoc
    runs its body (a ``#!`` body as an executable file); otherwise the shell gets the command line
    followed by the heredocs and their terminators."""
    words = rest.split()
    if len(words) == 1 and len(heredocs) == 1 and _HEREDOC.match(words[0]):
        body = heredocs[0].body
        if not body.startswith("#!"):
            return body
        fence = "ALBATROSS_HEREDOC_END"
        return (f'f=$(mktemp) && cat > "$f" <<\'{fence}\'\n{body}{fence}\n'
                'chmod +x "$f" && "$f"; rc=$?; rm -f "$f"; exit $rc')
    return rest + "\n" + "\n".join(h.raw for h in heredocs)


def _leading_flags(rest: str) -> tuple[list[tuple[str, str]], str]:
    """Split ``--flag=value`` words off the front of an instruction's arguments."""
    flags: list[tuple[str, str]] = []
    while rest.startswith("--"):
        word, _, rest = rest.partition(" ")
        flag, _, value = word.partition("=")
        flags.append((flag, value))
        rest = rest.lstrip()
    return flags, rest


def _raw_words(text: str, parser: _Parser, line: int) -> list[str]:
    """Words split at unquoted blanks, quotes and variables left for a later ``parser.word``."""
    words, quote = _split_raw(text)
    if quote:
        raise parser.error(line, f"cannot split arguments: unclosed {quote} quote")
    return words


def _split_raw(text: str) -> tuple[list[str], str]:
    """(words split at unquoted blanks with their quotes kept, the quote left open or "")."""
    words, cur, quote, i = [], [], "", 0
    while i < len(text):
        c = text[i]
        if quote:
            cur.append(c)
            if c == "\\" and quote == '"' and i + 1 < len(text):
                cur.append(text[i + 1])
                i += 1
            elif c == quote:
                quote = ""
        elif c.isspace():
            if cur:
                words.append("".join(cur))
            cur = []
        else:
            cur.append(c)
            if c in "'\"":
                quote = c
            elif c == "\\" and i + 1 < len(text):
                cur.append(text[i + 1])
                i += 1
        i += 1
    if cur:
        words.append("".join(cur))
    return words, quote


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
