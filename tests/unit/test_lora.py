"""LoRA (`[trainer.lora]`): only adapters train, the engines get the merged weights, the adapter saves in PEFT's
format and loads with PEFT, a resume restores adapter and optimizer, target modules resolve per family."""

import random

import pytest
import torch

from albatross.config import LoRAConfig, TrainerConfig, load_config
from albatross.records import Batch, Sample, TrainSample
from albatross.trainer.checkpoint import export_weights, load_weights
from albatross.trainer.lora import LoRAError, check_run, is_adapter, target_modules
from albatross.trainer.model import tiny_causal_lm
from albatross.trainer.step import Trainer

VOCAB = 300


def batch(seed: int) -> Batch:
    rng = random.Random(seed)
    samples = []
    for n, adv in ((10, 1.0), (8, -1.0), (12, 0.5)):
        ids = [rng.randrange(VOCAB) for _ in range(n)]
        mask = [0] * 3 + [1] * (n - 3)
        samples.append(TrainSample(Sample(token_ids=ids, loss_mask=mask,
                                          logprobs=[-rng.uniform(4, 7) if m else 0.0 for m in mask],
                                          versions=[0 if m else -1 for m in mask]), adv))
    return Batch(samples=samples, groups=1, min_version=0)


def lora_trainer(seed: int = 0, **lora) -> Trainer:
    knobs = TrainerConfig(lr=1e-2, lora=LoRAConfig(rank=4, **lora))
    return Trainer(tiny_causal_lm(VOCAB, seed=seed), knobs, seed=seed)


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def test_only_the_adapters_get_gradients_and_optimizer_state():
    trainer = lora_trainer()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    for s in range(2):  # B starts at 0, so A's first gradient is 0: two steps move both
        trainer.step(batch(s))
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and all(is_adapter(n) for n in changed)  # the base did not move
    assert any("lora_A" in n for n in changed) and any("lora_B" in n for n in changed)
    in_optimizer = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    trainable = {id(p) for n, p in trainer.model.named_parameters() if is_adapter(n)}
    assert in_optimizer == trainable
    counts = trainer.parameter_counts()
    # 2 layers x (q, k, v, o, gate, up, down) at rank 4, hidden 64 (kv 32, mlp 128): r * (in + out) each
    per_layer = 4 * ((64 + 64) + (64 + 32) * 2 + (64 + 64) + (64 + 128) * 2 + (128 + 64))
    assert counts["trainable_parameters"] == 2 * per_layer
    assert counts["parameters"] == sum(p.numel() for p in tiny_causal_lm(VOCAB).parameters()) + 2 * per_layer


def test_the_exported_weights_are_the_merged_model_under_the_base_names(tmp_path):
    trainer = lora_trainer()
    for s in range(2):
        trainer.step(batch(s))
    path = export_weights(trainer.export_view(), tmp_path, 2, names="served")
    served = tiny_causal_lm(VOCAB, seed=5)
    load_weights(served, path)  # names and shapes checked: exactly the base model's
    ids = torch.randint(0, VOCAB, (1, 16))
    torch.testing.assert_close(logits(served, ids), logits(trainer.model, ids), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logits(tiny_causal_lm(VOCAB), ids), logits(served, ids))  # it trained


