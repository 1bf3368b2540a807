"""Tiny transformers model directories as a user brings them: a BPE tokenizer trained with the `tokenizers` library
on the built-in tasks' text, its own chat template, random weights of a real architecture, `save_pretrained`.

Shared by the integration tests of `albatross train` with `model.path` (nothing is downloaded), with the CLI runner
and the run config they use."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

LLAMA3_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|end_of_text|>"]


def _corpus() -> list[str]:
    from albatross.tasks.builtin import DEMO_FAMILIES, corpus_strings

    return corpus_strings(DEMO_FAMILIES) + ["```bash\n", "\n```", "exit code", "output"]


def bpe_tokenizer(style: str, vocab_size: int = 700) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` with the special tokens and chat template of ``style``
    (``qwen``: ChatML with tools; ``llama``: Llama-3 headers)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from albatross.harness.hf_chat import CHATML_SPECIALS, CHATML_TOOLS_TEMPLATE

    specials = CHATML_SPECIALS if style == "qwen" else LLAMA3_SPECIALS
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(), trainer)
    if style == "qwen":
        out = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                      additional_special_tokens=CHATML_SPECIALS[3:])
        out.chat_template = CHATML_TOOLS_TEMPLATE
    else:
        out = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                      pad_token="<|end_of_text|>",
                                      additional_special_tokens=["<|start_header_id|>", "<|end_header_id|>"])
        out.chat_template = LLAMA3_TEMPLATE
    return out


def model_dir(root: Path, arch: str, seed: int = 0) -> Path:
    """``root/<arch>``: a tiny ``llama`` (Llama-3 template) or ``qwen3`` (ChatML template) model directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    tok = bpe_tokenizer("llama" if arch == "llama" else "qwen")
    common = {"vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 2048,
              "tie_word_embeddings": True, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, bos_token_id=tok.bos_token_id))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=32))
    out = root / arch
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def albatross(*args: str, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    """``python -m albatross.cli ARGS`` in a subprocess (``env`` on top of this one's), output captured."""
    return subprocess.run([sys.executable, "-m", "albatross.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def write_config(path: Path, model: Path, tasks: Path, out: Path, extra: str = "", *, turn_tokens: int = 40,
                 context_tokens: int = 1024, warm_steps: int = 240, warm_lr: float = 3e-3, warm_batch: int = 16,
                 check_every: int = 40, target_pass_rate: float = 0.3, groups_per_step: int = 1,
                 max_steps: int = 2) -> Path:
    """A quick run config at ``path``: ``model.path`` = ``model``, the built-in tasks under ``tasks``
    (``train/``, ``heldout/``), an oracle warm start (a random model never solves a task), a few RL steps of
    groups of 4; ``extra`` TOML sections are appended."""
    path.write_text(f"""
out = "{out}"
[model]
path = "{model}"
[tasks]
train = ["{tasks / 'train'}"]
heldout = ["{tasks / 'heldout'}"]
[harness]
action_format = "bash_block"
max_turns = 3
max_tokens_per_turn = {turn_tokens}
max_context_tokens = {context_tokens}
[warmstart]
source = "oracle"
steps = {warm_steps}
lr = {warm_lr}
batch_size = {warm_batch}
check_every = {check_every}
check_tasks = 8
target_pass_rate = {target_pass_rate}
[orchestrator]
group_size = 4
groups_per_step = {groups_per_step}
max_steps = {max_steps}
max_minutes = 3.0
rollout_workers = 8
[eval]
trials = 1
{extra}
""")
    return path
