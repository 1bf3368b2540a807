import json
import random
import threading

import pytest
import torch
import transformers
from safetensors.torch import load_file

from albatross.config import RLConfig, TrainerConfig
from albatross.records import Batch, Sample, TrainSample
from albatross.rl.losses import tis_loss
from albatross.trainer.checkpoint import (
    export_weights,
    exported_versions,
    latest_version,
    load_state,
    load_weights,
    save_state,
)
from albatross.trainer.logprobs import chunked_logprobs
from albatross.trainer.model import tiny_causal_lm
from albatross.trainer.packing import block_causal_mask, first_fit_decreasing, pack
from albatross.trainer.step import Trainer, merge_metrics
from tiny_models import VOCAB, tiny_qwen2


def tiny_model(attn: str = "sdpa", seed: int = 0) -> transformers.PreTrainedModel:
    return tiny_qwen2(seed, attn, initializer_range=0.02, eval_mode=False)  # transformers' default init


def make_sample(rng: random.Random, n: int, prompt: int = 3, version: int = 0) -> Sample:
    ids = [rng.randrange(VOCAB) for _ in range(n)]
    mask = [0] * prompt + [1] * (n - prompt)
    logprobs = [-rng.uniform(4.0, 7.0) if m else 0.0 for m in mask]
    versions = [version if m else -1 for m in mask]
    return Sample(token_ids=ids, loss_mask=mask, logprobs=logprobs, versions=versions)


def make_batch(lengths: list[int], advantages: list[float], seed: int = 0) -> Batch:
    rng = random.Random(seed)
    samples = [TrainSample(make_sample(rng, n), a) for n, a in zip(lengths, advantages, strict=True)]
    return Batch(samples=samples, groups=1, min_version=0)


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# packing -----------------------------------------------------------------------------------------


def test_first_fit_decreasing():
    assert first_fit_decreasing([5, 3, 4, 2], 7) == [[0, 3], [2, 1]]
    assert first_fit_decreasing([10, 1], 7) == [[0], [1]]
    with pytest.raises(ValueError):
        first_fit_decreasing([1], 0)


def test_pack_aligns_fields_with_targets():
    a = Sample([5, 6, 7, 8], [0, 1, 1, 0], [0.0, -1.0, -2.0, 0.0], [-1, 3, 4, -1])
    b = Sample([9, 10, 11], [0, 0, 1], [0.0, 0.0, -3.0], [-1, -1, 5])
    short = Sample([1], [0], [0.0], [-1])
    (mb,) = pack([TrainSample(a, 0.5), TrainSample(b, -1.0), TrainSample(short, 2.0)], max_tokens=16)
    assert mb.input_ids.tolist() == [[5, 6, 7, 9, 10]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 0, 1]]
    assert mb.seq_lens == [3, 2]
    assert mb.targets.tolist() == [6, 7, 8, 10, 11]
    assert mb.loss_mask.tolist() == [1, 1, 0, 0, 1]
    assert mb.logprobs.tolist() == [-1.0, -2.0, 0.0, 0.0, -3.0]
    assert mb.versions.tolist() == [3, 4, -1, -1, 5]
    assert mb.advantages.tolist() == [0.5, 0.5, 0.5, -1.0, -1.0]
    assert mb.num_loss_tokens == 3


def test_pack_respects_budget():
    batch = make_batch([9, 7, 5, 4, 3], [1.0] * 5)
    micro = pack(batch.samples, max_tokens=10)
    # inputs 8, 6, 4, 3, 2 -> bins {8, 2}, {6, 4}, {3}
    assert sorted(mb.num_tokens for mb in micro) == [3, 10, 10]
    assert sum(mb.num_tokens for mb in micro) == sum(n - 1 for n in [9, 7, 5, 4, 3])


