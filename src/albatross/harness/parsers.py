"""Action parsers: model text -> an ``Action``, or a ``FormatError`` whose message becomes the observation.

Two formats, chosen by ``harness.action_format`` (``auto``: tool calls when the model's chat template has a
``<tool_call>`` format, see ``chat.resolve_action_format``):

- ``bash_block``: exactly one fenced ```bash block; its content is run in the attempt's shell, and the
  block ``submit`` ends the attempt. For small models.
- ``tool_calls``: Qwen / Hermes style JSON tool calls inside the assistant turn::

      <tool_call>
      {"name": "read_file", "arguments": {"path": "main.py"}}
      </tool_call>

  exactly one per turn, checked against the tool's JSON schema (``tools.TOOLS``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

SUBMIT = "submit"
_BLOCK_RE = re.compile(r"```(?:bash|sh)?\n(.*?)\n?```", re.DOTALL)
_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_JSON_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,), "boolean": (bool,),
                                            "number": (int, float), "object": (dict,), "array": (list,)}


class FormatError(ValueError):
    """The model's action could not be parsed; the message is shown to the agent."""


@dataclass
class Action:
    """One parsed action: a tool name and its arguments (``bash`` takes ``command``)."""

    tool: str
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def command(self) -> str:
        """What ``Turn.command`` records: the shell command of ``bash``, else the call as JSON."""
        if self.tool == "bash":
            return str(self.args.get("command", ""))
        return json.dumps({"name": self.tool, "arguments": self.args}, sort_keys=True)


class Parser(Protocol):
    def parse(self, text: str) -> Action: ...


def write_command(command: str, tool_calls: bool) -> str:
    """A shell command written as a model action in either format (demonstrations, scripted policies); the
    command ``submit`` becomes the submit action. ``parse`` of the result gives the command back."""
    if not tool_calls:
        return f"```bash\n{command}\n```"
    call = {"name": SUBMIT, "arguments": {}} if command.strip() == SUBMIT else \
        {"name": "bash", "arguments": {"command": command}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def parse_bash_block(text: str) -> str:
    """Return the command of exactly one fenced bash block."""
    blocks: list[str] = _BLOCK_RE.findall(text)
    if not blocks:
        raise FormatError("Format error: write exactly one command in a ```bash block.")
    if len(blocks) > 1:
        raise FormatError(f"Format error: found {len(blocks)} ```bash blocks; write exactly one.")
    command = blocks[0].strip()
    if not command:
        raise FormatError("Format error: the ```bash block is empty.")
    return command


class BashBlockParser:
    """```bash blocks: the command runs in the shell; ``submit`` ends the attempt."""

    def parse(self, text: str) -> Action:
        command = parse_bash_block(text)
        if command.strip() == SUBMIT:
            return Action(SUBMIT)
        return Action("bash", {"command": command})


class ToolCallParser:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, validated against ``schemas``.

    ``schemas`` maps a tool name to its JSON schema of parameters (``{"properties": ..., "required": ...}``).
    """

    def __init__(self, schemas: dict[str, dict[str, Any]]) -> None:
        self.schemas = schemas

    def parse(self, text: str) -> Action:
        bodies = _CALL_RE.findall(text)
        if not bodies:
            if "<tool_call>" in text:
                raise FormatError("Format error: <tool_call> is not closed with </tool_call>.")
            raise FormatError(f"Format error: no tool call. Call exactly one tool as <tool_call>"
                              f'{{"name": ..., "arguments": {{...}}}}</tool_call>; tools: {self._names()}.')
        if len(bodies) > 1:
            raise FormatError(f"Format error: found {len(bodies)} tool calls; make exactly one per turn.")
        name, args = _decode_call(bodies[0])
        if name not in self.schemas:
            raise FormatError(f"Format error: unknown tool {name!r}; tools: {self._names()}.")
        check_arguments(name, args, self.schemas[name])
        return Action(name, args)

    def _names(self) -> str:
        return ", ".join(sorted(self.schemas))


def _decode_call(body: str) -> tuple[str, dict[str, Any]]:
    try:
        call = json.loads(body)
    except json.JSONDecodeError as e:
        raise FormatError(f"Format error: the tool call is not valid JSON ({e.msg} at line {e.lineno} "
                          f"column {e.colno}).") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise FormatError('Format error: a tool call is a JSON object {"name": "<tool>", "arguments": {...}}.')
    args = call.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise FormatError(f"Format error: the arguments string is not valid JSON ({e.msg}).") from None
    if not isinstance(args, dict):
        raise FormatError(f'Format error: "arguments" of {call["name"]!r} must be a JSON object.')
    return call["name"], args


def check_arguments(name: str, args: dict[str, Any], schema: dict[str, Any]) -> None:
    """Raise ``FormatError`` for a missing required, unknown or mistyped argument."""
    props: dict[str, Any] = schema.get("properties", {})
    missing = [p for p in schema.get("required", []) if p not in args]
    if missing:
        raise FormatError(f"Format error: {name} needs argument(s) {', '.join(missing)}.")
    unknown = [a for a in args if a not in props]
    if unknown:
        raise FormatError(f"Format error: {name} has no argument(s) {', '.join(unknown)}; it takes "
                          f"{', '.join(props) or 'none'}.")
    for key, value in args.items():
        want = props[key].get("type", "string")
        ok = isinstance(value, _JSON_TYPES.get(want, (object,)))
        if ok and want in ("integer", "number") and isinstance(value, bool):
            ok = False
        if not ok:
            raise FormatError(f"Format error: argument {key} of {name} must be a JSON {want}.")