def test_the_adapter_loads_with_peft(tmp_path):
    from peft import PeftModel

    trainer = lora_trainer()
    trainer.step(batch(0))
    out = trainer.save_adapter(tmp_path / "adapter")
    assert {p.name for p in out.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    loaded = PeftModel.from_pretrained(tiny_causal_lm(VOCAB), out)
    ids = torch.randint(0, VOCAB, (1, 16))
    torch.testing.assert_close(logits(loaded, ids), logits(trainer.model, ids), atol=1e-6, rtol=1e-6)


def test_resume_restores_the_adapter_and_its_optimizer_state(tmp_path):
    batches = [batch(s) for s in range(4)]
    straight = lora_trainer(seed=1, dropout=0.2)  # adapter dropout: the RNG state matters too
    losses = [straight.step(b)["loss"] for b in batches]
    first = lora_trainer(seed=1, dropout=0.2)
    for b in batches[:2]:
        first.step(b)
    first.save(tmp_path / "ckpt").result()
    resumed = lora_trainer(seed=2, dropout=0.2)
    resumed.load(tmp_path / "ckpt")
    assert resumed.version == 2
    assert [resumed.step(b)["loss"] for b in batches[2:]] == losses[2:]
    for (name, a), (_, b) in zip(straight.model.named_parameters(), resumed.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_target_modules_groups_globs_and_typos():
    model = tiny_causal_lm(VOCAB)
    attention = target_modules(model, ["attention"])
    assert {n.rsplit(".", 1)[-1] for n in attention} == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert len(attention) == 8
    assert target_modules(model, ["q_proj"]) == ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]
    assert target_modules(model, ["model.layers.1.mlp.*"]) == [f"model.layers.1.mlp.{n}_proj"
                                                                for n in ("gate", "up", "down")]
    with pytest.raises(LoRAError, match="'qproj' selects no linear layer.*q_proj"):
        target_modules(model, ["attention", "qproj"])
    with pytest.raises(LoRAError, match="experts"):
        target_modules(model, ["experts"])


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen4_exp"])
def test_default_targets_of_the_moe_families(family):
    """Attention (linear attention too) and shared experts; never routers, experts, hyper-connections, PLE."""
    from albatross.models.tiny import tiny_model

    names = target_modules(tiny_model(family, mtp=False), ["attention", "mlp"])
    leaves = {n.rsplit(".", 1)[-1] for n in names}
    assert {"q_proj", "o_proj"} <= leaves and not any("gate" == leaf for leaf in leaves)
    assert not any(part in n for n in names for part in ("experts.", "hyper", "ple.", "router"))
    if family == "qwen4_exp":
        assert "in_proj_qkv" in leaves and any("shared_expert." in n for n in names)


def test_unsupported_combinations_are_refused_in_one_line():
    with pytest.raises(LoRAError, match="gpus > 1"):
        check_run(load_config(None, ["trainer.lora.rank=8", "trainer.gpus=2"]))
    with pytest.raises(LoRAError, match="mtp"):
        check_run(load_config(None, ["trainer.lora.enabled=true", "trainer.mtp=train"]))
    check_run(load_config(None, ["trainer.gpus=2"]))  # no LoRA: nothing to refuse
    assert load_config(None, ["trainer.lora.enabled=true"]).trainer.lora.r == 16
    assert not load_config(None, []).trainer.lora.on


def test_bench_lora_counts_the_optimizer_state_of_each_trainer():
    from albatross.bench.lora import measure

    r = measure(tiny_causal_lm(VOCAB), rank=4, steps=1, tokens=128, vocab=VOCAB)
    for name in ("full", "lora"):  # AdamW: two fp32 moments per trainable parameter, plus a step count each
        trainable = r[name]["trainable_parameters"]
        assert 8 * trainable <= r[name]["optimizer_bytes"] <= 8 * trainable + 8 * 64
        assert r[name]["step_s"] > 0
    assert r["full"]["trainable_parameters"] == sum(p.numel() for p in tiny_causal_lm(VOCAB).parameters())
    assert r["lora"]["optimizer_share_of_full"] == r["lora"]["optimizer_bytes"] / r["full"]["optimizer_bytes"] < 0.2


def test_the_builtin_engine_served_adapters_equals_the_merged_weights(tmp_path):
    """`serve = "adapter"`: each version is only the adapter (PEFT format, `adapters/v*` with LATEST); the built-in
    engine merges it into the base it holds, so it serves what the merged export serves, and a later version is
    merged into the base again (never on top of the previous version)."""
    from albatross.engine.base import SamplingParams
    from albatross.engine.builtin import BuiltinEngine
    from albatross.trainer.checkpoint import latest_version
    from albatross.trainer.weights.filesystem import AdapterSender, FilesystemSender

    trainer = lora_trainer()
    adapters, full = AdapterSender(tmp_path / "adapters"), FilesystemSender(tmp_path / "weights")
    by_adapter = BuiltinEngine(tiny_causal_lm(VOCAB), fast_forward=False)
    by_weights = BuiltinEngine(tiny_causal_lm(VOCAB), fast_forward=False)
    ids = torch.randint(0, VOCAB, (1, 16))
    base = logits(by_adapter.model, ids)
    try:
        for version in (1, 2):
            trainer.step(batch(version))
            trainer.step(batch(version + 10))
            path = adapters.send(trainer.export_view(), version)
            assert {p.name for p in (tmp_path / "adapters" / f"v{version:06d}").iterdir()} == {
                "adapter_config.json", "adapter_model.safetensors"}
            assert latest_version(tmp_path / "adapters") == version
            by_adapter.update_weights(path, version)
            by_weights.update_weights(full.send(trainer.export_view(), version), version)
            torch.testing.assert_close(logits(by_adapter.model, ids), logits(by_weights.model, ids),
                                       atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(logits(by_adapter.model, ids), logits(trainer.model, ids), atol=1e-5,
                                       rtol=1e-5)
            assert not torch.allclose(logits(by_adapter.model, ids), base)  # the adapter moved it
            out = by_adapter.generate([[1, 2, 3]], SamplingParams(temperature=1.0, max_tokens=4, seed=0))[0]
            assert out.versions == [version] * len(out.token_ids)
    finally:
        by_adapter.close()
        by_weights.close()


def test_serving_adapters_is_refused_where_no_engine_route_takes_them(tmp_path):
    for engine, message in (("type = \"sglang\"", "SGLang"), ("weight_sync = \"nccl\"\ntype = \"vllm\"", "nccl")):
        path = tmp_path / "run.toml"
        path.write_text(f"[trainer.lora]\nrank = 8\n[engine]\n{engine}\n")
        with pytest.raises(LoRAError, match=message):
            check_run(load_config(path))
        path.write_text(f"[trainer.lora]\nrank = 8\nserve = \"merged\"\n[engine]\n{engine}\n")
        check_run(load_config(path))  # the merged weights go through any engine's transport


def test_an_adapter_on_the_tied_output_layer_is_served_and_merged_apart_from_the_embedding(tmp_path):
    """`target_modules = [..., "lm_head"]` on a model whose LM head is tied to its embedding: the adapter (its A
    and B only, never the head's base weight) changes the output layer alone; the built-in engine serving it and
    the merged export (an untied config) both reproduce the trainer's logits, the input embedding untouched."""
    from safetensors.torch import load_file

    from albatross.engine.builtin import BuiltinEngine
    from albatross.trainer.model import load_model
    from albatross.trainer.weights.filesystem import AdapterSender

    trainer = lora_trainer(target_modules=["attention", "lm_head"])
    assert any(n.startswith("lm_head.lora_") for n, p in trainer.model.named_parameters() if p.requires_grad)
    for s in range(3):
        trainer.step(batch(s))
    path = AdapterSender(tmp_path / "adapters").send(trainer.export_view(), 1)
    saved = load_file(f"{path}/adapter_model.safetensors")
    assert any(k.startswith("base_model.model.lm_head.lora_") for k in saved)
    assert all(".lora_" in k for k in saved), sorted(saved)  # no copy of the (vocab x hidden) head or embedding
    base = tiny_causal_lm(VOCAB)
    engine = BuiltinEngine(tiny_causal_lm(VOCAB), fast_forward=False)
    ids = torch.randint(0, VOCAB, (1, 16))
    try:
        engine.update_weights(str(path), 1)
        served = engine.model
        torch.testing.assert_close(logits(served, ids), logits(trainer.model, ids), atol=1e-5, rtol=1e-5)
        assert torch.equal(served.model.embed_tokens.weight, base.model.embed_tokens.weight)  # the input side kept
        assert not torch.equal(served.lm_head.weight, base.lm_head.weight)
    finally:
        engine.close()
    merged = export_weights(trainer.export_view(), tmp_path / "weights", 1)
    model = load_model(merged)
    assert not model.config.tie_word_embeddings
    torch.testing.assert_close(logits(model, ids), logits(trainer.model, ids), atol=1e-5, rtol=1e-5)


def test_an_adapter_on_a_tied_output_layer_is_refused_when_merged_weights_are_served(tmp_path):
    from albatross.trainer.lora import check_tied_output

    with pytest.raises(LoRAError, match="lm_head.*serve = \"adapter\""):
        lora_trainer(target_modules=["lm_head"], serve="merged")
    merged = load_config(None, ["trainer.lora.rank=8", 'trainer.lora.target_modules=["lm_head"]',
                                "trainer.lora.serve=merged"])
    (tmp_path / "config.json").write_text('{"tie_word_embeddings": true}')
    with pytest.raises(LoRAError, match="config.json.*serve = \"adapter\""):  # before training, from the directory
        check_tied_output(merged, tmp_path)
    with pytest.raises(LoRAError, match="the demo model"):
        check_tied_output(merged, None)
    check_tied_output(load_config(None, ["trainer.lora.rank=8", 'trainer.lora.target_modules=["lm_head"]']), tmp_path)
    (tmp_path / "config.json").write_text('{"tie_word_embeddings": false}')
    check_tied_output(merged, tmp_path)  # an untied head: the merged weights carry it
    model = tiny_causal_lm(VOCAB)
    assert target_modules(model, ["lm_head"]) == ["lm_head"]
    assert "lm_head" not in target_modules(model, ["*", "attention", "mlp"])  # only when named
