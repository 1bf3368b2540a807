"""Packing exactness: log-probs of documents packed in one row vs each document alone (fp32).

Several documents of different lengths go through the trainer's own log-prob path (``pack``'s row
layout, ``attention_inputs`` document masking, ``TokenLogprobs``) twice: packed together in one row,
and one by one. Exact packing gives the same log-prob for every token either way;
``max_abs_logprob_diff`` is the largest difference (target <= 1e-5). Each model is measured twice:
``as_shipped`` (the transformers modules as they come) and ``albatross`` (after
``albatross.models.prepare_for_packing``), so the table shows the leak the packed-aware layers fix.
Without ``--model`` it builds a tiny random model of each supported family (``albatross.models.tiny``).
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from typing import Any

from albatross.bench.common import print_table, write_json
from albatross.errors import UserError

DOC_LENGTHS = (37, 64, 23, 50)  # tokens of each packed document; not multiples of any chunk size
TARGET = 1e-5


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="DIR", help="a local causal LM directory (default: tiny models of "
                   "every supported family)")
    p.add_argument("--lengths", default=",".join(map(str, DOC_LENGTHS)),
                   help="comma-separated document lengths (default %(default)s)")


def documents(lengths: tuple[int, ...], vocab: int, seed: int = 0) -> list[list[int]]:
    """Random token documents (ids 3..vocab-1, so no special token ends one early)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def _micro_batch(docs: list[list[int]]) -> Any:
    from albatross.records import Sample, TrainSample
    from albatross.trainer.packing import pack

    samples = [TrainSample(Sample(token_ids=d, loss_mask=[1] * len(d), logprobs=[0.0] * len(d),
                                  versions=[0] * len(d)), 0.0) for d in docs]
    (mb,) = pack(samples, max_tokens=sum(len(d) for d in docs))
    # pack orders by sample index within a bin, so the row holds the documents in the given order
    return mb


def trainer_logprobs(model: Any, docs: list[list[int]], attention: str = "auto", exact: bool = True) -> Any:
    """Per-target log-probs [T] of ``docs`` packed in one row, through the trainer's path (no grad).

    ``exact=False`` leaves the model's modules as transformers ships them (``TokenLogprobs``'s
    ``exact_packing``); True applies ``prepare_for_packing`` (for good: it changes ``model``).
    """
    import torch

    from albatross.trainer.logprobs import TokenLogprobs
    from albatross.trainer.packing import attention_inputs

    mb = _micro_batch(docs)
    inputs = attention_inputs(model, attention)
    policy = TokenLogprobs(model, chunk_size=64, exact_packing=exact)
    with torch.no_grad():
        logp, _ = policy(mb.input_ids, mb.position_ids, mb.targets, **inputs(mb, torch.float32, torch.device("cpu")))
    return logp


def packed_vs_single(model: Any, docs: list[list[int]], attention: str = "auto", exact: bool = True) -> float:
    """Largest |log-prob packed - log-prob alone| over every target of every document."""
    import torch

    packed = trainer_logprobs(model, docs, attention, exact)
    alone = torch.cat([trainer_logprobs(model, [d], attention, exact) for d in docs])
    return float((packed - alone).abs().max())


def as_shipped(model: Any, docs: list[list[int]]) -> tuple[float, str]:
    """The diff before ``prepare_for_packing``: the trainer's varlen masking, or, where transformers
    refuses packed boundaries (no flash-linear-attention kernel), a dense block-causal mask."""
    try:
        return packed_vs_single(model, docs, exact=False), "varlen"
    except (ValueError, NotImplementedError):
        return packed_vs_single(model, docs, attention="dense", exact=False), "dense"


def reference_logprobs(model: Any, docs: list[list[int]]) -> Any:
    """transformers' own forward on each document alone (its ``sdpa`` attention), [T] log-probs."""
    import torch

    impl = model.config._attn_implementation  # transformers' own name for it (there is no public getter)
    model.set_attn_implementation("sdpa")
    out = []
    try:
        with torch.no_grad():
            for d in docs:
                # inputs d[:-1] exactly as the trainer feeds them: a DSA indexer's top-k breaks ties among
                # zero scores differently at another length, so a longer input is not a valid reference
                ids = torch.tensor([d])
                logits = model(input_ids=ids[:, :-1], use_cache=False).logits[0].float()
                out.append(logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0])
    finally:
        model.set_attn_implementation(impl)
    return torch.cat(out)


def measure(model: Any, docs: list[list[int]]) -> dict[str, Any]:
    """The diff as transformers ships ``model``, then after ``prepare_for_packing`` (which mutates it),
    and how far albatross' packed log-probs are from transformers' forward on each document alone."""
    from albatross.models import family

    reference = reference_logprobs(model, docs)
    shipped, mode = as_shipped(model, docs)
    exact = packed_vs_single(model, docs)
    vs_ref = float((trainer_logprobs(model, docs) - reference).abs().max())
    return {"family": family(model), "max_abs_logprob_diff": exact, "as_shipped_max_abs_logprob_diff": shipped,
            "as_shipped_attention": mode, "max_abs_diff_vs_transformers_alone": vs_ref,
            "exact": max(exact, vs_ref) <= TARGET}


def _rows(results: dict[str, dict[str, Any]]) -> list[tuple[str, Any]]:
    rows: list[tuple[str, Any]] = []
    for name, r in results.items():
        rows += [(f"{name} as shipped ({r['as_shipped_attention']})", r["as_shipped_max_abs_logprob_diff"]),
                 (f"{name} albatross", r["max_abs_logprob_diff"]),
                 (f"{name} albatross vs transformers alone", r["max_abs_diff_vs_transformers_alone"])]
    return rows


def _lengths(text: str) -> tuple[int, ...]:
    parts = text.split(",")
    if not all(p.strip().isdigit() and int(p) >= 2 for p in parts):
        raise UserError(f"bench packing: --lengths {text!r}: expected comma-separated integers >= 2")
    return tuple(int(p) for p in parts)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from albatross.models.tiny import FAMILIES, TEXT_VOCAB, tiny_model

    torch.set_num_threads(1)  # tiny models: thread overhead dominates

    lengths = _lengths(str(args.lengths or ",".join(map(str, DOC_LENGTHS))))
    model_dir = args.model
    if model_dir:
        from albatross.models.tiny import load_any

        if not (Path(model_dir) / "config.json").is_file():
            raise UserError(f"bench packing: --model {model_dir}: no config.json (not a model directory)")
        model = load_any(model_dir, dtype=torch.float32).eval()
        vocab = min(model.config.get_text_config().vocab_size, TEXT_VOCAB)
        r = measure(model, documents(lengths, vocab))
        results: dict[str, Any] = {"model": str(model_dir), **r, "doc_lengths": list(lengths)}
        print_table("albatross bench packing (log-prob diff, packed vs alone, fp32)", _rows({r["family"]: r}))
    else:
        fams = {f: measure(tiny_model(f), documents(lengths, TEXT_VOCAB)) for f in FAMILIES}
        results = {"families": fams, "doc_lengths": list(lengths),
                   "max_abs_logprob_diff": max(r["max_abs_logprob_diff"] for r in fams.values())}
        print_table("albatross bench packing (log-prob diff, packed vs alone, fp32)", _rows(fams))
    write_json(args.json, results)
    return results
