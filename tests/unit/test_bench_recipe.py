"""`albatross bench recipe`: the pure parts (standard errors, fairness checks, gap bookkeeping, table, keys)."""

import argparse
import math

import pytest

from albatross.bench.recipe import (
    REQUIRED_KEYS,
    GapAccumulator,
    _check_args,
    equal_within_se,
    group_loss_share,
    harness_fairness,
    mean_se,
    missing_keys,
    notes,
    outcome_zero_signal,
    ratio,
    rl_figures,
    table_rows,
    token_weighted,
)
from albatross.errors import UserError


def test_mean_se_is_the_standard_error_of_the_mean():
    mean, se = mean_se([0.5, 0.7, 0.9])
    assert mean == pytest.approx(0.7)
    assert se == pytest.approx(0.2 / math.sqrt(3))  # sd 0.2 over 3 values
    assert mean_se([0.4]) == (0.4, None)
    assert mean_se([]) == (None, None)


def test_equal_within_se_uses_the_se_of_the_difference():
    assert equal_within_se(0.50, 0.03, 0.54, 0.04) is True  # |0.04| <= 0.05
    assert equal_within_se(0.50, 0.03, 0.56, 0.04) is False  # |0.06| > 0.05
    assert equal_within_se(0.5, None, 0.5, 0.1) is None


def test_group_loss_share_counts_groups_lacking_an_attempt():
    assert group_loss_share([4, 4, 3, 0], 4) == 0.5
    assert group_loss_share([8] * 10, 8) == 0.0
    assert group_loss_share([], 8) == 0.0
    assert ratio(84.0, 100.0) == 0.84 and ratio(1.0, 0.0) is None and ratio(None, 2.0) is None


def test_outcome_zero_signal_counts_all_pass_or_all_fail_groups():
    from albatross.tasks.probe import ProbeRow

    rows = [ProbeRow("a", "a", 4, 0, 0.2, False), ProbeRow("b", "b", 4, 4, 1.0, True),
            ProbeRow("c", "c", 4, 2, 0.6, False), ProbeRow("d", "d", 0, 0, 0.0, True)]
    assert outcome_zero_signal(rows) == pytest.approx(2 / 3, abs=1e-4)  # d has no scored attempt: not counted
    assert outcome_zero_signal([]) is None


def test_gap_accumulator_means_by_staleness():
    acc = GapAccumulator()
    acc.add(0, 0.2, 4)
    acc.add(0, 0.2, 4)
    acc.add(3, 0.9, 10)
    acc.add(-1, 5.0, 3)  # a token sampled by a newer version than the trainer's: not a staleness
    means = acc.means(6)
    assert list(means) == [str(s) for s in range(7)]
    assert means["0"] == pytest.approx(0.05) and means["3"] == pytest.approx(0.09)
    assert means["1"] is None and means["6"] is None


def test_token_weighted_mean():
    rows = [{"truncated_fraction": 0.1, "tokens": 100}, {"truncated_fraction": 0.0, "tokens": 300}, {"x": 1}]
    assert token_weighted(rows, "truncated_fraction") == pytest.approx(0.025)
    assert token_weighted([], "truncated_fraction") is None


def _settings(**over):
    base = {"max_observation_chars": 400, "policy": "trained", "prices": {"cached_input": 0.1}, "tasks": 8,
            "trials": 2}
    return {"off": dict(base), "on": {**base, **over}}


def test_harness_fairness_flags_unequal_limits_scripted_policies_and_full_price_cache():
    assert harness_fairness(_settings()) == []
    assert harness_fairness(_settings(max_observation_chars=10000)) == [
        "max_observation_chars differs between configurations"]
    problems = harness_fairness(_settings(prices={"cached_input": 1.0}))
    assert "cached input tokens are not priced as cached" in problems
    both = {k: {**v, "policy": "scripted"} for k, v in _settings().items()}
    assert harness_fairness(both) == ["a scripted policy never reads its observations"]


def _run(seed, p, se, tps):
    return {"seed": seed, "pass_at_1": p, "pass_at_1_se": se, "tokens_per_solve": tps}


def test_rl_figures_over_seeds():
    runs = {"rl": [_run(0, 0.6, 0.1, 20.0), _run(1, 0.8, 0.1, 16.0), _run(2, 0.7, 0.1, 18.0)],
            "sft_control": [_run(0, 0.5, 0.1, 0), _run(1, 0.5, 0.1, 0), _run(2, 0.5, 0.1, 0)],
            "rl_no_efficiency": [_run(0, 0.7, 0.1, 20.0), _run(1, 0.7, 0.1, 20.0), _run(2, 0.7, 0.1, 20.0)]}
    out = rl_figures(runs)
    assert out["rl_pass_at_1"] == pytest.approx(0.7)
    assert out["rl_pass_at_1_se"] == pytest.approx(0.1 / math.sqrt(3), abs=1e-4)
    assert out["sft_control_pass_at_1_se"] == 0.0
    assert out["rl_pass_at_1_by_seed"] == [0.6, 0.8, 0.7]
    assert out["tokens_per_solve_ratio"] == pytest.approx(0.9)
    assert out["tokens_per_solve_equal_pass_at_1"] is True


