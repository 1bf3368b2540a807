"""Tiny random instances of the seeds' model families, built from a config (nothing downloaded).

Sizes are chosen so every part that can leak across packed documents exists and is exercised: linear
attention with its causal conv, sparse-attention indexers whose top-k budget is smaller than a document,
MoE routers, n-gram (PLE) embeddings with their dilated conv, hyper-connections, and the MTP head of the
families that have one.
"""

from __future__ import annotations

from typing import Any

VOCAB = 256

_COMMON: dict[str, Any] = {"vocab_size": VOCAB, "hidden_size": 64, "num_attention_heads": 4,
                           "num_key_value_heads": 2, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
                           "tie_word_embeddings": False, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

_LINEAR = {"linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
           "linear_num_key_heads": 2, "linear_num_value_heads": 4}

_MLA = {"num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": 32, "qk_nope_head_dim": 16,
        "v_head_dim": 16, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "intermediate_size": 96, "index_n_heads": 2, "index_head_dim": 16}

CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3": {**_COMMON, "intermediate_size": 128, "num_hidden_layers": 2, "head_dim": 16},
    "qwen3_moe": {**_COMMON, "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 4,
                  "num_experts_per_tok": 2, "num_hidden_layers": 2, "head_dim": 16},
    "qwen3_next": {**_COMMON, **_LINEAR, "intermediate_size": 128, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
                   "num_hidden_layers": 4, "head_dim": 16,
                   "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"]},
    "qwen4_exp": {**_COMMON, **_LINEAR, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
                  "num_experts": 4, "num_experts_per_tok": 2, "num_hidden_layers": 4, "head_dim": 16,
                  "hc_count": 2, "hc_lowrank": 8, "ple_layer_ids": [1, 2], "ple_embed_dim": 32,
                  "ngram_size": 3, "heads_per_ngram": 2, "ngram_vocab_size_base": 1000,
                  "make_ngram_vocab_size_divisible_by": 8, "split_ngram_parts": 1, "indexer_n_heads": 2,
                  "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 8,
                  "indexer_compress_ratio": 4},
    "glm_moe_dsa": {**_COMMON, **_MLA, "num_hidden_layers": 3, "qk_rope_head_dim": 8, "index_topk": 8,
                    "first_k_dense_replace": 1},
    "glm5_next": {**_COMMON, **_MLA, "num_hidden_layers": 4, "qk_rope_head_dim": 0, "index_topk": 8,
                  "index_kpool": 4, "linear_head_dim": 16, "linear_num_heads": 4, "linear_conv_kernel_dim": 4,
                  "hc_mult": 2, "hc_sinkhorn_iters": 4, "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"]},
}
FAMILIES = tuple(CONFIGS)


# glm5_next ships only as a vision-language model: a one-block vision tower, and multimodal token ids in
# the tiny vocabulary's top so random documents (ids 3..249) never contain one
_GLM5_VISION = {"depth": 1, "hidden_size": 32, "num_heads": 2, "intermediate_size": 64, "out_hidden_size": 64,
                "projection_intermediate_size": 64, "patch_size": 14, "image_size": 28}
_GLM5_TOKENS = {"image_token_id": 250, "video_token_id": 251, "image_start_token_id": 252,
                "image_end_token_id": 253, "video_start_token_id": 254, "video_end_token_id": 255}
TEXT_VOCAB = 250  # documents of the tiny models use ids below this


def tiny_config(family: str, **overrides: Any) -> Any:
    """The transformers config of a tiny ``family`` model (``overrides`` go to the language model's)."""
    from transformers import AutoConfig

    if family not in CONFIGS:
        raise ValueError(f"unknown model family {family!r}; choose one of {list(FAMILIES)}")
    text = {**CONFIGS[family], **overrides}
    if family == "glm5_next":
        return AutoConfig.for_model("glm5_next", text_config={**text, "model_type": "glm5_next_text"},
                                    vision_config=_GLM5_VISION, **_GLM5_TOKENS)
    return AutoConfig.for_model("qwen4_exp_text" if family == "qwen4_exp" else family, **text)


def tiny_model(family: str, seed: int = 0, mtp: bool = True, **overrides: Any) -> Any:
    """A random tiny model of ``family`` in fp32, in eval mode (``save_pretrained`` round-trips).

    ``mtp``: families that have a multi-token-prediction head (``models/mtp.py``) get one as ``model.mtp``,
    initialised after the rest (the other weights are the same with or without it)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from albatross.models.mtp import MTP_LAYOUT, attach_mtp

    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if family == "glm5_next" else AutoModelForCausalLM
    model = auto.from_config(tiny_config(family, **overrides), dtype=torch.float32).eval()  # type: ignore[no-untyped-call]  # transformers leaves it unannotated
    if mtp and family in MTP_LAYOUT:
        attach_mtp(model).eval()
    return model


def load_any(directory: Any, dtype: Any = None) -> Any:
    """A local checkpoint as a causal LM, or as a vision-language model (``glm5_next``) when it is one; its MTP
    head too when the checkpoint has MTP weights (``models/mtp.py``: transformers drops them)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from albatross.models.mtp import load_mtp

    config = AutoConfig.from_pretrained(directory, local_files_only=True)
    auto = AutoModelForImageTextToText if config.model_type == "glm5_next" else AutoModelForCausalLM
    model = auto.from_pretrained(directory, dtype=dtype or torch.float32, local_files_only=True)
    load_mtp(model, directory, required=False)
    return model
