"""MTP speculative decoding for the hybrid families: the model's multi-token-prediction head drafts, one
forward pass of the model verifies.

Each request (run alone, as in ``hybrid.HybridRunner``) keeps, besides its cache, a cache of the MTP head's
layer (``models/mtp.py``). After every forward pass of the model, each position ``p`` whose next token is
known becomes an MTP entry ``(h_p, x_{p+1})``; the head's output at the last entry drafts ``d_1`` (argmax),
and ``d_2..d_k`` follow autoregressively from the head's own output (temporary entries, cropped after). The
next forward pass runs ``[last token, d_1..d_k]`` and ``speculative.verify`` accepts / rejects the drafts
exactly as for n-gram drafts (a greedy draft is a point mass q, so sampled tokens are distributed exactly as
without speculation, and greedy rows give the greedy output).

A recurrent state (linear attention, conv windows) cannot be cut back. Before a verifying pass the
request's recurrent states are copied and its KV length noted; when a draft is rejected they are put back
and the KV cropped, and the accepted tokens wait (``pending``) to run at the head of the next pass, so each
step is still one forward pass of the model. The hidden states of the accepted positions are those of the
verifying pass (the same prefix, so the same values).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from albatross.engine.builtin.hybrid import SequenceRunner, _HybridSeq, new_hybrid_cache
from albatross.engine.builtin.runner import Decode, Done, Request
from albatross.engine.builtin.sampling import (
    log_distribution,
    sample,
)
from albatross.engine.builtin.speculative import verify


@dataclass
class _CacheState:
    """What a pass may have to undo: copies of the recurrent states, and each KV layer's length."""

    recurrent: list[tuple[Any, dict[int, torch.Tensor], dict[int, torch.Tensor]]]
    kv: list[tuple[Any, int]]


def snapshot(cache: Any) -> _CacheState:
    """Copy ``cache``'s recurrent states and note its KV layers' lengths (cheap: no KV copied)."""
    recurrent, kv = [], []
    for layer in cache.layers:
        if hasattr(layer, "recurrent_states"):  # transformers' linear-attention cache layers have it
            conv = {i: t.clone() for i, t in layer.conv_states.items() if isinstance(t, torch.Tensor)}
            rec = {i: t.clone() for i, t in layer.recurrent_states.items() if isinstance(t, torch.Tensor)}
            recurrent.append((layer, conv, rec))
        else:
            kv.append((layer, layer.get_seq_length()))
    return _CacheState(recurrent, kv)


def restore(state: _CacheState) -> None:
    """Put ``cache`` back as ``snapshot`` found it."""
    for layer, conv, rec in state.recurrent:
        for i, t in conv.items():
            layer.conv_states[i].copy_(t)
        for i, t in rec.items():
            layer.recurrent_states[i].copy_(t)
    for layer, length in state.kv:
        extra = layer.get_seq_length() - length
        if extra > 0:
            layer.crop(-extra)


@dataclass
class _SpecCache:
    """A finished request's caches for the next turn: the model's (prompt + completion but the last token),
    the MTP head's (entries of every position but the last) and the hidden state of that last position."""

    target: Any
    mtp: Any
    last_hidden: torch.Tensor


@dataclass
class _MtpSeq(_HybridSeq):
    mtp_cache: Any = None
    mtp_len: int = 0  # MTP entries in mtp_cache (positions 0..mtp_len-1)
    cache_len: int = 0  # tokens in the model's cache
    last_hidden: torch.Tensor | None = None  # hidden state of position cache_len - 1
    pending: list[int] = field(default_factory=list)  # accepted tokens not in the model's cache yet
    drafts: list[int] = field(default_factory=list)
    mtp_out: torch.Tensor | None = None  # the head's output at its last entry [1, 1, D]


