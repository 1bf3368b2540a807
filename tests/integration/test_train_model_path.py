"""`albatross train` with `model.path`: a user's own transformers directory (own BPE tokenizer, own chat template,
Llama and Qwen3 architectures) runs base eval, RL steps and trained eval, and exports weights that load back.

Each run warm-starts the random model on oracle demonstrations first (else a random model never solves a task,
every group is zero-signal and RL has nothing to train on); about a minute per architecture here.
"""

import json
from pathlib import Path

import pytest

from albatross.sandbox import local_available
from model_dirs import albatross, bpe_tokenizer, model_dir, write_config

needs_sandbox = pytest.mark.skipif(not local_available(), reason="needs root, namespaces and overlayfs")


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    from albatross.tasks.builtin import generate_tasks

    root = tmp_path_factory.mktemp("tasks")
    generate_tasks(root, families=["count_lines"], n_train=12, n_heldout=4, seed=3)
    return root


def test_a_missing_model_path_is_one_line_and_exit_2(tmp_path, tasks):
    cfg = write_config(tmp_path / "run.toml", tmp_path / "no-such-model", tasks, tmp_path / "out")
    r = albatross("train", str(cfg))
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert "model.path" in r.stderr and "no-such-model" in r.stderr


@pytest.mark.parametrize("problem", ["no_template", "no_weights", "bad_config"])
def test_an_unusable_model_directory_is_one_line_naming_it(tmp_path, tasks, problem):
    d = model_dir(tmp_path, "qwen3")
    if problem == "no_template":
        tc = json.loads((d / "tokenizer_config.json").read_text())
        tc.pop("chat_template", None)
        (d / "tokenizer_config.json").write_text(json.dumps(tc))
        (d / "chat_template.jinja").unlink(missing_ok=True)
    elif problem == "no_weights":
        for f in d.glob("*.safetensors"):
            f.unlink()
    else:
        (d / "config.json").write_text("{not json")
    r = albatross("train", str(write_config(tmp_path / "run.toml", d, tasks, tmp_path / "out")))
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr and str(d) in r.stderr
    assert {"no_template": "chat template", "no_weights": "no weights", "bad_config": "config.json"}[problem] \
        in r.stderr


@pytest.mark.slow
@needs_sandbox
@pytest.mark.parametrize("arch,marker,cls,gpus", [("llama", "<|start_header_id|>", "LlamaForCausalLM", 1),
                                                  ("qwen3", "<|im_start|>", "Qwen3ForCausalLM", 2)])
def test_train_runs_a_users_model_in_its_own_template(tmp_path, tasks, arch, marker, cls, gpus):
    """The Qwen3 run also shards its trainer with FSDP2 over 2 gloo ranks (`trainer.gpus = 2`), its parameters,
    gradients and optimizer step on the host (`offload_optimizer`: FSDP2's CPU offload, on a process group with a
    CPU backend). Both write fenced bash actions, which keep the prompts short (tool calls in the template are
    covered in test_chat_templates)."""
    d = model_dir(tmp_path, arch)
    out = tmp_path / "out"
    offload = "true" if gpus > 1 else "false"
    cfg = write_config(tmp_path / "run.toml", d, tasks, out,
                       f"[trainer]\ngpus = {gpus}\nlr = 1e-4\noffload_optimizer = {offload}")
    r = albatross("train", str(cfg), env={"ALBATROSS_CACHE": str(tmp_path / "cache")})
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "albatross train: results" in r.stdout and "[eval] base" in r.stdout and "[eval] trained" in r.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"]["path"] == str(d) and summary["model"]["architecture"] == cls
    assert summary["model"]["parameters"] > 0 and summary["train_steps"] >= 1
    assert summary["engine"] == "builtin" and summary["weight_version_final"] >= 1
    assert (out / "run" / "logs" / "trainer-rank1.log").is_file() == (gpus == 2)
    # trajectories are in the model's own template: decoded with its tokenizer, they carry its markers
    tok = bpe_tokenizer("llama" if arch == "llama" else "qwen")
    rows = [json.loads(line) for line in (out / "run" / "trajectories.jsonl").read_text().splitlines()]
    text = tok.decode(rows[0]["samples"][0]["token_ids"])
    assert marker in text, text[:300]
    # the exported weights load back into transformers with the same architecture
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(out / "final", local_files_only=True)
    assert type(model).__name__ == cls
    assert AutoTokenizer.from_pretrained(out / "final", local_files_only=True).chat_template
