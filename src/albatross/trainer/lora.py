"""LoRA (``[trainer.lora]``): low-rank adapters injected with PEFT into the model in place, the base frozen.

``apply_lora`` resolves ``target_modules`` to the model's linear layers (``attention``, ``mlp``, globs, and the
output layer ``lm_head`` when named), injects
the adapters (``peft.inject_adapter_in_model``: the model stays the same transformers object, so packing, the
chunked log-probs and activation checkpointing see the model they know) and freezes every other parameter, so only
the adapters get gradients and optimizer state. The engines get the merged weights under the base model's names
(``MergedView``), through the same weight transports as a full fine-tune; ``save_adapter`` writes the adapter in
PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``), which ``PeftModel.from_pretrained`` and
transformers load.
"""

from __future__ import annotations

import fnmatch
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from albatross.config import LoRAConfig, RunConfig
from albatross.errors import UserError

ADAPTER = "default"  # PEFT's adapter name inside the model
GROUPS = ("attention", "mlp")
OUTPUT = "lm_head"  # the pattern naming the output layer (whatever its module name in the family)
ATTENTION_PARTS = ("attn", "attention", "mixer")
MLP_PARTS = ("mlp", "feed_forward", "ffn")
SKIPPED_PARTS = ("experts", "router", "indexer", "mtp", "visual", "vision_tower", "vision_model", "ple", "ngram")
SKIPPED_FRAGMENTS = ("router", "hyper")  # MoE routers, hyper-connections (mix weights read as tensors)
ADAPTER_KEYS = (".lora_", ".lora_magnitude_vector")


class LoRAError(UserError, ValueError):
    """A ``[trainer.lora]`` setting this model or run cannot use (a user error: one line, exit code 2)."""


