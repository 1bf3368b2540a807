"""Chat templates in the styles of common model families, and tiny BPE tokenizers that carry them.

Written here (no model hub is reachable) so that tests and benchmarks exercise the same kinds of templates real
checkpoints ship:

- ``QWEN3_TEMPLATE``: ChatML (``<|im_start|>role ... <|im_end|>``), tools in the system message, tool results
  as ``<tool_response>`` inside a user turn, and Qwen3's reasoning rule: an assistant message's
  ``<think>...</think>`` block is kept only after the last user message and dropped from earlier turns (and its
  whitespace normalised to ``<think>\\n...\\n</think>\\n\\n``). With observations as ``tool`` messages the history is
  never rewritten; with observations as ``user`` messages every earlier ``<think>`` block disappears.
- ``LLAMA3_TEMPLATE``: Llama-3 headers (``<|start_header_id|>role<|end_header_id|>\\n\\n content<|eot_id|>``), a
  system header with the tool environment, tools listed in the first user message, tool results in the
  ``ipython`` role; every content is ``trim``-med.
- ``GEMMA_TEMPLATE``: Gemma turns (``<start_of_turn>user|model ... <end_of_turn>``), the system message prepended
  to the first user turn, tool results as user turns, contents ``trim``-med; no tool format.

``toy_tokenizer(style, corpus)`` trains a small byte-level BPE tokenizer with the style's special tokens and
template (deterministic for a given corpus).
"""

from __future__ import annotations

from typing import Any

QWEN3_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided "
    "with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'assistant' %}"
    "{%- set content = m.content %}{%- set reasoning = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' }}{%- endif %}"
    "{{- content + '<|im_end|>\\n' }}"
    "{%- elif m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}{%- set system = messages[0].content | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{%- if tools %}{{- 'Environment: ipython\\n' }}{%- endif %}"
    "{{- 'Cutting Knowledge Date: December 2023\\n\\n' + system + '<|eot_id|>' }}"
    "{%- for m in messages %}"
    "{%- if loop.first and tools and m.role == 'user' %}"
    "{{- '<|start_header_id|>user<|end_header_id|>\\n\\nGiven the following functions, respond with a JSON for a "
    "function call with its proper arguments.\\n\\n' }}"
    "{%- for t in tools %}{{- (t | tojson(indent=4)) + '\\n\\n' }}{%- endfor %}"
    "{{- (m.content | trim) + '<|eot_id|>' }}"
    "{%- elif m.role == 'tool' or m.role == 'ipython' %}"
    "{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + (m.content | trim) + '<|eot_id|>' }}"
    "{%- else %}{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + (m.content | trim) + "
    "'<|eot_id|>' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

GEMMA_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0].role == 'system' %}{%- set prefix = messages[0].content + '\\n\\n' %}"
    "{%- set turns = messages[1:] %}{%- else %}{%- set prefix = '' %}{%- set turns = messages %}{%- endif %}"
    "{%- for m in turns %}"
    "{%- set role = 'model' if m.role == 'assistant' else 'user' %}"
    "{{- '<start_of_turn>' + role + '\\n' + (prefix if loop.first else '') + (m.content | trim) + "
    "'<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)

# style -> (special tokens, eos, pad, bos, template); the first special is the padding/end-of-text token
STYLES: dict[str, tuple[list[str], str, str, str | None, str]] = {
    "qwen3": (["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
               "</tool_response>", "<think>", "</think>"], "<|im_end|>", "<|endoftext|>", None, QWEN3_TEMPLATE),
    "llama3": (["<|end_of_text|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                "<|python_tag|>"], "<|eot_id|>", "<|end_of_text|>", "<|begin_of_text|>", LLAMA3_TEMPLATE),
    "gemma": (["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"], "<eos>", "<pad>", "<bos>",
              GEMMA_TEMPLATE),
}


def toy_tokenizer(style: str, corpus: list[str], vocab_size: int = 800) -> Any:
    """A small byte-level BPE ``PreTrainedTokenizerFast`` trained on ``corpus`` with ``style``'s special tokens
    (``STYLES``) and chat template: a stand-in for that family's tokenizer where no model hub is reachable."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials, eos, pad, bos, template = STYLES[style]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    extra = [s for s in specials if s not in (eos, pad, bos)]
    out = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # transformers' tokenizer __init__ is untyped
        tokenizer_object=tok, eos_token=eos, pad_token=pad, bos_token=bos, clean_up_tokenization_spaces=False,
        additional_special_tokens=extra)
    out.chat_template = template
    return out
