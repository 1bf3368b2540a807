"""Multi-token prediction (MTP) heads: loaded from the checkpoint instead of dropped, with a forward.

transformers 5.x drops the MTP weights of ``qwen3_next`` / ``qwen4_exp`` (``mtp.*``) and of the GLM families
(DeepSeek-V3 layout: the MTP layer stored as decoder layer ``model.layers.{num_hidden_layers}``) at load, and
has no forward for them. One MTP module (what vLLM / SGLang run for these families) predicts token ``t + 2``
at position ``t`` from the decoder's final hidden state ``h_t`` and the embedding of token ``t + 1``:

    x = fc(concat(norm_e(embed(x_{t+1})), norm_h(h_t)))       # [2D] -> [D], no bias
    g = norm(layer(x))                                         # one decoder layer of the family, causal
    logits_{t+2} = lm_head(g)                                  # the model's own (shared) head

The layer is the family's own attention decoder layer (its attention, indexer, MoE, hyper-connections),
run through a one-layer copy of the family's decoder model, so rotary embeddings, masks and caches are the
family's. ``Mtp`` is registered as ``model.mtp``: the trainer's optimizer, checkpoints and the engine's
weight swaps see its parameters like any other (``mtp.*``); the shared embedding and LM head are read
detached, so a loss on the MTP head never moves the policy.

Checkpoint names (vLLM's loaders): ``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``,
``mtp.layers.0.*``, ``mtp.norm`` (Qwen; config ``mtp_num_hidden_layers``); ``model.layers.{N}.eh_proj``,
``enorm``, ``hnorm``, ``shared_head.norm``, ``shared_head.head`` (a copy of the LM head) and the layer's own
``model.layers.{N}.*`` (DeepSeek layout; config ``num_nextn_predict_layers``). Experts are stored one tensor
per expert on disk and fused in transformers' modules; ``load_mtp`` / ``save_mtp`` convert both ways.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# families with an MTP head -> checkpoint layout
MTP_LAYOUT: dict[str, str] = {"qwen3_next": "qwen", "qwen4_exp": "qwen", "glm_moe_dsa": "deepseek",
                              "glm5_next": "deepseek"}
MTP_FILE = "mtp.safetensors"
# internal name (inside ``mtp.``) <-> DeepSeek-layout name (inside ``model.layers.{N}.``)
_DEEPSEEK_NAMES = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm",
                   "norm": "shared_head.norm"}
# config keys that hold one entry per decoder layer (the MTP layer takes the last attention layer's)
_PER_LAYER_KEYS = ("layer_types", "mlp_layer_types", "indexer_types")


class MtpError(ValueError):
    """A model or checkpoint without the MTP head it was asked for."""


def _text_config(model: Any) -> Any:
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def mtp_family(model: Any) -> str:
    """``model``'s family (``albatross.models.family``)."""
    from albatross.models import family

    return family(model)


def num_mtp_layers(config: Any) -> int:
    """MTP layers a config declares: ``mtp_num_hidden_layers`` (Qwen) or ``num_nextn_predict_layers`` (DeepSeek
    layout); 0 when neither is set."""
    for key in ("mtp_num_hidden_layers", "num_nextn_predict_layers"):
        value = getattr(config, key, None)
        if value:
            return int(value)
    return 0


def _attention_index(config: Any) -> int:
    """Index of the last decoder layer that is attention (not linear attention): the MTP layer's kind."""
    types = list(getattr(config, "layer_types", None) or [])
    for i in range(len(types) - 1, -1, -1):
        if "linear" not in str(types[i]):
            return i
    return int(config.num_hidden_layers) - 1


def layer_config(config: Any) -> Any:
    """A one-layer copy of the (text) ``config`` whose layer is the family's attention + MoE layer."""
    cfg = copy.deepcopy(config)
    i = _attention_index(config)
    for key in _PER_LAYER_KEYS:
        values = getattr(config, key, None)
        if isinstance(values, list) and len(values) == config.num_hidden_layers:
            setattr(cfg, key, [values[i]])
    cfg.num_hidden_layers = 1
    for key, value in (("mlp_only_layers", []), ("first_k_dense_replace", 0), ("decoder_sparse_step", 1),
                       ("ple_layer_ids", [])):
        if hasattr(cfg, key):
            setattr(cfg, key, value)
    if isinstance(getattr(cfg, "mlp_layer_types", None), list) and getattr(config, "n_routed_experts", None):
        cfg.mlp_layer_types = ["sparse"]  # DeepSeek layout: the MTP layer is an MoE layer
    return cfg