def _decoder_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The linear layers of the decoder layers (``...layers.N...``), minus experts, routers, indexers, MTP, vision,
    n-gram (PLE) and hyper-connection parts and one-output gates (a shared expert's scalar gate)."""
    out: dict[str, nn.Linear] = {}
    for name, module in model.named_modules():
        parts = name.split(".")
        if not isinstance(module, nn.Linear) or "layers" not in parts:
            continue
        if any(p in SKIPPED_PARTS or any(f in p for f in SKIPPED_FRAGMENTS) for p in parts) or module.out_features == 1:
            continue
        out[name] = module
    return out


def _in_group(name: str, group: str) -> bool:
    parents = name.split(".")[:-1]
    wanted = ATTENTION_PARTS if group == "attention" else MLP_PARTS
    return any(any(w in p for w in wanted) for p in parents)


def _head(model: nn.Module) -> nn.Linear | None:
    """The model's output layer (its LM head) when it is a plain linear layer."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return None
    head = model.get_output_embeddings()  # type: ignore[no-untyped-call]  # transformers
    return head if isinstance(head, nn.Linear) else None


def output_layer(model: nn.Module) -> str:
    """The module name of the model's output layer (``lm_head`` in most families), or ``""`` when it is not a
    plain linear layer (then it cannot take an adapter)."""
    head = _head(model)
    return next((name for name, m in model.named_modules() if m is head), "") if head is not None else ""


def output_is_tied(model: nn.Module) -> bool:
    """Whether the output layer's weight is the input embedding's (``tie_word_embeddings``)."""
    from transformers import PreTrainedModel

    head = _head(model)
    embed = model.get_input_embeddings() if isinstance(model, PreTrainedModel) else None
    return head is not None and isinstance(embed, nn.Embedding) and head.weight is embed.weight


def target_modules(model: nn.Module, patterns: list[str]) -> list[str]:
    """Full names of the linear layers ``patterns`` select (``attention``, ``mlp``, a glob over module names, or
    a module's last name; ``lm_head``, the output layer, only when a pattern is its name, never through a group
    or a glob). A glob or name that selects nothing is a ``LoRAError`` naming the model's linear layers (a typo
    never silently trains less); a group may be empty in a model (``mlp`` of a MoE without shared experts) as
    long as the whole selection is not."""
    linears = _decoder_linears(model)
    head = output_layer(model)
    if not patterns:
        raise LoRAError("trainer.lora.target_modules: empty; e.g. [\"attention\", \"mlp\"]")
    chosen: dict[str, None] = {}
    for pattern in patterns:
        if pattern == "experts":
            raise LoRAError("trainer.lora.target_modules: \"experts\": adapters on MoE experts (3D expert "
                            "tensors) are not supported yet; use \"attention\", \"mlp\" (shared experts) or globs")
        if pattern in (OUTPUT, head) and pattern:
            if not head:
                raise LoRAError(f"trainer.lora.target_modules: {pattern!r}: the output layer of this "
                                f"{type(model).__name__} is not a linear layer, so it cannot take an adapter")
            chosen[head] = None
            continue
        if pattern in GROUPS:
            hits = [n for n in linears if _in_group(n, pattern)]
        else:
            hits = [n for n in linears if fnmatch.fnmatchcase(n, pattern) or n.rsplit(".", 1)[-1] == pattern]
        if not hits and pattern not in GROUPS:
            leaves = sorted({n.rsplit(".", 1)[-1] for n in linears})
            raise LoRAError(f"trainer.lora.target_modules: {pattern!r} selects no linear layer of this "
                            f"{type(model).__name__} (its decoder's linear layers: {', '.join(leaves) or 'none'}; "
                            f"its output layer: {OUTPUT})")
        chosen.update(dict.fromkeys(hits))
    if not chosen:
        leaves = sorted({n.rsplit(".", 1)[-1] for n in linears})
        raise LoRAError(f"trainer.lora.target_modules: {patterns} select no linear layer of this "
                        f"{type(model).__name__} (its decoder's linear layers: {', '.join(leaves) or 'none'})")
    return list(chosen)


def peft_config(model: nn.Module, cfg: LoRAConfig, base_path: str = "") -> Any:
    """The ``peft.LoraConfig`` of ``cfg`` for ``model`` (explicit module names, a causal LM)."""
    from peft import LoraConfig

    names = target_modules(model, list(cfg.target_modules))
    return LoraConfig(r=cfg.r, lora_alpha=cfg.alpha,  # type: ignore[arg-type]  # peft says int; uses alpha / r
                      lora_dropout=cfg.dropout, target_modules=names, bias="none", task_type="CAUSAL_LM",
                      base_model_name_or_path=base_path or None)


def apply_lora(model: nn.Module, cfg: LoRAConfig, base_path: str = "") -> Any:
    """Inject ``cfg``'s adapters into ``model`` in place and freeze every other parameter; returns the
    ``peft.LoraConfig`` used. Adapters start as an identity (B = 0), so version 0 is the base model."""
    from peft import inject_adapter_in_model

    config = peft_config(model, cfg, base_path)
    head = output_layer(model)
    if head in config.target_modules and output_is_tied(model) and cfg.serve == "merged":
        raise LoRAError("trainer.lora.target_modules: \"lm_head\" on a model whose output layer is tied to its "
                        "input embedding needs trainer.lora.serve = \"adapter\": the merged weights cannot carry "
                        "it (an engine that loads a tied model loads one tensor for both)")
    device = next(model.parameters()).device
    with warnings.catch_warnings():  # PEFT's advice to tie an adapter on a tied LM head to the embedding too: the
        # adapter is meant for the output alone (the merged weights and the engines untie the head instead)
        warnings.filterwarnings("ignore", message=".*tie_word_embeddings=True.*")
        inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    model.to(device)
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
    return config


def is_adapter(name: str) -> bool:
    """Whether parameter ``name`` belongs to a LoRA adapter."""
    return any(k in name for k in ADAPTER_KEYS)


def lora_layers(model: nn.Module) -> dict[str, Any]:
    """Module name -> PEFT LoRA layer, for every adapted linear layer."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict under the base model's names with every adapter merged in (W + scale * B A, computed
    in fp32, stored in W's dtype); adapter tensors left out. Tied tensors stay one storage."""
    layers = lora_layers(model)
    merged = {f"{name}.weight": _merged_weight(layer) for name, layer in layers.items()}
    out: dict[str, torch.Tensor] = {}
    for key, t in model.state_dict().items():
        if is_adapter(key):
            continue
        name = key.replace(".base_layer.", ".")
        out[name] = merged.get(name, t)
    return out


def _merged_weight(layer: Any) -> torch.Tensor:
    """W + delta of a peft ``LoraLayer`` (its base an ``nn.Linear``)."""
    base: torch.Tensor = layer.get_base_layer().weight
    delta: torch.Tensor = layer.get_delta_weight(ADAPTER)
    return (base.float() + delta.float()).to(base.dtype)


class MergedView(nn.Module):
    """What the weight transports export for a LoRA model: its ``config`` and ``state_dict()`` with the adapters
    merged under the base names (computed once per view; make one per send). ``save_adapter(directory)`` writes
    the adapter alone instead (``serve = "adapter"``)."""

    def __init__(self, model: nn.Module, lora_config: Any) -> None:
        super().__init__()
        self.config = _merged_config(model)
        self._model = [model]  # a list: not registered as a submodule
        self._lora_config = lora_config
        self._state: dict[str, torch.Tensor] | None = None

    def save_adapter(self, directory: str | Path) -> Path:
        return save_adapter(self._model[0], self._lora_config, directory)

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        if self._state is None:
            self._state = merged_state_dict(self._model[0])
        return self._state


