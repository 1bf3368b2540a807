"""Model building and loading: the tiny demo model from a config, or a local transformers checkpoint."""

from __future__ import annotations

from pathlib import Path

from albatross.config import ModelConfig
from albatross.harness.chat import TinyTokenizer


def build_tiny(cfg: ModelConfig, tokenizer: TinyTokenizer, seed: int = 0):
    """A Qwen2-architecture causal LM with random weights, sized by ``cfg`` (nothing downloaded)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=tokenizer.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_positions, tie_word_embeddings=True,
        bos_token_id=tokenizer.special("<|user|>"), eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.pad_id,
    )
    return Qwen2ForCausalLM(config)


def save_model(model, tokenizer: TinyTokenizer, directory: str | Path) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save(directory)
    return directory


def load_model(directory: str | Path, dtype=None):
    """Load a causal LM from a local directory (never from a hub)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(directory)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}/config.json: not a model directory")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, local_files_only=True)
    return model


def num_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())