class Mtp(nn.Module):
    """One MTP module of ``model``'s family (see the module docstring); ``model.mtp`` once ``attach_mtp`` ran."""

    _model: Any  # the transformers model the head belongs to (its embedding and LM head are read)
    _inner: nn.Module  # the one-layer decoder of the family

    def __init__(self, model: Any) -> None:
        super().__init__()
        text = _text_config(model)
        decoder = model.get_decoder()
        dim, eps = text.hidden_size, getattr(text, "rms_norm_eps", 1e-6)
        norm_cls = _norm_class(decoder, dim)
        self.family = mtp_family(model)
        self.layer_config = layer_config(text)
        inner = type(decoder)(self.layer_config)
        inner.embed_tokens = None  # the model's embedding is shared (read detached)
        self.pre_fc_norm_embedding = norm_cls(dim, eps=eps)
        self.pre_fc_norm_hidden = norm_cls(dim, eps=eps)
        self.fc = nn.Linear(2 * dim, dim, bias=False)
        # the one-layer decoder's parts (``layers``, ``norm``, rotary embedding, a hyper-connection head ...),
        # registered under their own names; the decoder itself stays outside the module tree and its forward
        # runs these same modules (rotary, masks, caches of the family)
        for name, child in inner.named_children():
            if child is not None and name != "embed_tokens":
                self.add_module(name, child)
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_model", model)

    def new_cache(self) -> Any:
        """An empty cache for this head's layer (engine drafting)."""
        from transformers import DynamicCache

        return DynamicCache(config=self.layer_config)

    def _embed(self, ids_BT: Tensor) -> Tensor:
        weight = self._model.get_input_embeddings().weight.detach()
        return F.embedding(ids_BT, weight)

    def head(self, g_BTD: Tensor) -> Tensor:
        """Logits of the MTP hidden states through the model's LM head (read detached)."""
        lm = self._model.get_output_embeddings()
        bias = lm.bias.detach() if getattr(lm, "bias", None) is not None else None
        return F.linear(g_BTD, lm.weight.detach(), bias)

    def hidden(self, hidden_BTD: Tensor, next_ids_BT: Tensor, position_ids: Tensor | None = None,
               cache: Any = None) -> Tensor:
        """The MTP layer's normed output ``g`` [B, T, D] for entries ``(h_t, x_{t+1})`` (one causal sequence,
        continuing ``cache`` when given)."""
        emb = self.pre_fc_norm_embedding(self._embed(next_ids_BT).to(hidden_BTD.dtype))
        x = self.fc(torch.cat([emb, self.pre_fc_norm_hidden(hidden_BTD)], dim=-1))
        if position_ids is None:
            start = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(start, start + x.shape[1], device=x.device)[None].expand(x.shape[0], -1)
        out = self._inner(inputs_embeds=x, position_ids=position_ids, cache=cache, use_cache=cache is not None)
        hidden: Tensor = out.last_hidden_state
        return hidden

    def forward(self, hidden_BTD: Tensor, next_ids_BT: Tensor, lengths: list[int] | None = None) -> Tensor:
        """Logits [B, T, V] at each position ``t`` for token ``t + 2``, given ``h_t`` and token ``t + 1``.

        ``lengths``: the documents of a packed row (batch 1); each runs alone, from position 0, so nothing
        crosses a boundary. An entry whose ``t + 1`` lies in the next document is the caller's to mask.
        """
        if not lengths or len(lengths) == 1:
            return self.head(self.hidden(hidden_BTD, next_ids_BT))
        if hidden_BTD.shape[0] != 1 or sum(lengths) != hidden_BTD.shape[1]:
            raise ValueError(f"a packed row is [1, T] with T = sum(lengths); got {tuple(hidden_BTD.shape)}, "
                             f"lengths summing to {sum(lengths)}")
        outs, start = [], 0
        for n in lengths:
            outs.append(self.hidden(hidden_BTD[:, start:start + n], next_ids_BT[:, start:start + n]))
            start += n
        return self.head(torch.cat(outs, dim=1))