def test_one_seed_falls_back_to_the_se_over_tasks():
    runs = {"rl": [_run(0, 0.5, 0.05, 10.0)], "sft_control": [_run(0, 0.4, 0.05, 0)],
            "rl_no_efficiency": [_run(0, 0.9, 0.05, 20.0)]}
    out = rl_figures(runs)
    assert out["rl_pass_at_1_se"] is None  # no s.e. over one seed
    assert out["pass_at_1_with_efficiency_se"] == 0.05
    assert out["tokens_per_solve_equal_pass_at_1"] is False  # 0.4 apart, s.e. of the difference 0.07


def test_without_the_efficiency_runs_the_ratio_is_unmeasured_and_the_notes_say_why():
    runs = {"rl": [_run(0, 0.7, 0.1, 20.0)], "sft_control": [_run(0, 0.4, 0.1, 0)], "rl_no_efficiency": []}
    out = rl_figures(runs)
    assert out["rl_pass_at_1"] == pytest.approx(0.7) and out["tokens_per_solve_ratio"] is None
    assert "pass_at_1_without_efficiency" not in out
    skipped = {**_data(), **out, "runs": runs}
    assert "not measured (--skip-efficiency)" in "\n".join(notes(skipped))
    assert "not measured (--skip-efficiency)" not in "\n".join(notes(_data()))


def _data():
    data = {k: None for k in REQUIRED_KEYS}
    data.update(zero_signal_unfiltered=0.5, zero_signal_filtered=0.125, rl_pass_at_1=0.4,
                sft_control_pass_at_1=0.6, seeds=1, quick=True, tokens_per_solve_equal_pass_at_1=False,
                logprob_gap_by_staleness={"0": 0.01, "1": 0.02, **{str(s): None for s in range(2, 7)}},
                entropy_by_step=[1.0, 1.2], mismatch_kl_by_step=[0.001, 0.002], harness_cost_reduction=0.25,
                config={"heldout_tasks": 4, "eval_trials": 2},
                zero_signal={"outcome_unfiltered": 0.6, "outcome_filtered": 0.2})
    return data


def test_table_rows_show_the_seed_beside_ours():
    rows = {claim: (seed, ours) for claim, seed, ours in table_rows(_data())}
    assert rows["zero-signal groups, unfiltered -> filtered"] == (
        "48% -> 10.2%", "50.0% -> 12.5% (outcomes only: 60.0% -> 20.0%)")
    assert rows["harness cost, features on vs off"] == ("about -33%", "-25.0%")
    assert rows["log-prob gap at staleness 1 / 4-6"][1] == "0.0200 / n/a, n/a, n/a"
    assert rows["entropy / mismatch KL over the run (max)"][1] == "1.200 / 0.0020"
    assert len(rows) == 9


def test_notes_say_plainly_when_rl_is_not_ahead():
    text = "\n".join(notes(_data()))
    assert "RL is NOT ahead of the equal-wall-time SFT control (0.400 vs 0.600)" in text
    assert "quick: a smoke test" in text
    assert "staleness 2, 3, 4, 5, 6" in text
    ahead = {**_data(), "rl_pass_at_1": 0.7, "quick": False}
    assert "NOT ahead" not in "\n".join(notes(ahead)) and "smoke test" not in "\n".join(notes(ahead))


def test_missing_keys():
    assert missing_keys(_data()) == []
    partial = _data()
    del partial["tis_truncated_token_share"]
    assert missing_keys(partial) == ["tis_truncated_token_share"]


@pytest.mark.parametrize("flag,value,message", [("minutes", 0.0, "--minutes"), ("seeds", 0, "--seeds"),
                                                ("fault_rate", 1.5, "--fault-rate"), ("probe_tasks", 0, "--probe")])
def test_bad_arguments_are_one_line_user_errors(flag, value, message):
    args = argparse.Namespace(quick=True, minutes=None, seeds=None, fault_rate=0.1, probe_tasks=None)
    assert _check_args(args) == (0.5, 1) and args.probe_tasks == 24
    setattr(args, flag, value)
    with pytest.raises(UserError, match=message):
        _check_args(args)


