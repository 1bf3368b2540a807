"""Model loading (a local transformers checkpoint, never a hub), freezing and activation checkpointing."""

from __future__ import annotations

from pathlib import Path


def load_model(directory: str | Path, dtype=None):
    """Load a causal LM from a local directory (never from a hub); ``glm5_next`` loads as its VLM."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(directory)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}/config.json: not a model directory")
    if _model_type(path) == "glm5_next":  # ships only as a vision-language model
        from albatross.models.tiny import load_any

        return load_any(path, dtype)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, local_files_only=True)
    return model


def _model_type(path: Path) -> str | None:
    """``model_type`` of ``path/config.json``; None when unreadable (transformers then reports it)."""
    import json

    try:
        return json.loads((path / "config.json").read_text()).get("model_type")
    except (ValueError, AttributeError, OSError):
        return None


def num_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def freeze(model, patterns) -> list[str]:
    """Freeze the parameters that ``patterns`` select; return the frozen names.

    Each entry is a part name (``first_layers:N``, ``ngram``, ``indexer``, ``mtp``, ``vision``, ``router``;
    ``albatross.models.parts``) or a glob over ``model.named_parameters()`` names (``model.layers.0.*``).
    Frozen parameters get no gradient and the trainer leaves them out of the optimizer. An entry that
    matches nothing is an error, so a typo cannot silently train everything.
    """
    from albatross.models.parts import resolve_freeze

    frozen = resolve_freeze(model, patterns)
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