class MtpRunner(SequenceRunner[_MtpSeq]):
    """``hybrid.HybridRunner`` with MTP speculative decoding: ``draft_tokens`` drafts per request and step."""

    def __init__(
        self, model: torch.nn.Module, device: str | torch.device, version: int, prefix_cache_tokens: int,
        draft_tokens: int, decode: Decode | None = None,
    ) -> None:
        from albatross.models.mtp import get_mtp

        super().__init__(model, device, version, prefix_cache_tokens, None, decode, False)
        head = get_mtp(self.model)
        if head is None:
            raise ValueError("engine.speculative = \"mtp\": the model has no MTP head (load it with "
                             "albatross.models.mtp.load_mtp, or use a checkpoint with MTP weights)")
        if draft_tokens < 1:
            raise ValueError(f"draft_tokens must be >= 1, got {draft_tokens}")
        self.head = head.eval()
        self.draft_tokens = draft_tokens
        lm: Any = self.model  # a transformers causal LM: torch.nn.Module does not declare its methods
        self._decoder = lm.get_decoder()
        self._lm_head = lm.get_output_embeddings()

    # ------------------------------------------------------------------------------------------ passes

    def _hidden(self, seq: _MtpSeq, ids: Sequence[int]) -> torch.Tensor:
        """One forward pass of the decoder on ``ids`` after ``seq``'s cache; hidden states [1, L, D]."""
        ids_1L = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        pos_1L = torch.arange(seq.cache_len, seq.cache_len + len(ids), device=self.device)[None]
        self.stats.forward_passes += 1
        out = self._decoder(input_ids=ids_1L, position_ids=pos_1L, cache=seq.cache, use_cache=True)
        hidden_1LD: torch.Tensor = out.last_hidden_state
        return hidden_1LD

    def _feed(self, seq: _MtpSeq, start: int, hidden_1LD: torch.Tensor, tokens: Sequence[int]) -> torch.Tensor:
        """Add the MTP entries of positions ``start - 1 .. start + len(tokens) - 2`` not added yet.

        ``tokens`` are the true tokens at positions ``start ..``; ``hidden_1LD`` the model's hidden states at
        ``start ..`` (``seq.last_hidden`` is position ``start - 1``). Returns the head's output at the last
        entry [1, 1, D] (it drafts the token after ``tokens``)."""
        n = len(tokens)
        states = hidden_1LD[:, : n - 1]
        first = start
        if seq.last_hidden is not None and start > 0:
            states, first = torch.cat([seq.last_hidden, states], dim=1), start - 1
        skip = max(seq.mtp_len - first, 0)
        assert first + skip == seq.mtp_len, "MTP entries must stay contiguous"
        states = states[:, skip:]
        nexts = list(tokens)[first + skip + 1 - start:]
        if not nexts:
            assert seq.mtp_out is not None
            return seq.mtp_out
        ids = torch.tensor([nexts], dtype=torch.long, device=self.device)
        pos = torch.arange(seq.mtp_len, seq.mtp_len + len(nexts), device=self.device)[None]
        out = self.head.hidden(states, ids, position_ids=pos, cache=seq.mtp_cache)
        seq.mtp_len += len(nexts)
        seq.mtp_out = out[:, -1:]
        return seq.mtp_out

    def _propose(self, seq: _MtpSeq, out_11D: torch.Tensor, k: int) -> list[int]:
        """``k`` greedy drafts from the head's output at the last entry; temporary entries are cropped."""
        drafts = [int(self.head.head(out_11D)[0, -1].argmax())]
        for j in range(1, k):
            ids = torch.tensor([[drafts[-1]]], dtype=torch.long, device=self.device)
            pos = torch.tensor([[seq.mtp_len + j - 1]], device=self.device)
            out_11D = self.head.hidden(out_11D, ids, position_ids=pos, cache=seq.mtp_cache)
            drafts.append(int(self.head.head(out_11D)[0, -1].argmax()))
        if k > 1:
            seq.mtp_cache.crop(-(k - 1))
        return drafts

    def _budget(self, seq: _MtpSeq) -> int:
        return max(0, min(self.draft_tokens, seq.request.params.max_tokens - len(seq.ids) - 1))

    # ------------------------------------------------------------------------------------------ requests

    def admit(self, items: Sequence[tuple[Request, Done]]) -> None:
        """Prefill each request (from a snapshot when one holds a prefix), sample its first token, draft."""
        with torch.inference_mode():
            for request, done in items:
                seq = self._start(request, done, _MtpSeq)
                if seq is None:
                    continue
                found, seq.cached = self.snapshots.lookup(request.prompt_ids, self.version)
                if isinstance(found, _SpecCache):
                    seq.cache, seq.mtp_cache, seq.last_hidden = found.target, found.mtp, found.last_hidden
                    seq.cache_len, seq.mtp_len = seq.cached, max(seq.cached - 1, 0)
                else:
                    seq.cache, seq.mtp_cache, seq.cached = new_hybrid_cache(self.model), self.head.new_cache(), 0
                self.stats.cached_prompt_tokens += seq.cached
                new = request.prompt_ids[seq.cached:]
                hidden = self._hidden(seq, new)
                logits = self._lm_head(hidden[:, -1])
                reason = self._sample_append(seq, logits)
                start = seq.cache_len
                seq.cache_len += len(new)
                out = self._feed(seq, start, hidden, [*new, seq.last_id])
                seq.last_hidden = hidden[:, -1:]
                k = self._budget(seq)
                seq.drafts = self._propose(seq, out, k) if reason is None and k else []
                self._settle(seq, reason)

    def step(self) -> None:
        """One verifying forward pass per running request."""
        with torch.inference_mode():
            for seq in list(self.running):
                self.running.remove(seq)
                self._settle(seq, self._verify_step(seq))

    def _verify_step(self, seq: _MtpSeq) -> str | None:
        drafts = seq.drafts[: self._budget(seq)]
        inputs = [*seq.pending, seq.last_id, *drafts]
        state = snapshot(seq.cache) if drafts else None
        start = seq.cache_len
        hidden = self._hidden(seq, inputs)
        K, lead = len(drafts), len(seq.pending)
        accepted, final, logprobs = self._judge(seq, self._lm_head(hidden[0, lead:]), drafts)
        self.stats.draft_tokens += K
        self.stats.accepted_draft_tokens += accepted
        true = inputs[: lead + 1 + accepted]
        out = self._feed(seq, start, hidden, [*true, final])
        if accepted < K:  # a rejected draft ran through the recurrent states: undo the pass, keep its tokens
            assert state is not None
            restore(state)
            seq.pending = true
        else:
            seq.pending, seq.cache_len, seq.last_hidden = [], start + len(inputs), hidden[:, -1:]
        tokens = [*drafts[:accepted], final]
        seq.last_id = final
        reason = self._append(seq, tokens, logprobs)
        k = self._budget(seq)
        seq.drafts = self._propose(seq, out, k) if reason is None and k else []
        return reason

    def _judge(self, seq: _MtpSeq, logits_TV: torch.Tensor, drafts: list[int]) -> tuple[int, int, list[float]]:
        """Verify ``drafts`` against the logits of their positions (``T = K + 1``): the number accepted, the
        token drawn after them, and the log-probs of the accepted drafts and of that token."""
        assert seq.st is not None  # set when the request started (``_start``)
        index = torch.tensor([len(seq.ids)], device=self.device)
        K = len(drafts)
        if K == 0:
            ids_1, logprobs_1 = sample(logits_TV[-1:], seq.st, index)
            return 0, int(ids_1[0]), [float(logprobs_1[0])]
        logp_1TV = log_distribution(logits_TV, seq.st.repeat(K + 1)).view(1, K + 1, -1)
        drafts_1K = torch.tensor([drafts], dtype=torch.long, device=self.device)
        v = verify(logp_1TV, drafts_1K, torch.tensor([K], device=self.device), seq.st, index)
        accepted = int(v.accepted_B[0])
        return accepted, int(v.final_ids_B[0]), [*v.draft_logprobs_BK[0, :accepted].tolist(),
                                                  float(v.final_logprobs_B[0])]

    def _settle(self, seq: _MtpSeq, reason: str | None) -> None:
        """Keep a running request; a finished one leaves its caches as a snapshot for the next turn (when
        they can be brought to exactly its ids but the last) and completes."""
        if reason is None:
            self.running.append(seq)
            return
        key = seq.request.prompt_ids + seq.ids[:-1]
        if self.snapshots.max_tokens > 0 and self._sync(seq, key):
            assert seq.last_hidden is not None  # set by the prefill (``admit``)
            self.snapshots.put(key, _SpecCache(seq.cache, seq.mtp_cache, seq.last_hidden), self.version)
        seq.cache = seq.mtp_cache = None
        seq.done(seq.completion(reason))

    def _sync(self, seq: _MtpSeq, key: list[int]) -> bool:
        """Bring ``seq``'s caches to hold exactly ``key`` (MTP entries up to its last position but one);
        False when they cannot (accepted drafts past a stop went through the recurrent state)."""
        if seq.cache_len > len(key):
            return False
        if seq.cache_len < len(key):
            start, missing = seq.cache_len, key[seq.cache_len:]
            hidden = self._hidden(seq, missing)
            self._feed(seq, start, hidden, missing)
            seq.cache_len, seq.last_hidden = len(key), hidden[:, -1:]
        if seq.mtp_len > len(key) - 1:
            seq.mtp_cache.crop(-(seq.mtp_len - (len(key) - 1)))
            seq.mtp_len = len(key) - 1
        return seq.mtp_len == len(key) - 1