def test_block_causal_mask():
    mask = block_causal_mask([2, 1], torch.float32)
    allowed = (mask[0, 0] == 0).int().tolist()
    assert allowed == [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
    assert mask[0, 0, 2, 0].item() == torch.finfo(torch.float32).min


@pytest.mark.parametrize(
    ("attention", "attn"), [("varlen", "sdpa"), ("dense", "sdpa"), ("dense", "eager")]
)
def test_packed_equals_one_by_one(attention: str, attn: str):
    batch = make_batch([12, 7, 9], [1.0, -0.5, 0.25])
    (mb,) = pack(batch.samples, 4096)
    n = mb.num_loss_tokens
    reference = tiny_model(attn)  # each sample alone, the model's own causal attention, no mask
    single_loss = 0.0
    for ts in batch.samples:
        (one,) = pack([ts], 4096)
        loss, _ = tis_loss(*_inputs(reference, one), current_version=0, num_batch_tokens=n)
        loss.backward()
        single_loss += loss.item()
    trainer = Trainer(tiny_model(attn), TrainerConfig(micro_batch_tokens=4096, attention=attention))
    logprobs, _ = trainer.forward_logprobs(mb)
    packed_loss, _ = tis_loss(logprobs, mb.logprobs, mb.advantages, mb.loss_mask, mb.versions,
                              current_version=0, num_batch_tokens=n)
    packed_loss.backward()
    assert packed_loss.item() == pytest.approx(single_loss, abs=1e-5)
    packed, single = grads(trainer.model), grads(reference)
    assert packed.keys() == single.keys() and packed
    for name in packed:
        torch.testing.assert_close(packed[name], single[name], atol=1e-5, rtol=1e-4)


def _inputs(model: torch.nn.Module, mb) -> tuple[torch.Tensor, ...]:
    """A single unpacked sequence through the model's own attention: the reference for packing."""
    hidden = model.get_decoder()(input_ids=mb.input_ids).last_hidden_state[0]
    logprobs, _ = chunked_logprobs(hidden, model.get_output_embeddings(), mb.targets)
    return logprobs, mb.logprobs, mb.advantages, mb.loss_mask, mb.versions


def test_packing_without_mask_would_leak_across_samples():
    # Guards the test above: without the block mask, the second sample sees the first.
    model = tiny_model("sdpa")
    batch = make_batch([8, 8], [1.0, 1.0])
    (mb,) = pack(batch.samples, 4096)
    hidden = model.get_decoder()(input_ids=mb.input_ids, attention_mask=None).last_hidden_state[0]
    leaky, _ = chunked_logprobs(hidden, model.get_output_embeddings(), mb.targets)
    every = TrainerConfig(attention="varlen", logprob_loss_only=False)
    masked, _ = Trainer(model, every).forward_logprobs(mb)  # every token
    assert not torch.allclose(leaky[7:], masked[7:], atol=1e-4)
    torch.testing.assert_close(leaky[:7], masked[:7], atol=1e-5, rtol=1e-5)


# log-probs ---------------------------------------------------------------------------------------


def test_chunked_logprobs_match_full_logits():
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(10, 16, requires_grad=True)
    targets = torch.randint(0, 50, (10,))
    weights = torch.randn(10)
    lp, ent = chunked_logprobs(hidden, head, targets, chunk_size=3)
    (lp * weights).sum().backward()
    g_hidden, g_head = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None

    full = torch.log_softmax(head(hidden), dim=-1)
    ref = full.gather(-1, targets[:, None])[:, 0]
    (ref * weights).sum().backward()
    torch.testing.assert_close(lp, ref)
    torch.testing.assert_close(ent, -(full.exp() * full).sum(-1).detach())
    torch.testing.assert_close(g_hidden, hidden.grad)
    torch.testing.assert_close(g_head, head.weight.grad)


def test_chunked_logprobs_temperature_and_no_grad():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 20, bias=False)
    hidden, targets = torch.randn(5, 8), torch.randint(0, 20, (5,))
    with torch.no_grad():
        lp, _ = chunked_logprobs(hidden, head, targets, chunk_size=2, temperature=0.5)
        ref = torch.log_softmax(head(hidden) / 0.5, -1).gather(-1, targets[:, None])[:, 0]
    torch.testing.assert_close(lp, ref)


# the step ----------------------------------------------------------------------------------------


def test_gradient_accumulation_is_invariant_to_micro_batching():
    batch = make_batch([12, 10, 9], [1.0, -0.5, 0.25])
    one = Trainer(tiny_model(), TrainerConfig(micro_batch_tokens=4096))
    three = Trainer(tiny_model(), TrainerConfig.model_construct(micro_batch_tokens=11))  # below the floor (64)
    assert len(pack(batch.samples, 11)) == 3
    m1 = one.rl_gradients(batch, current_version=0)
    m3 = three.rl_gradients(batch, current_version=0)
    assert m1["loss"] == pytest.approx(m3["loss"], abs=1e-6)
    assert m1["tokens"] == m3["tokens"] == 9 + 7 + 6
    assert m1["entropy"] == pytest.approx(m3["entropy"], rel=1e-5)
    assert m1["staleness_hist/0"] == m3["staleness_hist/0"] == 9 + 7 + 6
    g1, g3 = grads(one.model), grads(three.model)
    for name in g1:
        torch.testing.assert_close(g1[name], g3[name], atol=1e-6, rtol=1e-5)


