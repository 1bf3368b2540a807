"""The demo recipe: built-in tasks, a tiny Llama-architecture model with a word-level tokenizer, built as an
ordinary transformers model directory, warm-started by SFT on oracle demonstrations. ``albatross demo`` is
``albatross train`` with this recipe."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from albatross.config import ModelConfig, RunConfig, load_config

if TYPE_CHECKING:
    from transformers import (
        LlamaForCausalLM,
        PreTrainedModel,
        PreTrainedTokenizerBase,
        PreTrainedTokenizerFast,
    )

    from albatross.harness.chat import TinyTokenizer

QUICK_OVERRIDES = [
    "tasks.n_train=240", "tasks.n_heldout=8", "tasks.n_validation=0", "warmstart.steps=300", "warmstart.check_every=25",
    "orchestrator.max_steps=8", "orchestrator.max_minutes=1.0", "orchestrator.groups_per_step=2",
    "eval.trials=3",
]


def demo_config_path() -> Path:
    """The demo's config: ``albatross/configs/demo.toml`` inside an installed package, else ``configs/demo.toml``
    of the checkout this module runs from (an editable install)."""
    from importlib.resources import files

    from albatross.errors import UserError

    for path in (Path(str(files("albatross"))) / "configs" / "demo.toml",
                 Path(__file__).resolve().parents[3] / "configs" / "demo.toml"):
        if path.is_file():
            return path
    raise UserError("the demo's config (albatross/configs/demo.toml) is missing from this installation: "
                    "reinstall albatross, or pass --config FILE")


def demo_config(config_path: str | None, quick: bool, out: str | None, overrides: list[str]) -> RunConfig:
    """The demo's config (``demo_config_path``, or ``config_path``), the quick overrides, then the user's."""
    path = config_path or str(demo_config_path())
    extra = (QUICK_OVERRIDES if quick else []) + list(overrides)
    if out:
        extra.append(f"out={json.dumps(out)}")
    return load_config(path, extra)


def demo_tokenizer(families: list[str] | None = None,
                   heldout_families: list[str] | None = None) -> PreTrainedTokenizerFast:
    """The tiny model's tokenizer, a transformers tokenizer with its own chat template (``tiny_hf_tokenizer``):
    whole words of the corpus of the built-in families it trains on (the demo's three by default, so that adding
    families elsewhere never changes the demo model's vocabulary), bytes for everything else.

    A word is one token wherever it stands: words carry no leading space, a space is a token of its own
    (``BARE_WORD_PATTERN``). The demo's tasks are copying tasks (a file name from the instruction, or from what
    ``cat`` printed, into a command), and with ``" lemon"`` and ``"lemon"`` as two tokens every copy was a mapping
    the tiny model had to learn word by word, for each place a word can stand: it never learned it for a word
    it had not been trained to copy there (the held-out split's words), and which family's mapping the warm
    start happened to pick up decided what RL could improve (docs/benchmarks.md, the demo). With one token per
    word a copy is the same token, which the model learns once for every word."""
    from albatross.engine.tokenizer import BARE_WORD_PATTERN, tiny_hf_tokenizer
    from albatross.harness.chat import TinyTokenizer
    from albatross.tasks.builtin import DEMO_FAMILIES, corpus_strings

    names = [*(families or DEMO_FAMILIES), *(f for f in heldout_families or [] if f not in (families or DEMO_FAMILIES))]
    words = [w for w in TinyTokenizer.from_corpus(corpus_strings(names)).words if not w.startswith(" ")]
    tokenizer: PreTrainedTokenizerFast = tiny_hf_tokenizer(words, word_pattern=BARE_WORD_PATTERN)
    return tokenizer


def build_tiny(cfg: ModelConfig, tokenizer: PreTrainedTokenizerBase | TinyTokenizer,
               seed: int = 0) -> LlamaForCausalLM:
    """A Llama-architecture causal LM with random weights, sized by ``cfg`` (nothing downloaded), whose generation
    config stops at the end of an assistant turn (``<|end|>``) as well as at ``<|eos|>``.

    Llama rather than Qwen2: transformers loads the tokenizer of a ``qwen2`` directory as its own Qwen2 tokenizer
    whatever the directory's tokenizer files say, so a saved demo model would come back with other token ids;
    for ``llama`` it loads the directory's own tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from albatross.harness.chat import TinyTokenizer

    torch.manual_seed(seed)
    ids: dict[str, Any]
    end: int | list[int]
    if isinstance(tokenizer, TinyTokenizer):  # the legacy tokenizer
        ids = {"vocab_size": tokenizer.vocab_size, "bos_token_id": tokenizer.special("<|user|>"),
               "eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.pad_id}
        end = tokenizer.special("<|end|>")
    else:
        ids = {"vocab_size": len(tokenizer), "bos_token_id": tokenizer.convert_tokens_to_ids("<|user|>"),
               "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
        end = tokenizer.convert_tokens_to_ids("<|end|>")
    config = LlamaConfig(
        hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_positions, tie_word_embeddings=True, **ids,
    )
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = [end, ids["eos_token_id"]]
    return model


def save_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | TinyTokenizer,
               directory: str | Path) -> Path:
    """``save_pretrained`` of the model and of its tokenizer (a transformers one, or the demo's)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    from albatross.harness.chat import TinyTokenizer

    model.save_pretrained(directory, safe_serialization=True)
    if isinstance(tokenizer, TinyTokenizer):
        tokenizer.save(directory)
    else:
        tokenizer.save_pretrained(directory)
    return directory