def _norm_class(decoder: nn.Module, dim: int) -> type[nn.Module]:
    """The family's RMSNorm class (its final norm's, else one over ``dim`` channels, else its first)."""
    norm = getattr(decoder, "norm", None)  # transformers' decoder: its final norm, where it has one
    if norm is not None:
        return type(norm)
    norms = [m for m in decoder.modules() if type(m).__name__.endswith("RMSNorm")]
    for module in norms:  # prefer one over the hidden size; else the family's class at that size
        if tuple(getattr(module, "weight", torch.empty(0)).shape) == (dim,):
            return type(module)
    if norms:
        return type(norms[0])
    raise MtpError(f"{type(decoder).__name__}: no RMSNorm class to build the MTP norms from")


def get_mtp(model: Any) -> Mtp | None:
    mtp = getattr(model, "mtp", None)  # a transformers model; an ``mtp`` of its own is not an ``Mtp``
    return mtp if isinstance(mtp, Mtp) else None


def attach_mtp(model: Any) -> Mtp:
    """Give ``model`` a (randomly initialised) MTP head as ``model.mtp``, in the model's dtype and device;
    returns it. The family must have one; the config is marked with one MTP layer if it declares none."""
    name = mtp_family(model)
    if name not in MTP_LAYOUT:
        raise MtpError(f"model family {name!r} has no MTP head (families with one: {sorted(MTP_LAYOUT)})")
    existing = get_mtp(model)
    if existing is not None:
        return existing
    text = _text_config(model)
    if not num_mtp_layers(text):
        key = "mtp_num_hidden_layers" if MTP_LAYOUT[name] == "qwen" else "num_nextn_predict_layers"
        setattr(text, key, 1)
    param = next(model.parameters())
    mtp = Mtp(model).to(device=param.device, dtype=param.dtype)
    model.mtp = mtp
    return mtp


def mtp_forward(model: Any, hidden_BTD: Tensor, next_ids_BT: Tensor, lengths: list[int] | None = None) -> Tensor:
    """``model.mtp``'s logits [B, T, V] for token ``t + 2`` at each position (``Mtp.forward``)."""
    head = get_mtp(model)
    if head is None:
        raise MtpError(f"{type(model).__name__} has no MTP head (attach_mtp / load_mtp first)")
    logits: Tensor = head(hidden_BTD, next_ids_BT, lengths)
    return logits


def detach_mtp(model: Any) -> None:
    """Remove ``model.mtp`` (``trainer.mtp = "off"``)."""
    if get_mtp(model) is not None:
        del model.mtp


# ---------------------------------------------------------------------------------------------- weights


def _deepseek_prefix(model: Any) -> str:
    """``<decoder layers>.{num_hidden_layers}.``: where the DeepSeek layout stores the MTP layer (``model.layers``,
    or ``model.language_model.layers`` in a vision-language model)."""
    layers = model.get_decoder().layers
    path = next(name for name, module in model.named_modules() if module is layers)
    return f"{path}.{_text_config(model).num_hidden_layers}."


