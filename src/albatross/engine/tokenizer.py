"""Text side of a model directory: its tokenizer, chat template and stop tokens (one loader for every layer).

``load_tokenizer(model_dir)`` returns a transformers tokenizer for any directory holding tokenizer files (local
files only). The demo's tiny tokenizer is such a directory too: ``tiny_hf_tokenizer(words)`` builds it with the
``tokenizers`` library (``TinyTokenizer.save`` writes it), with ``TINY_CHAT_TEMPLATE`` as its chat template. A
directory holding only the legacy ``albatross_tokenizer.json`` (the word list) loads as the same tokenizer.

The tiny tokenizer gives exactly ``harness.chat.TinyTokenizer``'s ids for any text (known words, unknown words,
any Unicode), except that the strings of its special tokens (``<|user|>``...) in a text are those special tokens,
as in every transformers tokenizer. Both round-trip any text.

``HFText`` is what the OpenAI-compatible server needs (encode, decode, chat prompt ids, stop ids).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

SPECIALS = ["<|pad|>", "<|eos|>", "<|user|>", "<|assistant|>", "<|obs|>", "<|end|>"]
SYMBOLS = ["```bash\n", "\n```", " > ", " < ", ".txt", ".log", " -l", "\n"]
WORD_PATTERN = r" ?[A-Za-z_]+"
BARE_WORD_PATTERN = r"[A-Za-z_]+"  # words never carry their leading space: a space is its own token
LEGACY_TINY = "albatross_tokenizer.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
CHAT_ROLES = ("system", "user", "assistant", "tool")

_TINY_TOOLS = ("{%- if tools %}{{- '\\n\\nCall exactly one tool per turn as <tool_call>{\"name\": ..., "
               "\"arguments\": {...}}</tool_call>.\\nTools:' }}{%- for t in tools %}{{- '\\n- ' + "
               "t.function.name + '(' + (t.function.parameters.properties | list | join(', ')) + '): ' + "
               "t.function.description }}{%- endfor %}{%- endif %}")
TINY_CHAT_TEMPLATE = (
    "{%- set ns = namespace(first=true, system='') %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'system' %}{%- set ns.system = m.content + '\\n\\n' %}"
    "{%- elif m.role == 'user' and ns.first %}{{- '<|user|>' + ns.system + (m.content | trim) }}" + _TINY_TOOLS +
    "{%- set ns.first = false %}"
    "{%- elif m.role == 'assistant' %}{{- '<|assistant|>' + m.content + '<|end|>' }}"
    "{%- else %}{{- '<|obs|>' + m.content }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>' }}{%- endif %}"
)
"""The demo's layout as a chat template: ``<|user|>`` instruction (stripped, as the harness does; a system
message is prepended to it, then a blank line; tools are listed after it as ``describe_tools`` does), each assistant message ``<|assistant|>`` text
``<|end|>``, each tool result and every later user message ``<|obs|>`` text, generation prompt ``<|assistant|>``.
It has no ``<tool_call>`` token, so ``action_format = "auto"`` gives fenced bash blocks."""


def tiny_vocab(words: list[str]) -> list[str]:
    """The tiny tokenizer's token strings in id order: specials, 256 byte tokens, symbols, sorted words."""
    return SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + SYMBOLS + sorted(set(words))