def _merged_config(model: nn.Module) -> Any:
    """The merged model's config: the model's, untied when an adapter on a tied output layer makes the merged LM
    head differ from the input embedding (so what loads the merged weights keeps both)."""
    import copy

    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel):
        return model.config
    head = model.get_output_embeddings()  # type: ignore[no-untyped-call]  # transformers
    embed = model.get_input_embeddings()
    layer = next((m for m in lora_layers(model).values() if m is head), None)
    if layer is None or not isinstance(embed, nn.Embedding) or layer.get_base_layer().weight is not embed.weight:
        return model.config
    config = copy.deepcopy(model.config)
    for c in {id(c): c for c in (config, config.get_text_config())}.values():
        c.tie_word_embeddings = False
    return config


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors under PEFT's saved names (``base_model.model.<module>.lora_A.weight``)."""
    from peft import get_peft_model_state_dict

    # save_embedding_layers=False: an adapter on the output layer saves its A and B, never the layer's base weight
    state = get_peft_model_state_dict(model, adapter_name=ADAPTER, save_embedding_layers=False)
    return {f"base_model.model.{k}": v.detach().to("cpu").contiguous() for k, v in state.items()}


def save_adapter(model: nn.Module, config: Any, directory: str | Path, base_path: str = "") -> Path:
    """Write the adapter in PEFT's format to ``directory`` (``adapter_config.json`` naming ``base_path`` as the base
    model, ``adapter_model.safetensors``), replacing what is there; returns it."""
    import shutil

    from safetensors.torch import save_file

    out = Path(directory)
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if base_path:
        config.base_model_name_or_path = str(base_path)
    config.save_pretrained(str(tmp))
    save_file(adapter_state_dict(model), str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """``parameters`` (every parameter the trainer holds, adapters included) and ``trainable_parameters`` (those
    with gradients and optimizer state), the counts ``summary.json`` reports."""
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return {"parameters": total, "trainable_parameters": trainable}


def check_tied_output(cfg: RunConfig, model_dir: str | Path | None) -> None:
    """Refuse, in one line before training starts, an adapter on a tied output layer (``lm_head`` in
    ``target_modules``; ``model_dir``'s ``tie_word_embeddings`` true, or None: the demo's tiny model, tied) with
    ``serve = "merged"`` (the trainer refuses it too, from the model itself)."""
    import json

    lora = cfg.trainer.lora
    if not lora.on or lora.serve != "merged" or OUTPUT not in lora.target_modules:
        return
    path = Path(model_dir) / "config.json" if model_dir is not None else None
    config = json.loads(path.read_text()) if path is not None and path.is_file() else {}
    if config.get("tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings", True)):
        raise LoRAError(f"trainer.lora.target_modules: \"lm_head\" on a model whose output layer is tied to its input "
                        f"embedding ({path or 'the demo model'}) needs trainer.lora.serve = \"adapter\": the merged "
                        f"weights cannot carry it (an engine that loads a tied model loads one tensor for both)")


def check_run(cfg: RunConfig) -> None:
    """Refuse, in one line, run settings LoRA does not work with yet (``cfg`` a ``RunConfig``)."""
    import importlib.util

    lora, tc = cfg.trainer.lora, cfg.trainer
    if not lora.on:
        return
    if importlib.util.find_spec("peft") is None:
        raise LoRAError("trainer.lora needs PEFT, which is not installed: pip install 'peft>=0.17'")
    if tc.gpus > 1:
        raise LoRAError("trainer.lora with trainer.gpus > 1 (FSDP2) is not supported yet: use one trainer GPU")
    if tc.mtp == "train":
        raise LoRAError("trainer.lora with trainer.mtp = \"train\" is not supported: the MTP head would train in "
                        "full beside the adapters; use trainer.mtp = \"frozen\" or \"off\"")
    if lora.serve == "adapter" and cfg.engine.type == "sglang":
        raise LoRAError("trainer.lora.serve = \"adapter\": SGLang's adapter routes are not wired yet; use "
                        "trainer.lora.serve = \"merged\" (the merged weights, any engine)")
    if lora.serve == "adapter" and cfg.engine.weight_sync != "filesystem":
        raise LoRAError("trainer.lora.serve = \"adapter\" sends adapter files: it needs engine.weight_sync = "
                        "\"filesystem\"; use trainer.lora.serve = \"merged\" with nccl")
