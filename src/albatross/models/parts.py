"""Freezing by part name: ``trainer.freeze`` entries that name a part of a model family, or glob patterns.

Parts (what the seeds freeze): ``first_layers:N`` (decoder layers 0..N-1), ``ngram`` (the n-gram / PLE
embedding tables), ``indexer`` (sparse-attention indexers: QSA, DSA), ``mtp`` (multi-token-prediction
layers), ``vision`` (the vision tower), ``router`` (the MoE routers' gates), ``embed`` (the input token
embedding; refused where it is tied to the LM head). Any other entry is a glob over
``model.named_parameters()`` names (``model.layers.0.*``). A part the model does not have, or a pattern that
matches nothing, is an error, so a typo never silently trains everything.

Freezing the bottom of the network (``embed`` with ``first_layers:N``, and ``ngram`` where its tables feed
those layers) stops the backward at layer N: nothing below it needs a gradient, so those layers run
without an autograd graph (and are not recomputed under activation checkpointing). With the embedding
trainable, the backward still runs through the frozen layers to reach it; only their weight gradients go.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Sequence

from torch import nn

from albatross.errors import UserError
from albatross.models import CausalLM

FIRST_LAYERS = "first_layers:"
EMBED = "embed"


class FreezeError(UserError, ValueError):
    """A ``trainer.freeze`` entry that selects nothing (a user error: one line, exit code 2)."""


def _by_class(*fragments: str) -> Callable[[str, nn.Module], bool]:
    return lambda name, module: any(f in type(module).__name__ for f in fragments)


def _is_mtp(name: str, module: nn.Module) -> bool:
    return "mtp" in name.split(".") or "Mtp" in type(module).__name__ or "MTP" in type(module).__name__


def _is_vision(name: str, module: nn.Module) -> bool:
    return name.split(".")[-1] in ("visual", "vision_tower", "vision_model") or type(module).__name__.endswith(
        "VisionModel")


PARTS: dict[str, Callable[[str, nn.Module], bool]] = {
    "ngram": _by_class("NGramEmbedding"),
    "indexer": _by_class("Indexer"),
    "mtp": _is_mtp,
    "vision": _is_vision,
    "router": lambda name, module: "router" in type(module).__name__.lower(),
}
PART_NAMES = (*PARTS, EMBED, f"{FIRST_LAYERS}N")


def _params_of(model: CausalLM, wanted: Callable[[str, nn.Module], bool]) -> list[str]:
    """Names of every parameter inside a module for which ``wanted(name, module)`` holds."""
    out: list[str] = []
    for prefix, module in model.named_modules():
        if prefix and wanted(prefix, module):
            out += [f"{prefix}.{n}" for n, _ in module.named_parameters()]
    return out


def _first_layers(model: CausalLM, spec: str) -> list[str]:
    count = spec.removeprefix(FIRST_LAYERS)
    if not count.isdigit() or int(count) < 1:
        raise FreezeError(f"trainer.freeze: {spec!r}: expected {FIRST_LAYERS}N with N >= 1")
    layers = list(getattr(model.get_decoder(), "layers", []))  # transformers' decoder: a layer stack, if any
    if int(count) > len(layers):
        raise FreezeError(f"trainer.freeze: {spec!r}: the model has only {len(layers)} decoder layers")
    chosen = {id(layer) for layer in layers[: int(count)]}
    return _params_of(model, lambda name, module: id(module) in chosen)


def embedding_tied(model: CausalLM) -> bool:
    """The LM head shares the input embedding's weight (then ``embed`` cannot be frozen alone)."""
    head = model.get_output_embeddings()
    return head is not None and getattr(head, "weight", None) is model.get_input_embeddings().weight  # transformers' head


def _embed(model: CausalLM) -> list[str]:
    """The input embedding's parameters; an error where the LM head shares them (freezing would freeze it)."""
    embedding = model.get_input_embeddings()
    if embedding_tied(model):
        raise FreezeError(f"trainer.freeze: {EMBED!r}: this {type(model).__name__} ties its input embedding to the "
                          "LM head; freezing it would freeze the head too")
    return _params_of(model, lambda name, module: module is embedding)


def _one(model: CausalLM, spec: str, names: list[str]) -> list[str]:
    """Parameter names of one freeze entry (a part name or a glob); an error when it matches nothing."""
    if spec.startswith(FIRST_LAYERS):
        hits = _first_layers(model, spec)
    elif spec == EMBED:
        hits = _embed(model)
    elif spec in PARTS:
        hits = _params_of(model, PARTS[spec])
        if not hits:
            raise FreezeError(f"trainer.freeze: {spec!r}: this {type(model).__name__} has no {spec} parameters")
    else:
        hits = fnmatch.filter(names, spec)
        if not hits:
            raise FreezeError(f"trainer.freeze: {spec!r} matches no parameter and is not a part "
                             f"({', '.join(PART_NAMES)}); e.g. {names[:3]}")
    return hits


def resolve_freeze(model: CausalLM, specs: Sequence[str] | Iterable[str]) -> list[str]:
    """Parameter names (in ``named_parameters`` order, no repeats) that the freeze entries ``specs`` select."""
    names = [name for name, _ in model.named_parameters()]
    selected: set[str] = set()
    for spec in specs:
        selected.update(_one(model, spec, names))
    return [n for n in names if n in selected]


def part_sizes(model: CausalLM) -> dict[str, int]:
    """Parameters in each named part this model has (for reports and docs)."""
    sizes = {}
    params = dict(model.named_parameters())
    for part, wanted in PARTS.items():
        count = sum(params[n].numel() for n in _params_of(model, wanted) if n in params)
        if count:
            sizes[part] = count
    return sizes
