"""LoRA adapters as weight versions (``[trainer.lora] serve = "adapter"``): what the engines read.

The trainer writes each version's adapter in PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``
with ``base_model.model.<module>.lora_A.weight`` [r, in] and ``lora_B.weight`` [out, r]). vLLM loads it by path
through its LoRA routes; the built-in engine merges it into the base weights it holds (``merged_weights``):
``W = W_base + scale * B @ A`` with ``scale = alpha / r`` (``alpha / sqrt(r)`` with rsLoRA), computed in fp32 and
stored in the base's dtype, as PEFT's own merge does.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."


def is_adapter_dir(path: str | Path) -> bool:
    """Whether ``path`` holds a PEFT adapter (not a full checkpoint)."""
    return (Path(path) / CONFIG).is_file()


def adapter_config(path: str | Path) -> dict[str, Any]:
    """The adapter's ``adapter_config.json``."""
    config: dict[str, Any] = json.loads((Path(path) / CONFIG).read_text())
    return config


def adapter_rank(path: str | Path) -> int:
    """The adapter's rank ``r``."""
    return int(adapter_config(path)["r"])


def _scale(config: dict[str, Any], path: Path) -> float:
    if config.get("use_dora") or config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(f"{path / CONFIG}: DoRA and per-module rank_pattern / alpha_pattern are not supported")
    if config.get("fan_in_fan_out"):
        raise ValueError(f"{path / CONFIG}: fan_in_fan_out adapters (Conv1D layers) are not supported")
    r, alpha = int(config["r"]), float(config["lora_alpha"])
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def read_adapter(path: str | Path) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], float]:
    """The adapter in ``path``: base weight name (``<module>.weight``) -> (A, B), and its scale."""
    from safetensors.torch import load_file

    root = Path(path)
    scale = _scale(adapter_config(root), root)
    tensors = load_file(str(root / WEIGHTS))
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key[: -len(".lora_A.weight")].removeprefix(PREFIX)
        b = tensors.get(key.replace(".lora_A.", ".lora_B."))
        if b is None:
            raise ValueError(f"{root / WEIGHTS}: {key} has no lora_B")
        pairs[f"{module}.weight"] = (a, b)
    if not pairs:
        raise ValueError(f"{root / WEIGHTS}: no lora_A / lora_B tensors")
    return pairs, scale


def merged_weights(base: dict[str, torch.Tensor], pairs: dict[str, tuple[torch.Tensor, torch.Tensor]],
                   scale: float, path: str | Path = "adapter") -> dict[str, torch.Tensor]:
    """The weights an adapter (``read_adapter(path)``) touches, merged into ``base`` (base weight name -> tensor);
    a name the base lacks or a shape that does not fit is a ``ValueError``."""
    out: dict[str, torch.Tensor] = {}
    for name, (a, b) in pairs.items():
        w = base.get(name)
        if w is None:
            raise ValueError(f"{path}: the adapter targets {name}, which the engine's model does not have")
        if (b.shape[0], a.shape[1]) != tuple(w.shape):
            raise ValueError(f"{path}: {name}: adapter of shape {b.shape[0]}x{a.shape[1]}, weight {tuple(w.shape)}")
        delta = b.to(w.device, torch.float32) @ a.to(w.device, torch.float32)
        out[name] = (w.float() + scale * delta).to(w.dtype)
    return out
