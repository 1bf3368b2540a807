"""The tiny Qwen2 model the engine and trainer unit tests share: 300 tokens, 2 layers, tied embeddings."""

from __future__ import annotations

import torch
import transformers

VOCAB = 300


def tiny_qwen2(seed: int = 0, attn: str | None = None, initializer_range: float = 0.2,
               eval_mode: bool = True) -> transformers.Qwen2ForCausalLM:
    """Random weights from ``seed``; ``attn`` picks the attention implementation (transformers' default if None)."""
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True,
        initializer_range=initializer_range, **({"attn_implementation": attn} if attn else {}),
    )
    model = transformers.Qwen2ForCausalLM(config)
    return model.eval() if eval_mode else model
