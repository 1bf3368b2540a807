"""The seeds' model families as albatross trains them: exact packing and freezing by part.

``family(model)`` names a transformers causal LM's family; ``prepare_for_packing(model)`` swaps in
albatross' forward for every part that would carry information across packed documents: linear
attention with its causal conv (``linear_attention``, ``conv``: gated delta-net of ``qwen3_next`` /
``qwen4_exp``, KDA of ``glm5_next``) and the n-gram PLE with its dilated conv (``ngram``) run the whole
row at once and reset at each document; the sparse-attention layers (``qwen4_exp`` QSA, ``glm_moe_dsa``
/ ``glm5_next`` DSA) run each document alone (``segments``), so their indexers' top-k never ranks
another document's keys. Dense attention stays on the trainer's document masking. Parameters keep
their names, so ``save_pretrained`` / ``from_pretrained`` are unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch import nn



class CausalLM(Protocol):
    """The members of a transformers causal LM (``PreTrainedModel``) that the model patches here use."""

    def get_decoder(self) -> nn.Module: ...

    def get_input_embeddings(self) -> nn.Module: ...

    def get_output_embeddings(self) -> nn.Module | None: ...

    def modules(self) -> Iterator[nn.Module]: ...

    def named_modules(self) -> Iterator[tuple[str, nn.Module]]: ...

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]: ...


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


def packed_forwards() -> dict[str, Any]:
    """transformers module classes -> albatross' whole-row packed forward for them (same weights)."""
    from albatross.models.linear_attention import gated_delta_net_forward, kda_forward
    from albatross.models.ngram import ple_forward

    return {"Qwen3NextGatedDeltaNet": gated_delta_net_forward, "Qwen4ExpTextGatedDeltaNet": gated_delta_net_forward,
            "Glm5NextTextLinearAttention": kda_forward, "Qwen4ExpTextPLELayer": ple_forward}


def prepare_for_packing(model: Any) -> Any:
    """Make ``model`` exact on packed rows: documents never see each other.

    Idempotent; returns ``model``. Families with nothing to change (dense attention) are returned as is;
    an unknown family with linear attention, indexers or n-gram embeddings is refused. The config is left
    alone (a saved checkpoint keeps ``use_cache`` for generation): the trainer's forward passes
    ``use_cache=False``, and a packed row given a cache is an error.
    """
    from albatross.models.segments import replaced, segmented, track_layout

    name = family(model)
    _check_supported(model, name)
    parts = PACKED_PARTS.get(name, ())
    if not parts:
        return model
    layout = track_layout(model.get_decoder())
    for layer in decoder_layers(model):
        for attr in parts:
            module = getattr(layer, attr, None)  # a transformers layer's token mixer (None where it has none)
            if module is None:
                continue
            packed = packed_forwards().get(type(module).__name__)
            if packed is not None:  # one whole-row pass that resets at each document
                replaced(module, layout, packed)
            else:
                segmented(module, layout)
    return model
