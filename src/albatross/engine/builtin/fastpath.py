"""A lean forward pass for Qwen2 / Llama-architecture models, on the model's own weights.

A tiny model's decode step is dominated by the Python overhead of ``transformers``' forward (module hooks, config
lookups, mask builders), not by arithmetic. This forward computes the same function with a handful of fused torch
ops per layer: RMSNorm, q/k/v projections (with Qwen2's biases), rotary embeddings from the model's own
``rotary_emb``, ``scaled_dot_product_attention`` with grouped KV heads and the grid's mask, and the SiLU MLP. It
reads and writes the same growing KV cache as the ``transformers`` path, so the two can be mixed. Models it does
not recognise (other architectures, sliding windows, extra norms) use ``transformers``' forward.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F

SUPPORTED = {"qwen2", "llama"}


def supports(model: torch.nn.Module) -> bool:
    # probes of a transformers model and its config: which family and layer layout it has
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) not in SUPPORTED:
        return False
    if getattr(config, "use_sliding_window", False) or getattr(config, "hidden_act", "silu") != "silu":
        return False
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or []):
        return False
    layers = getattr(getattr(model, "model", None), "layers", None)
    need = ("q_proj", "k_proj", "v_proj", "o_proj")
    if not layers:
        return False
    return all(hasattr(layer.self_attn, n) for layer in layers for n in need) and not any(
        hasattr(layer.self_attn, "q_norm") for layer in layers
    )


def _rms(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))  # transformers' norms name it either way
    weight = cast(torch.Tensor, norm.weight)  # an RMSNorm's weight is a Parameter (torch types it Tensor | Module)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _rope(x_BHTD: torch.Tensor, cos_B1TD: torch.Tensor, sin_B1TD: torch.Tensor) -> torch.Tensor:
    half = x_BHTD.shape[-1] // 2
    rotated = torch.cat([-x_BHTD[..., half:], x_BHTD[..., :half]], dim=-1)
    return x_BHTD * cos_B1TD + rotated * sin_B1TD


def attention_mask(mask_BL: torch.Tensor | None, T: int, L: int) -> torch.Tensor | None:
    """Boolean ``[B, 1, T, L]`` mask for ``T`` new queries at the last ``T`` of ``L`` columns: causal, the grid's
    holes masked, and each query always sees its own column (so a padding query never attends to nothing)."""
    if mask_BL is None and T == 1:
        return None
    cols_L = torch.arange(L, device=mask_BL.device if mask_BL is not None else None)
    own_T = L - T + torch.arange(T, device=cols_L.device)
    causal_TL = cols_L[None, :] <= own_T[:, None]
    if mask_BL is None:
        return causal_TL[None, None]
    allowed_BTL = causal_TL[None] & mask_BL.bool()[:, None, :]
    allowed_BTL |= cols_L[None, None, :] == own_T[None, :, None]
    return allowed_BTL[:, None]


def _attend(q_BHTD: torch.Tensor, k_BKLD: torch.Tensor, v_BKLD: torch.Tensor, mask: torch.Tensor | None,
            scale: float) -> torch.Tensor:
    """SDPA with grouped KV heads. One query per row (decoding): the query heads that share a KV head become
    that head's query rows, so K and V are read once instead of being expanded per query head."""
    B, H, T, D = q_BHTD.shape
    groups = H // k_BKLD.shape[1]
    if T == 1 and groups > 1:
        q_BKGD = q_BHTD.reshape(B, k_BKLD.shape[1], groups, D)
        o = F.scaled_dot_product_attention(q_BKGD, k_BKLD, v_BKLD, attn_mask=mask, scale=scale)
        return o.reshape(B, H, 1, D)
    return F.scaled_dot_product_attention(q_BHTD, k_BKLD, v_BKLD, attn_mask=mask, scale=scale, enable_gqa=True)


def forward(
    model: torch.nn.Module, ids_BT: torch.Tensor, mask_BL: torch.Tensor | None, pos_BT: torch.Tensor,
    cache: object, last_only: bool,
) -> torch.Tensor:
    """Logits ``[B, T, V]`` (``[B, 1, V]`` with ``last_only``); appends the new K/V to ``cache``."""
    # a transformers Qwen2 / Llama model (``supports``): torch types its submodules as ``Tensor | Module``
    inner: Any = model.model
    head: Any = model.lm_head
    h_BTC = inner.embed_tokens(ids_BT)
    cos, sin = inner.rotary_emb(h_BTC, pos_BT)
    cos_B1TD, sin_B1TD = cos[:, None], sin[:, None]
    B, T = ids_BT.shape
    layers = cache.layers  # type: ignore[attr-defined]
    L = layers[0].get_seq_length() + T
    mask = attention_mask(mask_BL, T, L)
    for layer, kv in zip(inner.layers, layers, strict=True):
        attn = layer.self_attn
        x = _rms(h_BTC, layer.input_layernorm)
        q = attn.q_proj(x).view(B, T, -1, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(B, T, -1, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(B, T, -1, attn.head_dim).transpose(1, 2)
        q, k = _rope(q, cos_B1TD, sin_B1TD), _rope(k, cos_B1TD, sin_B1TD)
        k_all, v_all = kv.update(k, v)
        o = _attend(q, k_all, v_all, mask, attn.scaling)
        h_BTC = h_BTC + attn.o_proj(o.transpose(1, 2).reshape(B, T, -1))
        x = _rms(h_BTC, layer.post_attention_layernorm)
        mlp = layer.mlp
        h_BTC = h_BTC + mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    h_BTC = _rms(h_BTC[:, -1:] if last_only else h_BTC, inner.norm)
    logits_BTV: torch.Tensor = head(h_BTC)
    return logits_BTV
