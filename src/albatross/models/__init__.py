"""The seeds' model families as albatross trains them: exact packing and freezing by part.

``family(model)`` names a transformers causal LM's family; ``prepare_for_packing(model)`` makes every
part that would carry information across packed documents run each document alone (``segments``):
linear attention and its causal conv (``qwen3_next``, ``qwen4_exp``, ``glm5_next``), the n-gram (PLE)
embeddings and their dilated conv (``qwen4_exp``), the sparse-attention indexers' top-k (``qwen4_exp``
QSA, ``glm_moe_dsa`` / ``glm5_next`` DSA). Dense attention stays on the trainer's document masking.
Parameters keep their names, so ``save_pretrained`` / ``from_pretrained`` are unchanged.
"""

from __future__ import annotations

from typing import Any

# decoder-layer attributes whose module mixes tokens beyond attention masking, per family
PACKED_PARTS: dict[str, tuple[str, ...]] = {
    "qwen2": (),
    "qwen3": (),
    "qwen3_moe": (),
    "qwen3_next": ("linear_attn",),
    "qwen4_exp": ("linear_attn", "self_attn", "ple"),
    "glm_moe_dsa": ("self_attn",),
    "glm5_next": ("self_attn",),
}
# module class-name fragments that mix tokens outside attention masking: unknown families with them refuse
LEAKY_MODULES = ("GatedDeltaNet", "LinearAttention", "Indexer", "Mamba", "NGram", "PLE", "ShortConv")


def family(model: Any) -> str:
    """The model family, from its (text) config's ``model_type``: e.g. ``qwen4_exp``, ``glm5_next``."""
    config = model.config
    name = str(getattr(config, "model_type", "") or "")
    if name in PACKED_PARTS:
        return name
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    name = str(getattr(text, "model_type", name) or name)
    return name.removesuffix("_text")


def decoder_layers(model: Any) -> list[Any]:
    """The decoder layers of a causal LM (``model.get_decoder().layers``)."""
    return list(getattr(model.get_decoder(), "layers", []))


def _check_supported(model: Any, name: str) -> None:
    if name in PACKED_PARTS:
        return
    leaky = sorted({type(m).__name__ for m in model.modules() if any(k in type(m).__name__ for k in LEAKY_MODULES)})
    if leaky:
        raise NotImplementedError(f"model family {name!r} has token mixers albatross cannot pack exactly yet "
                                  f"({', '.join(leaky[:4])}); supported: {sorted(PACKED_PARTS)}")


def prepare_for_packing(model: Any) -> Any:
    """Make ``model`` exact on packed rows: documents never see each other.

    Idempotent; returns ``model``. Families with nothing to change (dense attention) are returned as is;
    an unknown family with linear attention, indexers or n-gram embeddings is refused. The config is left
    alone (a saved checkpoint keeps ``use_cache`` for generation): the trainer's forward passes
    ``use_cache=False``, and a packed row given a cache is an error.
    """
    from albatross.models.segments import Layout, segmented, track_layout

    name = family(model)
    _check_supported(model, name)
    parts = PACKED_PARTS.get(name, ())
    if not parts:
        return model
    layout = Layout()
    track_layout(model.get_decoder(), layout)
    for layer in decoder_layers(model):
        for attr in parts:
            module = getattr(layer, attr, None)
            if module is not None:
                segmented(module, layout)
    return model