def test_the_html_report_renders_a_bench_recipe_json(tmp_path):
    import json

    from albatross.bench.recipe import write_plot
    from albatross.eval.report import ReportError, write_report

    data = _data()
    data["table"] = [list(row) for row in table_rows(data)]
    data["notes"] = notes(data)
    data["stability_plot"] = "bench_recipe_stability.png"
    assert write_plot(data, tmp_path / "bench_recipe_stability.png") is not None
    (tmp_path / "bench_recipe.json").write_text(json.dumps(data))
    page = write_report([tmp_path], tmp_path / "report.html").read_text()
    assert "Recipe: the seed&#x27;s figures beside ours" in page or "Recipe: the seed's figures beside ours" in page
    assert "48% -&gt; 10.2%" in page and "50.0% -&gt; 12.5%" in page
    assert "RL is NOT ahead" in page and 'id="fig-recipe-stability"' in page
    (tmp_path / "bench_recipe.json").write_text(json.dumps({"quick": True}))
    with pytest.raises(ReportError, match="bench_recipe.json: no 'table' field"):
        write_report([tmp_path], tmp_path / "report.html")


def test_harness_notes_say_when_the_cost_difference_is_noise():
    from albatross.bench.recipe import _harness_notes

    def configs(on_cost, se):
        return {"configs": {"on": {"cost_per_attempt": on_cost, "cost_per_attempt_se": se,
                                   "compressions_per_attempt": 0.0},
                            "off": {"cost_per_attempt": 560.0, "cost_per_attempt_se": se}}}

    noisy = "\n".join(_harness_notes(configs(550.0, 30.0)))
    assert "within noise" in noisy and "compression never triggers" in noisy
    assert "within noise" not in "\n".join(_harness_notes(configs(300.0, 30.0)))
    assert "change nothing the model sees" in "\n".join(_harness_notes(configs(560.0, 30.0)))


def test_parts_are_saved_and_reused_only_with_the_same_settings(tmp_path):
    from albatross.bench.recipe import Parts

    calls = []

    def compute(value):
        def run():
            calls.append(value)
            return {"figure": value}
        return run

    parts = Parts(tmp_path / "parts", {"version": 1, "quick": False})
    assert parts.get("zero_signal", {"probe_tasks": 96}, compute(0.05)) == {"figure": 0.05}
    again = Parts(tmp_path / "parts", {"version": 1, "quick": False})  # a later run, same --out
    assert again.get("zero_signal", {"probe_tasks": 96}, compute(0.5)) == {"figure": 0.05}
    assert calls == [0.05]  # reused, not measured again
    assert again.get("zero_signal", {"probe_tasks": 192}, compute(0.07)) == {"figure": 0.07}  # a changed setting
    other = Parts(tmp_path / "parts", {"version": 2, "quick": False})  # another measurement version
    assert other.get("zero_signal", {"probe_tasks": 192}, compute(0.08)) == {"figure": 0.08}
    assert calls == [0.05, 0.07, 0.08]
    assert not list((tmp_path / "parts").glob("*.tmp"))


def test_a_part_that_fails_is_not_saved(tmp_path):
    from albatross.bench.recipe import Parts

    def boom():
        raise RuntimeError("the run stopped")

    parts = Parts(tmp_path / "parts", {})
    with pytest.raises(RuntimeError):
        parts.get("seed0", {"minutes": 3}, boom)
    assert parts.get("seed0", {"minutes": 3}, lambda: {"ok": 1}) == {"ok": 1}


def test_a_kept_lora_version_is_the_base_with_its_adapter_merged_and_the_head_untied(tmp_path):
    """The log-prob gap part scores a LoRA run's kept versions: adapters, merged into the base they trained on."""
    import json

    import torch
    from safetensors.torch import save_file

    from albatross.bench.recipe import _load_version
    from tiny_models import tiny_qwen2

    base_dir, adapter = tmp_path / "base", tmp_path / "v1"
    tiny_qwen2().save_pretrained(base_dir)
    adapter.mkdir()
    a, b = torch.randn(4, 64), torch.randn(300, 4)
    q_a, q_b = torch.randn(4, 64), torch.randn(64, 4)
    save_file({"base_model.model.lm_head.lora_A.weight": a, "base_model.model.lm_head.lora_B.weight": b,
               "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": q_a,
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": q_b},
              str(adapter / "adapter_model.safetensors"))
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "peft_type": "LORA"}))
    base, model = tiny_qwen2(), _load_version(adapter, base_dir)
    embed = base.get_input_embeddings().weight
    assert torch.allclose(model.get_output_embeddings().weight, embed + 2.0 * b @ a, atol=1e-5)
    assert torch.equal(model.get_input_embeddings().weight, embed)  # untied: the input embedding is the base's
    q = "model.layers.0.self_attn.q_proj.weight"
    assert torch.allclose(model.get_parameter(q), base.get_parameter(q) + 2.0 * q_b @ q_a, atol=1e-5)
    k = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(model.get_parameter(k), base.get_parameter(k))
    assert _load_version(base_dir, base_dir).state_dict().keys() == base.state_dict().keys()  # a full checkpoint
