"""Tools the agent acts through, all over one primitive: ``Attempt.exec`` in the attempt's shell.

``Toolbox`` is set up once per attempt (one ``exec``): it creates ``$ALBATROSS_DIR`` (``/tmp/albatross``
in the sandbox), installs the ``job`` helper (``jobs.py``) on ``PATH`` and exports both. Then:

- ``bash``: the command runs in the persistent shell (the sandbox keeps cwd and exported variables;
  the toolbox also keeps shell functions, in ``$ALBATROSS_DIR/functions``). Its output goes to
  ``$ALBATROSS_DIR/out/<n>.log``; an output within ``max_observation_chars`` is shown whole, a longer
  one as head + tail + the number of bytes left out + the file's path (``redirect_output``). A timeout
  kills the command, never the session.
- ``job_*``: the ``job`` helper (background jobs with ids; they survive turns and die with the attempt).
- ``read_file`` / ``write_file`` / ``edit_file``: file contents cross as base64 through ``exec``
  (writes in chunks, so any size fits the argument limit); edits are exact string replacements. Bash-block
  models get the same from the ``edit`` helper (``edit view|create|replace``, ``edit_helper.py``), also installed
  on ``PATH``.
- ``repo_diff``: the ``git diff`` of the task's working directory at the end of an attempt (with the files it
  added), recorded on the trajectory.
- ``submit``: ends the attempt (handled by the agent loop).

A tool that cannot do what was asked raises ``ToolError``; its message is the observation.
"""

from __future__ import annotations

import base64
import json
import re
import secrets
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from albatross.config import default
from albatross.harness.edit_helper import HELP as EDIT_USAGE
from albatross.harness.jobs import JOB_SCRIPT, JOB_USAGE, job_command
from albatross.harness.parsers import SUBMIT, Action
from albatross.sandbox.base import Attempt, ExecResult, SandboxError

_WRITE_CHUNK = 48 * 1024  # raw bytes per exec: 64 KiB of base64, well under the 128 KiB argument limit
_KEEP_BYTES = 32 << 20  # an output file over this is cut to its first _KEEP_BYTES (frees the sandbox's /tmp)
_READ_LIMIT = 700 * 1024  # largest file edit_file reads (its base64 must fit the sandbox's output cap)
EDIT_SCRIPT = Path(__file__).with_name("edit_helper.py").read_text(encoding="utf-8")
EDIT_WRAPPER = """#!/bin/sh
command -v python3 >/dev/null 2>&1 || { echo "edit: needs python3, which this environment lacks; use sed -n, \\
sed -i and cat > FILE instead" >&2; exit 127; }
exec python3 -I "$(dirname "$0")/edit.py" "$@"
"""
_CONTROL_RE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1a\x1c-\x1f\x7f\ufffd]")


class ToolError(Exception):
    """A tool could not do what was asked; the message is shown to the agent."""


def _tool(name: str, description: str, params: dict[str, tuple[str, str]], required: list[str]
          ) -> dict[str, Any]:
    props = {k: {"type": t, "description": d} for k, (t, d) in params.items()}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": props, "required": required}}}


TOOLS: list[dict[str, Any]] = [
    _tool("bash", "Run a command in a persistent bash session (cwd, exported variables and functions "
          "persist). Long output is saved to a file; you see its head, tail and path.",
          {"command": ("string", "the bash command"),
           "timeout": ("integer", "seconds before the command is killed (default: the harness limit)")},
          ["command"]),
    _tool("job_start", "Start a command in the background; returns its job id.",
          {"command": ("string", "the bash command")}, ["command"]),
    _tool("job_list", "List background jobs with their state.", {}, []),
    _tool("job_log", "Show the last bytes of a background job's output so far.",
          {"job_id": ("integer", "job id"), "bytes": ("integer", "how many bytes (default 2000)")},
          ["job_id"]),
    _tool("job_wait", "Wait for a background job to end, up to a timeout; shows its state and log tail.",
          {"job_id": ("integer", "job id"), "timeout": ("integer", "seconds to wait (default 10)")},
          ["job_id"]),
    _tool("job_kill", "Kill a background job.", {"job_id": ("integer", "job id")}, ["job_id"]),
    _tool("read_file", "Read a text file with line numbers, optionally a range of lines.",
          {"path": ("string", "file path"), "start_line": ("integer", "first line (1-based)"),
           "end_line": ("integer", "last line (inclusive)")}, ["path"]),
    _tool("write_file", "Write a file (created with its directories, or overwritten).",
          {"path": ("string", "file path"), "content": ("string", "the whole new content")},
          ["path", "content"]),
    _tool("edit_file", "Replace an exact string in a file. It must occur exactly once unless "
          "replace_all is true.",
          {"path": ("string", "file path"), "old_string": ("string", "the exact text to replace"),
           "new_string": ("string", "the replacement"),
           "replace_all": ("boolean", "replace every occurrence")}, ["path", "old_string", "new_string"]),
    _tool(SUBMIT, "Finish: the task is done and will be checked.", {}, []),
]
TOOL_SCHEMAS: dict[str, dict[str, Any]] = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}

