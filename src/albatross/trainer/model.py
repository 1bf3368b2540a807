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


def freeze(model, patterns) -> list[str]:
    """Freeze every parameter whose name matches one of the glob ``patterns``; return the frozen names.

    Names are those of ``model.named_parameters()`` (e.g. ``model.layers.0.*``, ``*.mlp.*``). Frozen
    parameters get no gradient and the trainer leaves them out of the optimizer. A pattern that matches
    nothing is an error, so a typo cannot silently train everything.
    """
    import fnmatch

    names = [name for name, _ in model.named_parameters()]
    frozen: list[str] = []
    for pattern in patterns:
        hits = fnmatch.filter(names, pattern)
        if not hits:
            raise ValueError(f"freeze pattern {pattern!r} matches no parameter (e.g. {names[:3]})")
        frozen += [n for n in hits if n not in frozen]
    params = dict(model.named_parameters())
    for name in frozen:
        params[name].requires_grad_(False)
    return frozen


def enable_activation_checkpointing(model) -> None:
    """Recompute each decoder layer's activations in the backward instead of storing them.

    Uses transformers' own per-layer checkpointing (non-reentrant), so parameter names do not change.
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support activation checkpointing")
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def tiny_causal_lm(vocab_size: int = 300, hidden_size: int = 64, num_layers: int = 2, *, attn: str = "sdpa",
                   seed: int = 0, **overrides):
    """A small random Qwen2 causal LM built from a config, for tests and benchmarks (nothing downloaded).

    Heads of 32 dimensions (2 key/value heads), MLP twice the hidden size, tied embeddings; ``overrides``
    go to ``Qwen2Config`` (e.g. ``attention_dropout``).
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    heads = max(hidden_size // 32, 1)
    fields = {"vocab_size": vocab_size, "hidden_size": hidden_size, "intermediate_size": 2 * hidden_size,
              "num_hidden_layers": num_layers, "num_attention_heads": heads,
              "num_key_value_heads": max(heads // 2, 1), "max_position_embeddings": 1 << 20,
              "tie_word_embeddings": True, "attn_implementation": attn, **overrides}
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(Qwen2Config(**fields))