def test_stale_batch_gives_no_gradient():
    batch = make_batch([8, 6], [1.0, 1.0])
    trainer = Trainer(tiny_model(), rl=RLConfig(max_staleness=2))
    metrics = trainer.rl_gradients(batch, current_version=3)
    assert metrics["stale_tokens_dropped"] == 5 + 3
    assert metrics["staleness_max"] == 3.0
    assert all(g.abs().max().item() == 0.0 for g in grads(trainer.model).values())
    fresh = trainer.rl_gradients(batch, current_version=2)
    assert fresh["stale_tokens_dropped"] == 0
    assert any(g.abs().max().item() > 0 for g in grads(trainer.model).values())


def _mean_logprob(trainer: Trainer, batch: Batch) -> float:
    with torch.no_grad():
        (mb,) = pack(batch.samples, 4096)
        lp, _ = trainer.forward_logprobs(mb)
        return float((lp * mb.loss_mask).sum() / mb.loss_mask.sum())


def test_rl_step_raises_logprob_of_positive_advantage_tokens():
    trainer = Trainer(tiny_model(), TrainerConfig(lr=1e-3))
    batch = make_batch([12, 10], [1.0, 1.0])
    before = _mean_logprob(trainer, batch)
    for _ in range(5):
        metrics = trainer.step(batch, current_version=0)
    after = _mean_logprob(trainer, batch)
    assert after > before + 0.1
    assert trainer.version == 5 and metrics["version"] == 5.0
    for key in ("loss", "grad_norm", "tokens", "entropy", "mismatch_kl", "truncated_fraction"):
        assert key in metrics
    assert metrics["tokens"] == 9 + 7 and metrics["tokens_per_s"] > 0


def test_rl_step_negative_advantage_lowers_logprob():
    trainer = Trainer(tiny_model(), TrainerConfig(lr=1e-3))
    batch = make_batch([12, 10], [-1.0, -1.0])
    before = _mean_logprob(trainer, batch)
    for _ in range(3):
        trainer.step(batch)
    assert _mean_logprob(trainer, batch) < before - 0.1


def test_sft_step_reduces_loss():
    trainer = Trainer(tiny_model(), TrainerConfig(lr=3e-3))
    batch = make_batch([16, 12], [0.0, 0.0])
    samples = [ts.sample for ts in batch.samples]
    first = trainer.sft_step(samples)["loss"]
    for _ in range(8):
        last = trainer.sft_step(samples)["loss"]
    assert last < first - 0.5
    assert trainer.version == 0


# checkpoints -------------------------------------------------------------------------------------


