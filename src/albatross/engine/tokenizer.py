"""Text side of an engine: the tokenizer and chat template of a model directory, for servers and stop strings.

A directory holding ``albatross_tokenizer.json`` (the demo's tiny tokenizer) uses ``TinyChatFormat``'s layout as
its chat template; any other directory is read with ``transformers.AutoTokenizer`` (local files only) and its own
chat template.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol


class TextTokenizer(Protocol):
    vocab_size: int
    eos_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Prompt ids of a chat, ending where the assistant's next message starts."""
        ...


class TinyText:
    """The demo tokenizer with ``TinyChatFormat``'s chat layout."""

    def __init__(self, directory: str | Path) -> None:
        from albatross.harness.chat import TinyChatFormat, load_tokenizer

        self.tok = load_tokenizer(directory)
        self.fmt = TinyChatFormat(self.tok)
        self.vocab_size, self.eos_id = self.tok.vocab_size, self.tok.eos_id
        self.stop_ids = self.fmt.stop_ids

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(ids)

    def chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        t = self.tok
        ids: list[int] = []
        for m in messages:
            role, content = m.get("role"), _content(m)
            if role in ("system", "user"):
                ids += [t.special("<|user|>")] + t.encode(content)
            elif role == "assistant":
                ids += [t.special("<|assistant|>")] + self.fmt.action(content)
            elif role == "tool":
                ids += [t.special("<|obs|>")] + t.encode(content)
            else:
                raise ValueError(f"unknown chat role {role!r}: use system, user, assistant or tool")
        return ids + [t.special("<|assistant|>")]


class HFText:
    """A transformers tokenizer from a local directory."""

    def __init__(self, directory: str | Path) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        self.vocab_size, self.eos_id = len(self.tok), self.tok.eos_token_id
        self.stop_ids = [self.eos_id] if self.eos_id is not None else []

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        if not getattr(self.tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template: use /v1/completions")
        out = self.tok.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        ids = out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out
        return list(ids)


def _content(message: dict[str, Any]) -> str:
    content = message.get("content", "")
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if not isinstance(content, str):
        raise ValueError("message content must be a string or a list of text parts")
    return content


def load_text_tokenizer(directory: str | Path) -> TinyText | HFText:
    """The tokenizer of a model directory; ``FileNotFoundError`` when it has none."""
    path = Path(directory)
    if (path / "albatross_tokenizer.json").is_file():
        return TinyText(path)
    if any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return HFText(path)
    raise FileNotFoundError(f"{path}: no tokenizer (albatross_tokenizer.json or tokenizer.json)")
