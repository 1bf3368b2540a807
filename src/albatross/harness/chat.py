"""Tokenizers and chat formats, token-in/token-out.

The harness never re-renders history: the first prompt is rendered once, then every turn appends the
engine's exact completion ids and the tokenised *delta* of the next observation (DESIGN.md, Contracts).

``TinyTokenizer`` is the demo's small-vocabulary tokenizer: whole words from the task corpus (with and
without a leading space) as single tokens, every other character as UTF-8 byte tokens, so any text
round-trips and copying a file name is a one-token copy for a tiny model. ``TinyTokenizer.save`` writes it as
an ordinary transformers tokenizer (``engine.tokenizer.tiny_hf_tokenizer``: same ids, its layout as the chat
template) next to the legacy word list, so ``HFChatFormat`` over the loaded tokenizer gives the same ids as
``TinyChatFormat``.

``make_chat_format`` resolves ``harness.action_format = "auto"`` once: JSON tool calls when the model's template
has a tool-call format (``HFChatFormat.supports_tool_calls``), fenced bash blocks otherwise.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from albatross.config import HarnessConfig
from albatross.engine.tokenizer import LEGACY_TINY, SPECIALS, SYMBOLS, WORD_PATTERN, tiny_vocab

_WORD_RE = re.compile(WORD_PATTERN)


class Tokenizer(Protocol):
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class TinyTokenizer:
    """Word-level tokens for a known corpus, byte fallback for everything else."""

    def __init__(self, words: list[str]) -> None:
        self.words = sorted(set(words))
        self.vocab: list[str] = tiny_vocab(self.words)
        self._byte0 = len(SPECIALS)
        self._ids = {tok: i for i, tok in enumerate(self.vocab)}
        self._symbols = sorted(SYMBOLS, key=len, reverse=True)
        self.vocab_size = len(self.vocab)
        self.eos_id = self._ids["<|eos|>"]
        self.pad_id = self._ids["<|pad|>"]

    @classmethod
    def from_corpus(cls, texts: Iterable[str], min_count: int = 1) -> TinyTokenizer:
        counts: dict[str, int] = {}
        for text in texts:
            for m in _WORD_RE.findall(text):
                for w in (m.lstrip(" "), " " + m.lstrip(" ")):
                    counts[w] = counts.get(w, 0) + 1
        return cls([w for w, c in counts.items() if c >= min_count])

    def special(self, name: str) -> int:
        return self._ids[name]

    def _encode_bytes(self, text: str) -> list[int]:
        return [self._byte0 + b for b in text.encode("utf-8")]

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        i = 0
        while i < len(text):
            sym = next((s for s in self._symbols if text.startswith(s, i)), None)
            if sym is not None:
                ids.append(self._ids[sym])
                i += len(sym)
                continue
            m = _WORD_RE.match(text, i)
            if m and m.group(0) in self._ids:
                ids.append(self._ids[m.group(0)])
                i = m.end()
                continue
            if m:  # unknown word: bytes
                ids.extend(self._encode_bytes(m.group(0)))
                i = m.end()
                continue
            ids.extend(self._encode_bytes(text[i]))
            i += 1
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        out: list[str] = []
        pending = bytearray()
        for i in ids:
            if self._byte0 <= i < self._byte0 + 256:
                pending.append(i - self._byte0)
                continue
            if pending:
                out.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
            tok = self.vocab[i] if 0 <= i < self.vocab_size else ""
            out.append("" if tok in SPECIALS else tok)
        if pending:
            out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def save(self, directory: str | Path) -> None:
        """Write the transformers tokenizer files (``tiny_hf_tokenizer``) and the legacy word list."""
        from albatross.engine.tokenizer import tiny_hf_tokenizer

        tiny_hf_tokenizer(self.words).save_pretrained(str(directory))
        (Path(directory) / LEGACY_TINY).write_text(json.dumps({"type": "tiny", "words": self.words}))

    @classmethod
    def load(cls, directory: str | Path) -> TinyTokenizer:
        data = json.loads((Path(directory) / LEGACY_TINY).read_text())
        return cls(data["words"])


class ChatFormat(Protocol):
    """How a conversation becomes token ids, append-only (the harness never re-renders history).

    ``initial_prompt`` ends where the model writes its first action; ``observation`` and ``user`` are the
    ids appended after a completion (``closed``: the completion ended with a stop token) that end where
    the model writes its next action; ``action`` is the ids of a model action (demonstrations, scripted
    policies). ``supports_tool_calls``: the layout has a JSON tool-call format (``action_format = "auto"``
    picks it). ``append_only``: rendering a whole conversation gives the concatenation the harness builds;
    when False the agent starts each turn from ``conversation``, the whole conversation re-rendered."""

    tokenizer: Any

    @property
    def stop_ids(self) -> list[int]: ...

    @property
    def supports_tool_calls(self) -> bool: ...

    @property
    def append_only(self) -> bool: ...

    def conversation(self, instruction: str, tools: list[dict[str, Any]] | None,
                     turns: list[tuple[str, str]]) -> list[int]: ...

    def initial_prompt(self, instruction: str, tools: list[dict[str, Any]] | None = None) -> list[int]: ...

    def observation(self, text: str, closed: bool = True) -> list[int]: ...

    def user(self, text: str, closed: bool = True) -> list[int]: ...

    def action(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass
class TinyChatFormat:
    """Prompt layout of the demo model.

    ``<|user|> instruction <|assistant|>`` then the model writes an action ending in ``<|end|>``; each
    observation is appended as ``<|obs|> text <|assistant|>``. The layout has no separator that an
    unclosed completion would need, so ``closed`` changes nothing; a user message is laid out like an
    observation. With ``tools`` (JSON tool calls) the first prompt lists them after the instruction.
    """

    tokenizer: TinyTokenizer

    @property
    def stop_ids(self) -> list[int]:
        return [self.tokenizer.special("<|end|>"), self.tokenizer.eos_id]

    @property
    def supports_tool_calls(self) -> bool:
        return False  # the demo model writes fenced bash blocks

    @property
    def append_only(self) -> bool:
        return True  # the layout never rewrites history

    def conversation(self, instruction: str, tools: list[dict[str, Any]] | None,
                     turns: list[tuple[str, str]]) -> list[int]:
        """The conversation so far (actions and observations as texts), ending where the next action starts."""
        ids = self.initial_prompt(instruction, tools)
        for action, obs in turns:
            ids += self.action(action) + self.observation(obs)
        return ids

    def initial_prompt(self, instruction: str, tools: list[dict[str, Any]] | None = None) -> list[int]:
        from albatross.harness.tools import describe_tools

        t = self.tokenizer
        text = instruction.strip() + ("\n\n" + describe_tools(tools) if tools else "")
        return [t.special("<|user|>")] + t.encode(text) + [t.special("<|assistant|>")]

    def observation(self, text: str, closed: bool = True) -> list[int]:
        t = self.tokenizer
        return [t.special("<|obs|>")] + t.encode(text) + [t.special("<|assistant|>")]

    def user(self, text: str, closed: bool = True) -> list[int]:
        return self.observation(text, closed)

    def action(self, text: str) -> list[int]:
        """Token ids of a model action (used for demonstrations and scripted policies)."""
        return self.tokenizer.encode(text) + [self.tokenizer.special("<|end|>")]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


def make_chat_format(tokenizer: Any, harness_cfg: HarnessConfig) -> ChatFormat:
    """The demo's ``TinyChatFormat`` for a ``TinyTokenizer``; otherwise the tokenizer's own chat template
    (``hf_chat.HFChatFormat``), with observations as ``tool`` messages when actions are JSON tool calls
    (``resolve_action_format``) and as ``user`` messages otherwise."""
    system = harness_cfg.system_prompt
    if isinstance(tokenizer, TinyTokenizer):
        if system:
            from albatross.errors import UserError

            raise UserError("harness.system_prompt: the demo's tiny chat format has no system role; set it for a "
                            "model with a chat template (model.path)")
        return TinyChatFormat(tokenizer)
    from albatross.harness.hf_chat import HFChatFormat

    fmt = HFChatFormat(tokenizer, system=system, observation_role="user")
    if resolve_action_format(harness_cfg, fmt) == "tool_calls":
        fmt.observation_role = "tool"
    return fmt


def resolve_action_format(harness_cfg: HarnessConfig, fmt: ChatFormat) -> str:
    """``harness.action_format``, with ``auto`` resolved: ``tool_calls`` when the chat template has a tool-call
    format (``supports_tool_calls``), else ``bash_block``."""
    if harness_cfg.action_format != "auto":
        return harness_cfg.action_format
    return "tool_calls" if fmt.supports_tool_calls else "bash_block"