def _fuse_experts(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Per-expert ``experts.{e}.{gate,up,down}_proj.weight`` -> transformers' fused ``experts.gate_up_proj``
    [E, 2I, D] and ``experts.down_proj`` [E, D, I]; other names unchanged."""
    pattern = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
    groups: dict[str, dict[int, dict[str, Tensor]]] = {}
    out: dict[str, Tensor] = {}
    for name, t in tensors.items():
        m = pattern.match(name)
        if m is None:
            out[name] = t
            continue
        groups.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
    for prefix, experts in groups.items():
        order = [experts[e] for e in sorted(experts)]
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([x["gate"], x["up"]], dim=0) for x in order])
        out[f"{prefix}.down_proj"] = torch.stack([x["down"] for x in order])
    return out


def _split_experts(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The inverse of ``_fuse_experts``: the on-disk, one-tensor-per-expert names."""
    out: dict[str, Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(".experts.gate_up_proj"):
            prefix, half = name.removesuffix(".gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.gate_proj.weight"] = t[e, :half].contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = t[e, half:].contiguous()
        elif name.endswith(".experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            for e in range(t.shape[0]):
                out[f"{prefix}.{e}.down_proj.weight"] = t[e].contiguous()
        else:
            out[name] = t
    return out


def _renamings(family: str) -> list[tuple[str, str]]:
    """The family's plain checkpoint -> module renames (transformers' ``WeightRenaming`` entries), as
    ``(source, target)`` regex / replacement pairs; expert fusing is ``_fuse_experts``'."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    pairs = []
    for op in get_checkpoint_conversion_mapping(family) or []:  # type: ignore[no-untyped-call]  # transformers leaves it unannotated
        if type(op).__name__ != "WeightRenaming":
            continue
        sources, targets = list(op.source_patterns), list(op.target_patterns)
        if len(sources) == 1 and len(targets) == 1:
            pairs.append((sources[0], targets[0].replace("\\", "")))
    return pairs


def _rename(names: dict[str, Tensor], pairs: list[tuple[str, str]], reverse: bool = False) -> dict[str, Tensor]:
    out = {}
    for name, t in names.items():
        for source, target in pairs:
            if reverse:
                name = name.replace(target, source.replace("\\", ""))
            else:
                name = re.sub(source, target, name)
        out[name] = t
    return out


def _to_internal(model: Any, name: str) -> str | None:
    """A checkpoint tensor name -> the name inside ``model.mtp`` (None: not an MTP tensor, or a shared one)."""
    if name.startswith("mtp."):
        return name.removeprefix("mtp.")
    prefix = _deepseek_prefix(model)
    if MTP_LAYOUT.get(mtp_family(model)) != "deepseek" or not name.startswith(prefix):
        return None
    rest = name.removeprefix(prefix)
    if rest.startswith(("embed_tokens.", "shared_head.head.")):  # copies of the shared embedding / LM head
        return None
    for internal, stored in _DEEPSEEK_NAMES.items():
        if rest.startswith(stored + "."):
            return internal + rest.removeprefix(stored)
    return "layers.0." + rest


def _checkpoint_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    files = set(directory.glob("*.safetensors"))
    if index.is_file():
        files |= {directory / f for f in json.loads(index.read_text()).get("weight_map", {}).values()}
    return sorted(f for f in files if f.is_file())


def _read_mtp_tensors(model: Any, directory: Path) -> dict[str, Tensor]:
    from safetensors import safe_open

    found: dict[str, Tensor] = {}
    for file in _checkpoint_files(directory):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                internal = _to_internal(model, key)
                if internal is not None:
                    found[internal] = f.get_tensor(key)
    return _fuse_experts(_rename(found, _renamings(mtp_family(model))))


def load_mtp(model: Any, directory: str | Path, required: bool = True) -> int:
    """Read ``model``'s MTP weights from the safetensors of checkpoint ``directory`` into ``model.mtp``
    (attached first); returns how many tensors were loaded. Every MTP parameter must be in the checkpoint.

    ``required=False``: a checkpoint without MTP weights loads nothing (returns 0, ``model`` unchanged)."""
    directory = Path(directory)
    name = mtp_family(model)
    if name not in MTP_LAYOUT:
        if required:
            raise MtpError(f"{directory}: model family {name!r} has no MTP head (families with one: "
                           f"{sorted(MTP_LAYOUT)})")
        return 0
    had = get_mtp(model) is not None
    mtp = attach_mtp(model)
    tensors = _read_mtp_tensors(model, directory)
    if not tensors:
        if not had:
            detach_mtp(model)
        if required:
            raise MtpError(f"{directory}: no MTP weights in the checkpoint (expected 'mtp.*' or "
                           f"'{_deepseek_prefix(model)}*')")
        return 0
    own = mtp.state_dict()
    missing = sorted(set(own) - set(tensors))
    unexpected = sorted(set(tensors) - set(own))
    bad = [k for k in own if k in tensors and tuple(tensors[k].shape) != tuple(own[k].shape)]
    if missing or unexpected or bad:
        raise MtpError(f"{directory}: MTP weights do not match the model: missing {missing[:4]}, unexpected "
                       f"{unexpected[:4]}, shape mismatch {bad[:4]}")
    mtp.load_state_dict({k: v.to(own[k].dtype) for k, v in tensors.items()})
    return len(tensors)


def mtp_checkpoint_tensors(model: Any) -> dict[str, Tensor]:
    """``model.mtp``'s weights under the checkpoint's names (per-expert tensors; DeepSeek layout with copies
    of the shared embedding and LM head, as DeepSeek / GLM checkpoints store them)."""
    mtp = get_mtp(model)
    if mtp is None:
        raise MtpError(f"{type(model).__name__} has no MTP head to save")
    own = _split_experts({k: v.detach().cpu().contiguous() for k, v in mtp.state_dict().items()})
    own = _rename(own, _renamings(mtp.family), reverse=True)
    if MTP_LAYOUT[mtp.family] == "qwen":
        return {f"mtp.{k}": v for k, v in own.items()}
    prefix, out = _deepseek_prefix(model), {}
    for k, v in own.items():
        head, _, rest = k.partition(".")
        name = f"{_DEEPSEEK_NAMES[head]}.{rest}" if head in _DEEPSEEK_NAMES else k.removeprefix("layers.0.")
        out[prefix + name] = v
    out[prefix + "embed_tokens.weight"] = model.get_input_embeddings().weight.detach().cpu().clone()
    out[prefix + "shared_head.head.weight"] = model.get_output_embeddings().weight.detach().cpu().clone()
    return out


def save_mtp(model: Any, directory: str | Path) -> Path:
    """Write ``model.mtp`` into checkpoint ``directory`` (``mtp.safetensors``, checkpoint names; added to
    ``model.safetensors.index.json`` when the checkpoint is sharded); returns the file."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = mtp_checkpoint_tensors(model)
    path = directory / MTP_FILE
    save_file(tensors, str(path), metadata={"format": "pt"})
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data.setdefault("weight_map", {}).update(dict.fromkeys(tensors, MTP_FILE))
        index.write_text(json.dumps(data, indent=2) + "\n")
    return path


def save_pretrained_with_mtp(model: Any, directory: str | Path) -> None:
    """``save_pretrained`` without ``mtp.*`` in the main file, then ``save_mtp``: a checkpoint laid out as the
    family's own (what vLLM / SGLang load)."""
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("mtp.")}
    model.save_pretrained(directory, state_dict=state)
    save_mtp(model, directory)


# ---------------------------------------------------------------------------------------------- training


def mtp_loss(mtp: Mtp, hidden_1TD: Tensor, input_ids_1T: Tensor, lengths: list[int], mask_T: Tensor,
             num_batch_tokens: int) -> tuple[Tensor, dict[str, float]]:
    """The auxiliary next-next-token cross-entropy of a packed row, on DETACHED decoder hidden states.

    Position ``t`` of a document predicts token ``t + 2`` of the same document from ``h_t`` and token
    ``t + 1``; ``mask_T[t]`` (the row's loss mask, aligned with targets ``t + 1``) selects positions whose
    token ``t + 2`` counts: ``mask_T[t + 1]``. Summed over them and divided by ``num_batch_tokens`` like the
    policy loss. Returns the loss and ``mtp_loss`` (mean CE) / ``mtp_accuracy`` (argmax hits) / ``mtp_tokens``.
    """
    T = input_ids_1T.shape[1]
    hidden = hidden_1TD.detach()
    next_ids = torch.cat([input_ids_1T[:, 1:], input_ids_1T[:, -1:]], dim=1)
    target = torch.cat([input_ids_1T[0, 2:], input_ids_1T.new_zeros(2)])
    valid = torch.zeros(T, dtype=torch.bool, device=input_ids_1T.device)
    start = 0
    for n in lengths:
        valid[start:start + max(n - 2, 0)] = True
        start += n
    weight = torch.zeros(T, dtype=torch.float32, device=valid.device)
    weight[:-1] = mask_T[1:].float().to(valid.device)
    weight = weight * valid
    logits = mtp(hidden, next_ids, lengths).float()[0]
    ce = F.cross_entropy(logits, target, reduction="none")
    loss = (ce * weight).sum() / max(num_batch_tokens, 1)
    tokens = float(weight.sum())
    hits = float(((logits.argmax(-1) == target).float() * weight).sum())
    mean_ce = float((ce.detach() * weight).sum()) / tokens if tokens else 0.0
    return loss, {"mtp_loss": mean_ce, "mtp_accuracy": hits / tokens if tokens else 0.0, "mtp_tokens": tokens}