def tiny_hf_tokenizer(words: list[str], word_pattern: str = WORD_PATTERN) -> Any:
    """The demo tokenizer as a ``PreTrainedTokenizerFast`` with ``TINY_CHAT_TEMPLATE``: the same ids as
    ``TinyTokenizer(words)`` for any text without special-token strings in it.

    Pre-tokens are split as ``TinyTokenizer`` scans (symbols, then ``WORD_PATTERN``, else one character at a
    time), mapped to bytes (``ByteLevel``), and marked with ``_MARK`` when the whole pre-token is a known symbol
    or word; a BPE model with no merges looks a marked pre-token up whole and an unmarked one byte by byte. The
    mark is what keeps a one-letter word (``a``) from being used inside an unknown word (``ab``).

    ``word_pattern = BARE_WORD_PATTERN`` (with ``words`` without leading spaces) splits a space off the word
    after it, so a word is one token wherever it stands (the demo's tokenizer; ``TinyTokenizer`` has no such
    mode)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    to_char = byte_chars()
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({to_char[b]: len(SPECIALS) + b for b in range(256)})
    known = SYMBOLS + sorted(set(words))
    vocab.update({_MARK + _byte_level(w, to_char): len(SPECIALS) + 256 + i for i, w in enumerate(known)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], ignore_merges=True))
    symbols = "|".join(re.escape(s) for s in sorted(SYMBOLS, key=len, reverse=True))
    whole = "|".join(re.escape(_byte_level(w, to_char)) for w in sorted(set(known), key=len, reverse=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(f"{symbols}|{word_pattern}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        pre_tokenizers.Metaspace(replacement=_MARK, prepend_scheme="always", split=False),  # mark every piece
        pre_tokenizers.Split(Regex(f"^{_MARK}(?!(?:{whole})$)"), behavior="removed"),  # unmark unknown ones
    ])
    tok.decoder = decoders.Sequence([decoders.Replace(_MARK, ""), decoders.ByteLevel()])
    tok.add_special_tokens(SPECIALS)
    out = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # transformers: an untyped constructor
        tokenizer_object=tok, eos_token="<|eos|>", pad_token="<|pad|>", clean_up_tokenization_spaces=False,
        additional_special_tokens=SPECIALS[2:])
    out.chat_template = TINY_CHAT_TEMPLATE
    return out


_MARK = "\u2581"  # never produced by ByteLevel, which maps every byte into its own 256-character alphabet


def byte_chars() -> dict[int, str]:
    """GPT-2's byte-to-character table (``ByteLevel``): printable Latin-1 bytes map to themselves, the other
    bytes to characters from U+0100 on, in byte order."""
    keep = {*range(33, 127), *range(161, 173), *range(174, 256)}
    out: dict[int, str] = {}
    for b in range(256):
        out[b] = chr(b) if b in keep else chr(256 + sum(1 for x in range(b) if x not in keep))
    return out


def _byte_level(text: str, to_char: dict[int, str]) -> str:
    return "".join(to_char[b] for b in text.encode("utf-8"))


def load_tokenizer(model_dir: str | Path) -> Any:
    """The transformers tokenizer of ``model_dir`` (local files only; a legacy ``albatross_tokenizer.json``
    directory gives ``tiny_hf_tokenizer``). ``FileNotFoundError`` / ``ValueError`` carry a one-line message
    naming the directory."""
    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: model directory not found")
    if any((path / name).is_file() for name in TOKENIZER_FILES):
        from transformers import AutoTokenizer

        try:
            return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as e:  # transformers raises many types; the user needs one line
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"{path}: the tokenizer files do not load ({first})") from None
    if (path / LEGACY_TINY).is_file():
        try:
            return tiny_hf_tokenizer(json.loads((path / LEGACY_TINY).read_text())["words"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path / LEGACY_TINY}: not a tiny tokenizer file ({e})") from None
    raise FileNotFoundError(f"{path}: no tokenizer files (tokenizer.json, tokenizer_config.json, "
                            f"tokenizer.model or {LEGACY_TINY})")


def turn_end(tokenizer: Any, template: str | None = None) -> str:
    """The text the chat template writes right after an assistant message's content (e.g. ``<|im_end|>\\n``)."""
    probe = [{"role": "user", "content": "PING"}, {"role": "assistant", "content": "PONG"}]
    text: str = tokenizer.apply_chat_template(probe, tokenize=False, chat_template=template)
    return text[text.rindex("PONG") + len("PONG"):]


def stop_token_id(tokenizer: Any, template: str | None = None) -> int | None:
    """The special (or added) token that ends an assistant turn in the template, or None when the turn end does
    not start with one."""
    first = list(tokenizer.encode(turn_end(tokenizer, template), add_special_tokens=False))[:1]
    specials = set(tokenizer.all_special_ids) | set(_added_ids(tokenizer))
    return first[0] if first and first[0] in specials else None


def _added_ids(tokenizer: Any) -> list[int]:
    try:
        return list(tokenizer.get_added_vocab().values())
    except (AttributeError, NotImplementedError):
        return []


class TextTokenizer(Protocol):
    vocab_size: int
    eos_id: int | None
    stop_ids: list[int]

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Prompt ids of a chat, ending where the assistant's next message starts."""
        ...


class HFText:
    """A model directory's transformers tokenizer (``load_tokenizer``), with its chat template's stop token."""

    def __init__(self, directory: str | Path) -> None:
        self.tok = load_tokenizer(directory)
        self.vocab_size, self.eos_id = len(self.tok), self.tok.eos_token_id
        self.stop_ids = [self.eos_id] if self.eos_id is not None else []
        if getattr(self.tok, "chat_template", None):  # a transformers tokenizer: not every kind has the attribute
            stop = stop_token_id(self.tok)
            if stop is not None and stop not in self.stop_ids:
                self.stop_ids.insert(0, stop)

    def encode(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        text: str = self.tok.decode(list(ids), skip_special_tokens=True)
        return text

    def chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        if not getattr(self.tok, "chat_template", None):  # transformers: not every tokenizer kind has one
            raise ValueError("this model's tokenizer has no chat template: use /v1/completions")
        bad = [m.get("role") for m in messages if m.get("role") not in CHAT_ROLES]
        if bad:
            raise ValueError(f"unknown chat role {bad[0]!r}: use system, user, assistant or tool")
        text = self.tok.apply_chat_template([{**m, "content": _content(m)} for m in messages],
                                            add_generation_prompt=True, tokenize=False)
        return self.encode(text)


def _content(message: dict[str, Any]) -> str:
    content = message.get("content", "")
    if isinstance(content, list):  # OpenAI content parts: keep the text ones
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if not isinstance(content, str):
        raise ValueError("message content must be a string or a list of text parts")
    return content


def load_text_tokenizer(directory: str | Path) -> HFText:
    """The text side of a model directory for the server; ``FileNotFoundError`` when it has no tokenizer."""
    return HFText(directory)