BASH_TOOLS_HINT = f"""\

Helpers in this shell: a command's output longer than the limit is saved to a file; you see its head, \
its tail and the path, so grep it. Background jobs:
{JOB_USAGE}
Files:
{EDIT_USAGE}"""


def truncate_middle(text: str, limit: int) -> str:
    """Keep the head and tail of ``text`` within ``limit`` characters, saying how much was cut."""
    if len(text) <= limit:
        return text
    half = max(1, (limit - 40) // 2)
    cut = len(text) - 2 * half
    return f"{text[:half]}\n[... {cut} characters cut ...]\n{text[-half:]}"


def looks_binary(text: str) -> bool:
    """Output with NUL bytes or many control / undecodable characters is not shown as text."""
    if "\x00" in text:
        return True
    return len(_CONTROL_RE.findall(text)) > max(2, len(text) // 20)


_LIMIT_NOTES = {
    "oom": "out of memory: the command was killed by the sandbox's memory limit",
    "pids": "too many processes: the sandbox's process limit was reached",
    "disk": "disk full: the sandbox's limit on bytes written was reached",
    "attempt_timeout": "the attempt's time limit was reached",
}


def status_suffix(exit_code: int, timed_out: bool, seconds: float, limit: str = "") -> str:
    """The exit status as the agent sees it; a sandbox limit (ExecResult.limit) is named."""
    if limit in _LIMIT_NOTES:
        return f"\n[{_LIMIT_NOTES[limit]}; exit code {exit_code}]\n"
    if timed_out:
        return f"\n[command timed out after {seconds:.0f}s and was killed]\n"
    if exit_code != 0:
        return f"[exit code {exit_code}]\n"
    return ""


def format_observation(result: ExecResult, limit: int) -> str:
    """What the agent sees after a plain command: its output cut to ``limit``, plus the exit status."""
    out = truncate_middle(result.output, limit)
    if result.truncated_bytes:
        out += f"\n[{result.truncated_bytes} more bytes of output were dropped]\n"
    return out + status_suffix(result.exit_code, result.timed_out, result.seconds, result.limit)


@dataclass
class Observation:
    """What a tool returns: the text shown to the agent and the shell facts of the command, if any."""

    text: str
    exit_code: int | None = None
    timed_out: bool = False
    seconds: float = 0.0


@dataclass
class _Rendered:
    """A command's output as read back from its file."""

    body: str  # the whole output, or its head
    tail: str = ""
    size: int = 0  # bytes of output
    path: str = ""  # set when the output is longer than the limit
    exit_code: int = 0


class Toolbox:
    """The tools of one attempt. ``limit``: the longest output shown whole (characters / bytes)."""

    def __init__(self, attempt: Attempt, limit: int, command_timeout_s: float,
                 redirect: bool = default("harness", "redirect_output")) -> None:
        self.attempt, self.limit, self.timeout_s, self.redirect = attempt, limit, command_timeout_s, redirect
        self.half = max(1, (limit - 120) // 2)  # bytes of head and of tail shown of a long output
        self.deadline: float | None = None  # time.monotonic() when the attempt's wall budget ends
        self.dir = ""
        self._n = 0

    # setup / teardown ---------------------------------------------------------------------------
    def setup(self) -> None:
        """Create the attempt's tool directory and install ``job`` and ``edit`` (one exec)."""
        script = (
            'd="${SANDBOX_ROOT:-}/tmp/albatross"\nmkdir -p "$d/bin" "$d/out" "$d/jobs" || exit 1\n'
            f"cat > \"$d/bin/job\" <<'ALBATROSS_JOB_EOF'\n{JOB_SCRIPT}ALBATROSS_JOB_EOF\n"
            f"cat > \"$d/bin/edit.py\" <<'ALBATROSS_EDIT_EOF'\n{EDIT_SCRIPT}ALBATROSS_EDIT_EOF\n"
            f"cat > \"$d/bin/edit\" <<'ALBATROSS_EDIT_EOF'\n{EDIT_WRAPPER}ALBATROSS_EDIT_EOF\n"
            'chmod +x "$d/bin/job" "$d/bin/edit"\nexport ALBATROSS_DIR="$d"\n'
            'case ":$PATH:" in *":$d/bin:"*) ;; *) export PATH="$d/bin:$PATH" ;; esac\nprintf %s "$d"'
        )
        result = self.attempt.exec(script, 30)
        if result.exit_code != 0 or not result.output.startswith("/"):
            raise SandboxError(f"harness setup failed: {result.output[-300:]!r}")
        self.dir = result.output.strip()

    def kill_jobs(self) -> None:
        """Kill every background job (for backends whose ``close`` does not kill them)."""
        self.attempt.exec(f"[ -d {self._q('jobs')} ] && {self._job('kill', 'all')} >/dev/null", 10)

    def _q(self, rel: str) -> str:
        return shlex.quote(f"{self.dir}/{rel}")

    def _job(self, sub: str, *args: str | int) -> str:
        return job_command(f"{self.dir}/bin/job", sub, *args)

    # dispatch -----------------------------------------------------------------------------------
    def call(self, action: Action) -> Observation:
        """Run one tool call; a ``ToolError`` becomes an observation that says what went wrong."""
        method = self._tools().get(action.tool)
        if method is None:
            return Observation(f"Error: unknown tool {action.tool!r}\n")
        try:
            return method(**action.args)
        except ToolError as e:
            return Observation(f"Error: {e}\n")

    def _tools(self) -> dict[str, Callable[..., Observation]]:
        """The tools by name (each takes the arguments of its schema in ``TOOLS``)."""
        return {"bash": self.tool_bash, "job_start": self.tool_job_start, "job_list": self.tool_job_list,
                "job_log": self.tool_job_log, "job_wait": self.tool_job_wait, "job_kill": self.tool_job_kill,
                "read_file": self.tool_read_file, "write_file": self.tool_write_file,
                "edit_file": self.tool_edit_file}

    def _exec(self, command: str, timeout_s: float | None = None) -> ExecResult:
        """Run a shell command with ``timeout_s`` (default: the command timeout), never past the deadline."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        if self.deadline is not None:
            limit = max(1.0, min(limit, self.deadline - time.monotonic()))
        return self.attempt.exec(command, limit)

    # bash ---------------------------------------------------------------------------------------
    def tool_bash(self, command: str, timeout: int | None = None) -> Observation:
        limit_s = float(timeout) if timeout is not None and timeout > 0 else None
        if not self.redirect:
            result = self._exec(self._wrap_plain(command), limit_s)
            text = format_observation(result, self.limit)
            return Observation(text, result.exit_code, result.timed_out, result.seconds)
        self._n += 1
        path = f"{self.dir}/out/{self._n}.log"
        nonce = secrets.token_hex(6)
        result = self._exec(self._wrap_redirect(command, path, nonce), limit_s)
        rendered = self._parse(result.output, nonce)
        if rendered is None:  # killed by its timeout, or `exit`, or a syntax error: render the file now
            rendered = self._render_file(path, result)
        else:
            result.exit_code = rendered.exit_code
        text = self._show(rendered) + status_suffix(result.exit_code, result.timed_out, result.seconds,
                                                    result.limit)
        return Observation(text, result.exit_code, result.timed_out, result.seconds)

    def _functions(self) -> tuple[str, str]:
        fns = self._q("functions")
        return f"source {fns} 2>/dev/null\n", f"declare -f > {fns} 2>/dev/null\n"

    def _wrap_plain(self, command: str) -> str:
        load, save = self._functions()
        return f"{load}{{ {command}\n}}\n__alb_rc=$?\n{save}exit $__alb_rc\n"

    def _wrap_redirect(self, command: str, path: str, nonce: str) -> str:
        load, save = self._functions()
        return (f"{load}{{ {command}\n}} > {shlex.quote(path)} 2>&1\n__alb_rc=$?\n{save}"
                f"{self._render_script(path, nonce)}exit $__alb_rc\n")

    def _render_script(self, path: str, nonce: str, rc: str = "$__alb_rc") -> str:
        """Print the output file whole (no process spawned) or as head + tail, then a trailer line.

        The file is read and measured in the C locale (bytes, not characters): in a UTF-8 locale bash's
        ``read -N`` stops early at an incomplete multibyte sequence followed by a NUL, so a long binary output
        read as a few characters and was shown whole, its size wrong and its file not kept. The session's
        ``LC_ALL`` is restored afterwards."""
        f, lim, half = shlex.quote(path), self.limit, self.half
        return (
            "__alb_lcs=${LC_ALL+x}; __alb_lc=${LC_ALL-}; LC_ALL=C\n"
            f"IFS= read -r -d '' -N {lim + 1} __alb_o < {f}\n"
            f"if [ ${{#__alb_o}} -le {lim} ]; then printf '%s' \"$__alb_o\"; __alb_n=${{#__alb_o}}; __alb_p=\n"
            f"else __alb_n=$(wc -c < {f}); __alb_p={f}; head -c {half} {f}; printf '\\n{nonce}|cut\\n'; "
            f"tail -c {half} {f}; [ $__alb_n -le {_KEEP_BYTES} ] || truncate -s {_KEEP_BYTES} {f}; fi\n"
            "if [ -n \"$__alb_lcs\" ]; then LC_ALL=$__alb_lc; else unset LC_ALL; fi\n"
            f"printf '\\n{nonce}|%s|%s|%s' \"{rc}\" \"$__alb_n\" \"$__alb_p\"\n"
        )

    @staticmethod
    def _parse(output: str, nonce: str) -> _Rendered | None:
        body, sep, trailer = output.rpartition(f"\n{nonce}|")
        if not sep:
            return None
        rc, size, path = (trailer.split("|", 2) + ["", ""])[:3]
        head, cut, tail = body.partition(f"\n{nonce}|cut\n")
        try:
            return _Rendered(head, tail if cut else "", int(size), path.strip(), int(rc))
        except ValueError:
            return None

    def _render_file(self, path: str, result: ExecResult) -> _Rendered:
        nonce = secrets.token_hex(6)
        again = self.attempt.exec(f"[ -f {shlex.quote(path)} ] || exit 0\n"
                                  + self._render_script(path, nonce, str(result.exit_code)), 30.0)
        rendered = self._parse(again.output, nonce)
        if rendered is None:  # no file: the shell never ran the command (e.g. a syntax error)
            return _Rendered(truncate_middle(result.output, self.limit), size=len(result.output))
        rendered.body = result.output + rendered.body if not rendered.path else rendered.body
        return rendered

    def _show(self, r: _Rendered) -> str:
        if looks_binary(r.body + r.tail):
            where = f"; saved to {r.path}" if r.path else ""
            return f"[binary output: {r.size} bytes{where}; inspect it with od -c or xxd]\n"
        if not r.path:
            return r.body
        head, tail = _whole_lines(r.body, r.tail)
        left = r.size - len(head.encode()) - len(tail.encode())
        saved = (f"the whole output ({r.size} bytes) is in {r.path}" if r.size <= _KEEP_BYTES else
                 f"its first {_KEEP_BYTES} bytes (of {r.size}) are in {r.path}")
        return f"{head}[... {left} bytes left out; {saved} (grep / sed -n it) ...]\n{tail}"

    # background jobs ----------------------------------------------------------------------------
    def _job_call(self, sub: str, *args: str | int, timeout_s: float | None = None) -> Observation:
        result = self._exec(self._job(sub, *args), timeout_s)
        text = truncate_middle(result.output, self.limit) or "\n"
        if result.exit_code != 0 and not result.timed_out:
            raise ToolError(text.strip())
        return Observation(text + status_suffix(0, result.timed_out, result.seconds), result.exit_code,
                           result.timed_out, result.seconds)

    def tool_job_start(self, command: str) -> Observation:
        return self._job_call("start", command)

    def tool_job_list(self) -> Observation:
        return self._job_call("list")

    def tool_job_log(self, job_id: int, bytes: int = 2000) -> Observation:
        return self._job_call("log", job_id, max(1, min(bytes, self.limit)))

    def tool_job_wait(self, job_id: int, timeout: int = 10) -> Observation:
        wait = max(0, timeout)
        if self.deadline is not None:
            wait = max(0, min(wait, int(self.deadline - time.monotonic()) - 2))
        return self._job_call("wait", job_id, wait, self.half, timeout_s=wait + 10.0)

    def tool_job_kill(self, job_id: int) -> Observation:
        return self._job_call("kill", job_id)

    # files --------------------------------------------------------------------------------------
    def tool_read_file(self, path: str, start_line: int = 1, end_line: int | None = None) -> Observation:
        q = shlex.quote(path)
        first = max(1, start_line)
        last = "$" if end_line is None else str(max(first, end_line))
        result = self._exec(f"{_require_file(path)}wc -l < {q}; sed -n '{first},{last}p' -- {q} | "
                            f"head -c {self.limit * 4}")
        if result.exit_code != 0:
            raise ToolError(result.output.strip() or f"cannot read {path}")
        total, _, text = result.output.partition("\n")
        shown = "".join(f"{first + i:6d}\t{line}\n" for i, line in enumerate(text.splitlines()))
        if looks_binary(shown):
            raise ToolError(f"{path} is a binary file")
        if len(shown) > self.limit:
            shown = shown[: self.limit].rsplit("\n", 1)[0] + "\n"
            last_shown = first + shown.count("\n") - 1
            shown += f"[... cut at line {last_shown} of {total.strip()}; read on with start_line]\n"
        return Observation(shown or f"[{path}: no lines in that range; it has {total.strip()} lines]\n")

    def tool_write_file(self, path: str, content: str) -> Observation:
        data = content.encode()
        self._write(path, data)
        return Observation(f"wrote {len(data)} bytes to {path}\n")

    def _write(self, path: str, data: bytes) -> None:
        tmp = self._q(f"out/write-{secrets.token_hex(4)}")
        chunks = [data[i:i + _WRITE_CHUNK] for i in range(0, len(data), _WRITE_CHUNK)] or [b""]
        for i, chunk in enumerate(chunks):
            b64 = shlex.quote(base64.b64encode(chunk).decode())
            result = self._exec(f"printf %s {b64} | base64 -d {'>' if i == 0 else '>>'} {tmp}")
            if result.exit_code != 0:
                raise ToolError(f"cannot write {path}: {result.output.strip()}")
        q = shlex.quote(path)
        result = self._exec(f'mkdir -p -- "$(dirname -- {q})" && cat {tmp} > {q}; rc=$?; rm -f {tmp}; exit $rc')
        if result.exit_code != 0:
            raise ToolError(f"cannot write {path}: {result.output.strip()}")

    def tool_edit_file(self, path: str, old_string: str, new_string: str, replace_all: bool = False
                       ) -> Observation:
        text = self._read_text(path)
        new_text, count = replace_exact(text, old_string, new_string, replace_all, path)
        self._write(path, new_text.encode())
        line = text[: text.index(old_string)].count("\n") + 1
        return Observation(f"edited {path}: replaced {count} occurrence{'s' if count > 1 else ''} "
                           f"(first at line {line})\n")

    def _read_text(self, path: str) -> str:
        q = shlex.quote(path)
        too_large = shlex.quote(f"{path} is too large to edit ({_READ_LIMIT} bytes at most); use sed")
        result = self._exec(f"{_require_file(path)}[ $(wc -c < {q}) -le {_READ_LIMIT} ] || "
                            f"{{ echo {too_large}; exit 4; }}\nbase64 -w0 -- {q}")
        if result.exit_code != 0:
            raise ToolError(result.output.strip() or f"cannot read {path}")
        if result.truncated_bytes:
            raise ToolError(f"{path} is too large to edit; use sed")
        try:
            return base64.b64decode(result.output).decode()
        except (ValueError, UnicodeDecodeError):
            raise ToolError(f"{path} is not a UTF-8 text file") from None


def _whole_lines(head: str, tail: str) -> tuple[str, str]:
    """Cut a partial last line off ``head`` and a partial first line off ``tail`` (when they have more)."""
    if "\n" in head.rstrip("\n"):
        head = head[: head.rindex("\n") + 1]
    elif not head.endswith("\n"):
        head += "\n"
    if "\n" in tail[:-1]:
        tail = tail[tail.index("\n") + 1:]
    return head, tail


def _require_file(path: str) -> str:
    """Shell lines that end the command with a clear message when ``path`` is not a regular file."""
    q = shlex.quote(path)
    return (f"[ -e {q} ] || {{ echo {shlex.quote(f'no such file: {path}')}; exit 3; }}\n"
            f"[ -f {q} ] || {{ echo {shlex.quote(f'not a regular file: {path}')}; exit 3; }}\n")


def replace_exact(text: str, old: str, new: str, replace_all: bool, path: str = "the file"
                  ) -> tuple[str, int]:
    """Replace ``old`` by ``new``: exactly one occurrence unless ``replace_all``; else ``ToolError``."""
    if not old:
        raise ToolError("old_string is empty; to write a whole file use write_file")
    count = text.count(old)
    if count == 0:
        raise ToolError(f"old_string not found in {path}; read the file and copy the text exactly, "
                        "including whitespace and indentation")
    if count > 1 and not replace_all:
        raise ToolError(f"old_string occurs {count} times in {path}; include more surrounding lines to "
                        "make it unique, or set replace_all")
    return text.replace(old, new), count


def describe_tools(tools: list[dict[str, Any]] = TOOLS) -> str:
    """Plain-text tool list for chat formats without a tool-aware template."""
    lines = ['Call exactly one tool per turn as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.',
             "Tools:"]
    for t in tools:
        f = t["function"]
        lines.append(f"- {f['name']}({', '.join(f['parameters']['properties'])}): {f['description']}")
    return "\n".join(lines)


def tool_call_text(name: str, **arguments: Any) -> str:
    """The text of a well-formed tool call (scripted policies and demonstrations write actions this way)."""
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


_DIFF_LIMIT = 200 * 1024
_DIFF = """cd -- "${SANDBOX_ROOT:-}"WORKDIR 2>/dev/null || exit 0
git rev-parse --is-inside-work-tree >/dev/null 2>&1 || exit 0
g() { git -c core.quotepath=off -c core.fsmonitor= -c diff.external= -c color.ui=false "$@"; }
{ if git rev-parse -q --verify HEAD >/dev/null 2>&1; then g diff --no-ext-diff HEAD --; else g diff --no-ext-diff; fi
  g ls-files --others --exclude-standard -z | while IFS= read -r -d '' f; do g diff --no-ext-diff --no-index -- /dev/null "$f"; done
} 2>/dev/null | head -c LIMIT
"""


def repo_diff(attempt: Attempt, workdir: str, limit: int = _DIFF_LIMIT) -> str:
    """``git diff`` of ``workdir`` against its last commit, plus the files added since (as diffs from nothing),
    when it is a git work tree; "" otherwise or when git fails. Run in a clean shell (nothing the agent exported),
    cut at ``limit`` bytes."""
    script = _DIFF.replace("LIMIT", str(limit)).replace("WORKDIR", shlex.quote(workdir))
    try:  # from "/": a working directory the agent removed is no error, just no diff
        result = attempt.exec_clean(script, "/", timeout_s=30.0)
    except SandboxError:
        return ""
    return result.output if result.exit_code == 0 and not result.timed_out else ""
