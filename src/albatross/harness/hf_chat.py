"""Chat format of a transformers tokenizer, rendered from its own chat template, append-only.

The first prompt is the template's rendering of ``[system?, user]`` (with the tool list when JSON tool calls
are on). After that the harness never renders the conversation again: an observation is the template's
*delta* for one more message, found by rendering a fixed two-message probe with and without it, and
appended to the exact ids the engine produced (DESIGN.md, token-in/token-out). A template that is not
append-only for that message is refused at start-up.

``CHATML_TOOLS_TEMPLATE`` is a Qwen2.5 / Hermes-style ChatML template (``<|im_start|>role ... <|im_end|>``,
tools in the system message, tool results as ``<tool_response>`` in a user turn) for tokenizers that
ship without one.
"""

from __future__ import annotations

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


class HFChatFormat:
    """A ``ChatFormat`` over a transformers tokenizer (``observation_role``: ``tool`` or ``user``)."""

    def __init__(self, tokenizer: Any, system: str = "", observation_role: str = "tool",
                 template: str | None = None) -> None:
        self.tokenizer, self.system, self.observation_role = tokenizer, system, observation_role
        self.template = template or getattr(tokenizer, "chat_template", None) or CHATML_TOOLS_TEMPLATE
        closed_probe = self._render(_PROBE)
        end = closed_probe.rindex("PONG") + len("PONG")
        self._turn_end = closed_probe[end:]  # what follows an assistant message, e.g. "<|im_end|>\n"
        first = self._encode(self._turn_end)[:1]
        if not first or first[0] not in set(tokenizer.all_special_ids) | set(_added_ids(tokenizer)):
            raise ValueError(f"chat template: an assistant turn ends with {self._turn_end!r}, which does not "
                             "start with a special token to stop on")
        self._stop_id = first[0]
        stop_text = tokenizer.decode([self._stop_id])
        self._after_stop = self._turn_end[len(stop_text):] if self._turn_end.startswith(stop_text) else ""
        self._probe_text = closed_probe

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                generation: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, chat_template=self.template,
                                                  add_generation_prompt=generation)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    @property
    def stop_ids(self) -> list[int]:
        eos = self.tokenizer.eos_token_id
        return [self._stop_id] + ([eos] if eos is not None and eos != self._stop_id else [])

    def initial_prompt(self, instruction: str, tools: list[dict[str, Any]] | None = None) -> list[int]:
        messages = ([{"role": "system", "content": self.system}] if self.system else [])
        messages.append({"role": "user", "content": instruction.strip()})
        return self._encode(self._render(messages, tools, generation=True))

    def _delta(self, message: dict[str, Any], closed: bool) -> list[int]:
        text = self._render([*_PROBE, message], generation=True)
        if not text.startswith(self._probe_text):
            raise ValueError(f"chat template is not append-only for a {message['role']!r} message")
        return self._encode((self._after_stop if closed else self._turn_end) + text[len(self._probe_text):])

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
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def _added_ids(tokenizer: Any) -> list[int]:
    try:
        return list(tokenizer.get_added_vocab().values())
    except (AttributeError, NotImplementedError):
        return []


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
    out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  additional_special_tokens=CHATML_SPECIALS[3:])
    out.chat_template = CHATML_TOOLS_TEMPLATE
    return out