def test_export_weights_layout_latest_and_pruning(tmp_path):
    model = tiny_model()
    assert latest_version(tmp_path) is None
    for v in (1, 2, 3):
        out = export_weights(model, tmp_path, v, keep=2)
    assert out == tmp_path / "v000003"
    assert (out / "model.safetensors").is_file()
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 64
    assert (tmp_path / "LATEST").read_text().strip() == "3"
    assert latest_version(tmp_path) == 3
    assert exported_versions(tmp_path) == [2, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST", "v000002", "v000003"]


def test_export_is_atomic_for_a_concurrent_reader(tmp_path):
    model = tiny_model()
    stop, seen, errors = threading.Event(), [], []

    def reader() -> None:  # follows LATEST like an engine does, as fast as it can
        while not stop.is_set():
            v = latest_version(tmp_path)
            if v is None:
                continue
            try:
                state = load_file(str(tmp_path / f"v{v:06d}" / "model.safetensors"))
                seen.append((v, float(state["model.norm.weight"][0])))
            except Exception as e:  # a half-written export would land here
                errors.append(repr(e))

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for v in range(1, 13):
            with torch.no_grad():
                model.model.norm.weight.fill_(float(v))
            export_weights(model, tmp_path, v, keep=50)
    finally:
        stop.set()
        thread.join()
    assert not errors and seen
    assert all(v == value for v, value in seen)
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporaries left


def test_exported_weights_load_back(tmp_path):
    src, dst = tiny_model(seed=1), tiny_model(seed=2)
    export_weights(src, tmp_path, 7)
    load_weights(dst, tmp_path / "v000007")
    for (name, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, msg=name)
    assert dst.lm_head.weight.data_ptr() == dst.model.embed_tokens.weight.data_ptr()


def _dropout_trainer(seed: int) -> Trainer:
    # Dropout makes every step draw random numbers, so an exact resume needs the RNG state too.
    return Trainer(tiny_causal_lm(VOCAB, seed=seed, attention_dropout=0.3), TrainerConfig(lr=1e-3), seed=seed)


def test_resume_gives_the_same_losses_as_an_uninterrupted_run(tmp_path):
    batches = [make_batch([10, 8, 12], [1.0, -1.0, 0.5], seed=s) for s in range(5)]
    straight = _dropout_trainer(seed=1)
    losses = [straight.step(b)["loss"] for b in batches]
    first = _dropout_trainer(seed=1)
    for b in batches[:2]:
        first.step(b)
    first.save(tmp_path / "state.pt")
    torch.manual_seed(1234)  # a fresh process: other weights, other RNG state
    resumed = _dropout_trainer(seed=2)
    resumed.load(tmp_path / "state.pt")
    assert resumed.version == 2 and resumed.steps == 2
    assert [resumed.step(b)["loss"] for b in batches[2:]] == losses[2:]
    for (name, a), (_, b) in zip(
        straight.model.named_parameters(), resumed.model.named_parameters(), strict=True
    ):
        assert torch.equal(a, b), name


def test_resume_without_rng_would_differ(tmp_path):
    # Guards the test above: dropout really consumes the RNG, so losses depend on its state.
    batch = make_batch([10, 8, 12], [1.0, -1.0, 0.5])
    a, b = _dropout_trainer(seed=1), _dropout_trainer(seed=1)
    torch.manual_seed(99)
    assert a.rl_gradients(batch, 0)["loss"] != b.rl_gradients(batch, 0)["loss"]


def test_save_state_function_roundtrip(tmp_path):
    model = tiny_model(seed=1)
    opt = torch.optim.AdamW(model.parameters())
    save_state(tmp_path / "s.pt", model, opt, 12, {"version": 4, "note": "x"})
    step, extra = load_state(tmp_path / "s.pt", tiny_model(seed=3))
    assert step == 12 and extra == {"version": 4, "note": "x"}
    assert [p.name for p in tmp_path.iterdir()] == ["s.pt"]


def test_block_causal_mask_boolean_form():
    assert block_causal_mask([1, 2], torch.bool)[0, 0].int().tolist() == [[1, 0, 0], [0, 1, 0], [0, 1, 1]]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_model_honours_the_block_mask(attn: str):
    # Positions run on across samples here, so only the mask keeps them apart (RoPE is relative).
    model = tiny_model(attn)
    batch = make_batch([8, 6], [1.0, 1.0])
    (mb,) = pack(batch.samples, 4096)
    dtype = torch.bool if attn == "sdpa" else torch.float32
    mask = block_causal_mask(mb.seq_lens, dtype)
    packed = model.get_decoder()(input_ids=mb.input_ids, attention_mask=mask).last_hidden_state[0]
    ones = [
        model.get_decoder()(input_ids=ids[None]).last_hidden_state[0]
        for ids in mb.input_ids[0].split(mb.seq_lens)
    ]
    torch.testing.assert_close(packed, torch.cat(ones), atol=1e-5, rtol=1e-4)


def test_merge_metrics():
    parts = [
        {"loss": 0.5, "tokens": 1.0, "mismatch_kl": 0.4, "ratio_max": 2.0, "staleness_hist/1": 1.0},
        {"loss": 0.25, "tokens": 3.0, "mismatch_kl": 0.0, "ratio_max": 1.5, "staleness_hist/1": 2.0},
    ]
    merged = merge_metrics(parts)
    assert merged == pytest.approx(
        {"loss": 0.75, "tokens": 4.0, "mismatch_kl": 0.1, "ratio_max": 2.0, "staleness_hist/1": 3.0}
    )


def test_empty_batch_step():
    trainer = Trainer(tiny_model())
    metrics = trainer.step(Batch(samples=[], groups=0, min_version=0))
    assert metrics["tokens"] == 0.0 and metrics["grad_norm"] == 0.0 and trainer.version == 1


@pytest.mark.parametrize(("recompute", "entropy_grad"), [(True, True), (False, True), (True, False),
                                                         (False, False)])
@pytest.mark.parametrize(("temperature", "softcap", "bias"), [(1.0, None, False), (0.7, 5.0, True)])
def test_fused_linear_logprobs_match_autograd(
    temperature: float, softcap: float | None, bias: bool, recompute: bool, entropy_grad: bool
):
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=bias)
    hidden = (3 * torch.randn(11, 16)).requires_grad_(True)
    targets = torch.randint(0, 50, (11,))
    w_lp, w_ent = torch.randn(11), torch.randn(11)

    def run(fn) -> tuple[torch.Tensor, ...]:
        hidden.grad = None
        head.zero_grad(set_to_none=True)
        lp, ent = fn()
        ((lp * w_lp).sum() + ((ent * w_ent).sum() if entropy_grad else 0.0)).backward()
        extra = (head.bias.grad,) if bias else ()
        return lp.detach(), ent.detach(), hidden.grad.clone(), head.weight.grad.clone(), *extra

    fused = run(lambda: chunked_logprobs(hidden, head, targets, chunk_size=4, temperature=temperature,
                                         softcap=softcap, entropy_grad=entropy_grad, recompute=recompute))

    def reference() -> tuple[torch.Tensor, torch.Tensor]:
        logits = head(hidden)
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        logp = torch.log_softmax(logits / temperature, -1)
        return logp.gather(-1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)

    for got, want in zip(fused, run(reference), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_checkpoints_are_due_by_steps_or_by_time() -> None:
    from albatross.trainer.checkpoint import Checkpointer

    every = Checkpointer(every_steps=5, every_minutes=0)
    assert [s for s in range(1, 12) if every.due(s) and not every.started(s, _done())] == [5, 10]
    timed = Checkpointer(every_steps=0, every_minutes=1.0)
    assert not timed.due(100)
    timed.last_time -= 61  # a minute has passed
    assert timed.due(101)
    assert not Checkpointer(0, 0).due(10**6)  # both off: never


def test_wait_returns_after_every_checkpoint_is_reported() -> None:
    """The run's last message (its final weights) must follow every checkpoint's ``checkpoint_done``: waiting
    for the writes alone returns while a report is still being sent."""
    import threading
    import time
    from concurrent.futures import Future

    from albatross.trainer.checkpoint import Checkpointer

    sent: list[int] = []

    def report(f: Future) -> None:
        time.sleep(0.3)  # a slow queue
        sent.append(f.result())

    checkpoints = Checkpointer(1, 0)
    write: Future = Future()
    checkpoints.started(1, write)
    checkpoints.reporting(write, report)
    threading.Thread(target=write.set_result, args=(7,)).start()
    checkpoints.wait()
    assert sent == [7]


def _done():
    from concurrent.futures import Future

    f: Future = Future()
    f.set_result(0)
    return f


def test_a_background_checkpoint_in_bf16_resumes_the_served_weights(tmp_path):
    """Written from a thread after a copy to host memory (later steps do not change it), in the model's dtype:
    half the weight bytes of fp32, and resuming gives the weights the engines served (bf16-rounded)."""
    batch = make_batch([10, 8, 12], [1.0, -1.0, 0.5])
    trainer = Trainer(tiny_model(seed=1), TrainerConfig(lr=1e-3))
    trainer.step(batch)
    saved = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    write = trainer.save(tmp_path / "bf16", dtype="bfloat16", background=True)
    trainer.step(batch)  # the training goes on while it is written
    assert write.result() > 0 and (tmp_path / "bf16" / "meta.pt").is_file()
    fp32 = trainer.save(tmp_path / "fp32").result()
    assert write.result() / fp32 == pytest.approx(10 / 12, abs=0.03)  # weights in 2 bytes, not 4; AdamW moments 8
    resumed = Trainer(tiny_model(seed=2), TrainerConfig(lr=1e-3))
    resumed.load(tmp_path / "bf16")
    assert resumed.steps == 1 and resumed.version == 1
    for name, t in resumed.model.state_dict().items():
        assert torch.equal(t, saved[name].to(torch.bfloat16).float()), name
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporaries left
