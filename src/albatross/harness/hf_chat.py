"""Chat format of a transformers tokenizer, rendered from its own chat template, token-in/token-out.

The first prompt is the template's rendering of ``[system?, user]`` (with the tool list when JSON tool calls
are on). After that the harness never renders the conversation again: an observation is the template's
*delta* for one more message (found by rendering a fixed probe conversation with and without it) appended to
the exact ids the engine produced (DESIGN.md, token-in/token-out).

Whether that concatenation is what the template itself renders for the whole conversation is checked once per
format (``append_only``, ``template_drift``), on a probe conversation with ``<think>`` blocks:

- **append-only** templates (ChatML, Llama-3 headers, Gemma turns, Qwen3 with tool results as ``tool``
  messages) render the same text; the harness keeps one sample per attempt.
- **history-rewriting** templates (Qwen3 with observations as ``user`` messages drops earlier ``<think>``
  blocks) render earlier turns differently once a later message exists. The agent then re-renders the
  conversation before every turn and starts a new sample (``conversation``), as context compression does.

Documented exceptions that are not drift: the ids of the concatenation may differ from tokenising the whole
rendering where a BPE merge would cross a message boundary (e.g. a prompt ending in ``\n\n``), and where a
model's completion is not in the template's canonical form (trailing whitespace that a ``trim`` removes, a
``<think>`` block without the newlines a template adds): the harness keeps the ids the engine saw, which is
what the model was conditioned on.

``check_chat_template`` is the start-up check of a model directory's template (one-line ``ValueError``).
``CHATML_TOOLS_TEMPLATE`` is a Qwen2.5 / Hermes-style ChatML template for tokenizers that ship without one.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

CHATML_TOOLS_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_PROBE = [{"role": "user", "content": "PING"}, {"role": "assistant", "content": "PONG"}]
_THINK_RE = re.compile(r"^.*</think>\n*", re.DOTALL)
# two turns with reasoning and observations: the append-only probe
_DRIFT_PROBE = [("<think>\nplan one\n</think>\n\nCALL ONE", "out one\n"),
                ("<think>\nplan two\n</think>\n\nCALL TWO", "out two\n")]


def strip_reasoning(text: str) -> str:
    """``text`` without its ``<think>...</think>`` block (and the newlines after it)."""
    return _THINK_RE.sub("", text, count=1) if "</think>" in text else text


class HFChatFormat:
    """A ``ChatFormat`` over a transformers tokenizer (``observation_role``: ``tool`` or ``user``)."""

    def __init__(self, tokenizer: Any, system: str = "", observation_role: str = "tool",
                 template: str | None = None) -> None:
        from albatross.engine.tokenizer import stop_token_id, turn_end

        self.tokenizer, self.system, self.observation_role = tokenizer, system, observation_role
        # a transformers tokenizer's chat_template is unset (None) or missing when the directory ships none
        self.template = template or getattr(tokenizer, "chat_template", None) or CHATML_TOOLS_TEMPLATE
        self._turn_end = turn_end(tokenizer, self.template)  # what follows an assistant message
        stop = stop_token_id(tokenizer, self.template)
        if stop is None:
            raise ValueError(f"chat template: an assistant turn ends with {self._turn_end!r}, which does not "
                             "start with a special token to stop on")
        self._stop_id = stop
        stop_text = tokenizer.decode([stop])
        self._after_stop = self._turn_end[len(stop_text):] if self._turn_end.startswith(stop_text) else ""
        self._drift: dict[str, str | None] = {}
        self._renders_tools: bool | None = None

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                generation: bool = False) -> str:
        text: str = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                       chat_template=self.template, add_generation_prompt=generation)
        return text

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    @property
    def stop_ids(self) -> list[int]:
        eos = self.tokenizer.eos_token_id
        return [self._stop_id] + ([eos] if eos is not None and eos != self._stop_id else [])

    @property
    def supports_tool_calls(self) -> bool:
        """The template has a ``<tool_call>`` format and the tokenizer a ``<tool_call>`` token (Qwen, Hermes)."""
        return "<tool_call>" in self.template and len(self._encode("<tool_call>")) == 1

    @property
    def renders_tools(self) -> bool:
        """The template writes a tool list when given ``tools``; if not, the first prompt lists them in the
        user message (``describe_tools``)."""
        if self._renders_tools is None:
            probe = [{"role": "user", "content": "PING"}]
            tool = [{"type": "function", "function": {"name": "probe_tool", "description": "d", "parameters": {
                "type": "object", "properties": {}, "required": []}}}]
            self._renders_tools = "probe_tool" in self._render(probe, tool)
        return self._renders_tools

    @property
    def append_only(self) -> bool:
        """Rendering a whole conversation gives the text of the harness's concatenation (``template_drift``)."""
        return self.template_drift() is None

    def template_drift(self) -> str | None:
        """None when the template renders the probe conversation (two turns with reasoning and observations) as
        the concatenation of the first prompt, the actions and the observation deltas; else where and how the
        two texts first differ. Cached per observation role."""
        if self.observation_role not in self._drift:
            self._drift[self.observation_role] = self._find_drift(_DRIFT_PROBE)
        return self._drift[self.observation_role]

    def _find_drift(self, turns: list[tuple[str, str]]) -> str | None:
        pieces = [("the first prompt", self.initial_prompt("Count the lines"))]
        for i, (action, obs) in enumerate(turns, 1):
            pieces += [(f"action {i}", self.action(action)), (f"observation {i}", self.observation(obs))]
        full = self._render(self._messages("Count the lines", None, turns), generation=True)
        done = ""
        for name, ids in pieces:
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            if not full.startswith(done + text):
                at = first_difference(done + text, full)
                return (f"{name} differs from the template's rendering at character {at}: the concatenation has "
                        f"{(done + text)[at:at + 40]!r}, the template {full[at:at + 40]!r}")
            done += text
        return None if done == full else f"the template renders more text: {full[len(done):][:40]!r}"

    def _messages(self, instruction: str, tools: list[dict[str, Any]] | None,
                  turns: list[tuple[str, str]]) -> list[dict[str, Any]]:
        messages = ([{"role": "system", "content": self.system}] if self.system else [])
        text = instruction.strip()
        if tools and not self.renders_tools:
            from albatross.harness.tools import describe_tools

            text += "\n\n" + describe_tools(tools)
        messages.append({"role": "user", "content": text})
        for action, obs in turns:
            messages += [{"role": "assistant", "content": action}, {"role": self.observation_role, "content": obs}]
        return messages

    def initial_prompt(self, instruction: str, tools: list[dict[str, Any]] | None = None) -> list[int]:
        return self._encode(self._render(self._messages(instruction, tools, []), tools, generation=True))

    def conversation(self, instruction: str, tools: list[dict[str, Any]] | None,
                     turns: list[tuple[str, str]]) -> list[int]:
        """The template's rendering of the whole conversation so far (actions and observations as texts), ending
        where the model writes its next action: the context of a new sample for history-rewriting templates."""
        return self._encode(self._render(self._messages(instruction, tools, turns), tools, generation=True))

    def _delta(self, message: dict[str, Any], closed: bool) -> list[int]:
        text = self._render([*_PROBE, message], generation=True)
        end = text.find("PONG" + self._turn_end)
        if end < 0:
            raise ValueError(f"chat template: after a {message['role']!r} message, an earlier assistant message no "
                             f"longer renders as its content followed by {self._turn_end!r}")
        rest = text[end + len("PONG") + len(self._turn_end):]
        return self._encode((self._after_stop if closed else self._turn_end) + rest)

    def observation(self, text: str, closed: bool = True) -> list[int]:
        return self._delta({"role": self.observation_role, "content": text}, closed)

    def user(self, text: str, closed: bool = True) -> list[int]:
        return self._delta({"role": "user", "content": text}, closed)

    def action(self, text: str) -> list[int]:
        return self._encode(text) + [self._stop_id]

    def decode(self, ids: list[int]) -> str:
        ids = list(ids)
        while ids and ids[-1] in self.stop_ids:
            ids.pop()
        text: str = self.tokenizer.decode(ids, skip_special_tokens=False)
        return text


def check_chat_template(tokenizer: Any, model_dir: str | Path, observation_role: str | None = None) -> None:
    """Raise ``ValueError`` with a one-line message naming ``model_dir`` when its tokenizer cannot drive the
    harness: no chat template, no special token ending an assistant turn, a template whose deltas cannot be
    taken, or a tokenizer that does not give back its own template's text. A history-rewriting template passes
    (the harness starts a new sample per turn); ``observation_role`` defaults to what ``action_format = "auto"``
    picks."""
    where = str(model_dir)
    if not getattr(tokenizer, "chat_template", None):  # a transformers tokenizer: unset or missing
        raise ValueError(f"{where}: the tokenizer has no chat template (chat_template.jinja or tokenizer_config.json "
                         "chat_template)")
    try:
        fmt = HFChatFormat(tokenizer)
        fmt.observation_role = observation_role or ("tool" if fmt.supports_tool_calls else "user")
        fmt.template_drift()  # takes every kind of delta; drift itself is handled (a new sample per turn)
        full = fmt._render(fmt._messages("Count the lines in a.txt", None, _DRIFT_PROBE), generation=True)
    except Exception as e:  # a template error is the user's model directory, not a crash
        raise ValueError(f"{where}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
    back = tokenizer.decode(fmt._encode(full), skip_special_tokens=False)
    if back != full:
        at = first_difference(back, full)
        raise ValueError(f"{where}: the tokenizer does not round-trip its chat template's text (at character {at}: "
                         f"{full[at:at + 30]!r} comes back as {back[at:at + 30]!r})")


def first_difference(a: str, b: str) -> int:
    """The first index where ``a`` and ``b`` differ (the shorter length when one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                   "<tool_response>", "</tool_response>"]


def toy_chatml_tokenizer(corpus: list[str], vocab_size: int = 800) -> Any:
    """A small byte-level BPE ``PreTrainedTokenizerFast`` trained on ``corpus``, with Qwen's ChatML
    special tokens and ``CHATML_TOOLS_TEMPLATE``: a stand-in for a Qwen tokenizer where no model hub is
    reachable (tests, benchmarks). Deterministic for a given corpus."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=CHATML_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    out = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # transformers' tokenizer __init__ is untyped
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=CHATML_SPECIALS[3:])
    out.chat_template = CHATML_TOOLS_TEMPLATE
    return out
