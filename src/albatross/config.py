"""Run configuration: pydantic models, one TOML file per run, command-line overrides of any field.

Imports no torch, so ``albatross --help`` stays instant. Every field carries a description; it is what
``albatross config`` prints and what ``--help`` shows.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, Literal, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo

from albatross.errors import UserError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(UserError, ValueError):
    """A user error in a config file or override: one line, names the file and the field."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")


def is_hub_id(value: str) -> bool:
    """Whether ``value`` reads as a Hugging Face model id (``ORG/NAME``), not as a path."""
    return bool(_HUB_ID.match(value)) and ".." not in value


class ModelConfig(_Section):
    path: str = Field("", description="A transformers causal LM: a directory (config.json, safetensors, tokenizer "
                      "files with a chat template) or a Hugging Face id (`Qwen/Qwen3-0.6B`), found in the local "
                      "Hugging Face cache (HF_HUB_CACHE, HF_HOME/hub, ~/.cache/huggingface/hub) or downloaded "
                      "where the hub is reachable. Empty: the demo recipe builds its tiny model from the fields "
                      "below.")
    hidden_size: int = Field(128, gt=0, description="Tiny model (no `path`): hidden size.")
    num_layers: int = Field(4, gt=0, description="Tiny model (no `path`): number of transformer layers.")
    num_heads: int = Field(4, gt=0, description="Tiny model (no `path`): attention heads.")
    num_kv_heads: int = Field(2, gt=0, description="Tiny model (no `path`): key/value heads (GQA).")
    intermediate_size: int = Field(384, gt=0, description="Tiny model (no `path`): MLP width.")
    max_positions: int = Field(1024, gt=0, description="Tiny model (no `path`): maximum sequence length.")

    @field_validator("path")
    @classmethod
    def _path_exists(cls, value: str) -> str:
        if not value or is_hub_id(value) and not Path(value).is_dir():
            return value  # a Hugging Face id: resolved through the cache when the run starts
        if not Path(value).expanduser().is_dir():
            raise ValueError(f"model directory {value!r} does not exist (a Hugging Face id is ORG/NAME)")
        return str(Path(value).expanduser())


class TasksConfig(_Section):
    train: list[str] = Field(default_factory=list, description="Task directories (or folders of them) "
                             "to train on. Empty: generate built-in tasks into the run directory.")
    heldout: list[str] = Field(default_factory=list, description="Held-out task directories for evaluation.")
    families: list[str] = Field(default_factory=list, description="Built-in families to generate when `train` "
                                "is empty: names, or [\"all\"] for every family; empty: the demo's three "
                                "(`albatross tasks families` lists them).")
    n_train: int = Field(48, ge=1, description="Number of generated training tasks.")
    n_heldout: int = Field(12, ge=1, description="Number of generated held-out tasks.")
    n_validation: int = Field(0, ge=0, description="Generated validation tasks, disjoint from train and held-out "
                              "(their own words and phrasings), evaluated after training as "
                              "`validation_pass_at_1`: tune on these, report held-out.")
    reward_only_families: list[str] = Field(default_factory=list, description="Families learned from the reward "
                                            "alone: the warm start never shows their demonstrations (a task's "
                                            "family is its task.toml `[metadata] family`, or a built-in task's). "
                                            "Evaluations report them apart (`*_reward_only`, `*_warm_started`).")
    heldout_families: list[str] = Field(default_factory=list, description="Built-in families that appear only in "
                                        "the held-out split (never trained on): a test of transfer to a new "
                                        "kind of task, reported per family.")
    seed: int = Field(0, description="Seed of the task generator.")
    mix: dict[str, float] = Field(default_factory=dict, description="Training tasks from several sources in set "
                                  "proportions: `{\"<source>\" = weight, ...}`, a source being a directory of task "
                                  "directories (its `train/` and `heldout/` when it has them, as `tasks new` and "
                                  "`tasks swe --heldout` write them) or a built-in family (generated: `n_train` and "
                                  "`n_heldout` between the families). Each group's task comes from a source picked "
                                  "by weight (any run of groups holds each source within one group of its share); "
                                  "metrics, evaluations and the report give figures per source. Replaces `train` and "
                                  "`families`; `heldout` adds held-out tasks.")

    @field_validator("mix")
    @classmethod
    def _mix_weights(cls, value: dict[str, float]) -> dict[str, float]:
        for source, weight in value.items():
            if not (weight > 0 and weight != float("inf")):
                raise ValueError(f"the weight of {source!r} must be a positive finite number, got {weight}")
        return value

    @model_validator(mode="after")
    def _mix_alone(self) -> TasksConfig:
        if self.mix and (self.train or self.families):
            raise ValueError("tasks.mix replaces tasks.train and tasks.families: set one or the other")
        return self


class SandboxConfig(_Section):
    type: Literal["local", "process", "docker"] = Field("local", description="`local`: Linux namespaces + "
                                                        "copy-on-write overlay (isolated). `docker`: each attempt a "
                                                        "container of a Docker or Podman engine (`engine`). "
                                                        "`process`: no isolation, dev only.")
    engine: Literal["auto", "docker", "podman"] = Field("auto", description="`docker`: the container engine's "
                                                        "command; `auto`: Docker when its daemon answers, else "
                                                        "Podman.")
    memory_mb: int = Field(2048, ge=1, description="Memory limit per attempt (MiB, at least 1).")
    pids: int = Field(256, gt=0, description="Process limit per attempt.")
    disk_mb: int = Field(256, ge=1, description="Limit on bytes an attempt may write (MiB, at "
                         "least 1).")
    command_timeout_s: float = Field(60.0, gt=0, allow_inf_nan=False, description="Wall-time limit per command "
                                     "(seconds, finite).")
    max_infra_retries: int = Field(3, ge=0, description="Fresh forks tried after an infrastructure error.")
    attempt_timeout_s: float = Field(0.0, ge=0, allow_inf_nan=False, description="Wall-time limit of an attempt "
                                     "from its fork, enforced by the sandbox (0 = none; the harness has its own "
                                     "budget).")
    cpus: float = Field(0.0, ge=0, allow_inf_nan=False, description="`local`: CPU time per attempt per wall "
                        "second (1.5 = one and a half CPUs; cgroup cpu quota); 0 = no limit.")
    base: Literal["image", "host", "debian"] = Field(
        "image", description="`local` base root: `image`: the root the Dockerfile's FROM names, built once "
        "from Debian packages (or imported, `images`); `debian`: one cached Debian bookworm root; `host`: the "
        "host's own root (instant, but NOT isolated from the host's files; warns).")
    images: str = Field("", description="`local`: a directory of OCI image layouts / `docker save` archives; "
                        "a FROM naming one of their tags builds on it (imported on first use).")
    warm: int = Field(3, ge=0, description="`local`: ready pre-forked attempts kept per recent environment.")
    network: Literal["none", "registries", "open"] = Field(
        "none", description="Network policy of attempts (agent, oracle, verifier): `none`: loopback only; "
        "`registries`: the package registries of `registries`, through albatross's egress proxy; `open`: any "
        "host through the proxy, never the host's own services. A task may narrow it (`[environment] network` "
        "or `allow_internet = false` in task.toml), never widen it. Builds always reach the registries (`open` "
        "builds: any host). `local` only; `docker` runs attempts with `none`.")
    registries: list[str] = Field(
        default_factory=lambda: ["pypi.org", "files.pythonhosted.org", "deb.debian.org", "security.debian.org",
                                 "archive.ubuntu.com", "security.ubuntu.com", "registry.npmjs.org"],
        description="Hosts the `registries` policy (and every build) may reach through the egress proxy: exact "
        "names, or `*.example.org` for subdomains. The host's own Debian and Ubuntu mirrors and pip/npm index "
        "hosts are added.")

    layer_cache: bool = Field(True, description="`local`: keep every built task environment on disk, keyed by "
                              "the hash of its files, base images and network policy, so every later run reuses it "
                              "(`$ALBATROSS_IMAGES/layers`); false: build each environment once per run.")
    layer_cache_max_gb: float = Field(50.0, ge=0, description="`local`: when a build takes the layer cache over "
                                      "this size, it is pruned (in the background) to 90% of it, least recently "
                                      "used environments first; those a running process uses are kept. 0: no cap "
                                      "(`albatross sandbox image prune` prunes by hand).")
    build_min_free_mb: int = Field(2048, ge=0, description="`local`: free disk space (MiB) a build must leave where "
                                   "the layers are stored; a RUN step that goes below it is stopped (builds use the "
                                   "host's disk, as Docker's do).")

    @field_validator("network")
    @classmethod
    def _network_needs_local(cls, value: str, info: ValidationInfo) -> str:
        if value != "none" and info.data.get("type") == "docker":
            raise ValueError(f"network {value!r} needs type = \"local\" (the docker sandbox runs attempts with no "
                             "network)")
        return value


class HarnessConfig(_Section):
    action_format: Literal["auto", "bash_block", "tool_calls"] = Field(
        "auto", description="How actions are written: fenced ```bash blocks (small models) or JSON tool calls in "
        "the model's chat template (Qwen/Hermes `<tool_call>`); `auto`: tool calls when the template has a "
        "`<tool_call>` format and the tokenizer a `<tool_call>` token, else bash blocks.")
    agent: str = Field("", description="Your own agent loop instead of the built-in one: `package.module:function` "
                       "or `path/to/file.py:function`, called as `function(cfg, engine, backend, tokenizer)` and "
                       "returning an agent (`harness.agent.AgentLoop`: `engine`, `backend`, `run(spec, engine=None)"
                       " -> Trajectory`) that training and evaluation run every attempt with. Empty: the built-in "
                       "loop. See docs/own-agent.md.")
    system_prompt: str = Field("", description="A system message before each task's instruction, in the model's "
                               "chat template (models with `model.path`; the demo's tiny format has no system "
                               "role). Empty: none, as Terminal-Bench agents run.")
    tools: list[Literal["bash", "job_start", "job_list", "job_log", "job_wait", "job_kill", "read_file",
                        "write_file", "edit_file", "submit"]] = Field(
        default_factory=list, description="`tool_calls` actions: the built-in tools offered to the model (their "
        "schemas go into the chat template; `submit` is always offered). Empty: all of them. Fenced bash actions "
        "have one tool, the shell.")
    reasoning: Literal["keep", "strip"] = Field(
        "keep", description="Whether the `<think>...</think>` part of a completion stays in the next turns' "
        "context (`strip`: the context is no longer a prefix, so each turn starts a new sample).")
    max_turns: int = Field(30, ge=1, description="Turn budget per attempt.")
    max_tokens_per_turn: int = Field(2048, ge=1, description="Generated-token budget per turn.")
    max_generated_tokens: int = Field(0, ge=0, description="Generated-token budget for the whole attempt, "
                                      "summaries included (0 = no limit); ends it with `max_tokens`.")
    max_context_tokens: int = Field(16384, ge=16, description="Context budget (prompt + all turns).")
    max_observation_chars: int = Field(400, ge=16, description="Longest tool output shown whole; a longer one "
                                       "is saved to a file and shown as head + tail + path (cut in the middle "
                                       "when `redirect_output` is off).")
    redirect_output: bool = Field(True, description="Write each command's output to a file in the sandbox; "
                                  "show a long one as head, tail, bytes left out and the file's path.")
    bash_tools_hint: bool = Field(False, description="bash_block only: append a short description of the "
                                  "helpers (`job`, output files) to the instruction.")
    compression: Literal["none", "mask", "mask_summary"] = Field(
        "mask_summary", description="Near the context budget: mask old observations, then (`mask_summary`) ask "
        "the model for a summary. Each compression starts a new sample.")
    compress_at: float = Field(1.0, gt=0, le=1, description="Compress before a turn when context plus "
                               "`max_tokens_per_turn` would pass this share of `max_context_tokens`.")
    compress_target: float = Field(0.5, gt=0, le=1, description="Masking is enough when it brings context plus "
                                   "one turn under this share of the budget; otherwise summarise.")
    keep_observations: int = Field(3, ge=0, description="Most recent observations kept in full when masking "
                                   "or summarising.")
    summary_max_tokens: int = Field(256, ge=1, description="Cap on the length of a progress summary.")
    max_format_errors: int = Field(2, ge=1, description="Consecutive malformed actions that end an attempt.")
    attempt_timeout_s: float = Field(1800.0, gt=0, description="Wall-time budget per attempt (seconds).")


class SamplingConfig(_Section):
    temperature: float = Field(1.0, ge=0, description="Sampling temperature (0 = greedy).")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(0, ge=0, description="Top-k sampling (0 = off).")
    seed: int = Field(-1, ge=-1, description="Seed of the sampler: an attempt's n-th request samples with a seed "
                      "drawn from (this seed, its group, its attempt, n), so the same model gives the same tokens "
                      "for the same attempt on the same engine type. -1: unseeded (training's default; evaluation "
                      "uses `eval.seed`).")


class EngineConfig(_Section):
    type: Literal["builtin", "vllm", "sglang"] = Field(
        "builtin", description="Rollout engine: `builtin` (PyTorch, in this process or `albatross serve` "
        "processes), `vllm` or `sglang` (servers launched from `engine.python`, or attached by `engine.urls`).")
    urls: list[str] = Field(default_factory=list, description="Attach to these running servers (base URLs, "
                            "one replica each; `builtin`: `albatross serve`) instead of launching any.")
    weight_sync: Literal["filesystem", "nccl"] = Field(
        "filesystem", description="How new weights reach the engines: `filesystem` (safetensors in the run "
        "directory, reloaded by path; works everywhere) or `nccl` (broadcast from the trainer's rank 0 into "
        "the vLLM / SGLang servers' weight-update group; CUDA only).")
    max_batch_size: int = Field(64, ge=1, description="Largest decode batch (`builtin`).")
    threads: int = Field(1, ge=1, description="torch threads of the engine (`builtin`; `vllm` on CPU: OpenMP "
                         "threads of each server).")
    replicas: int = Field(1, ge=1, description="Engine replicas (servers launched); each attempt stays on the "
                          "replica holding its KV cache, new attempts go to the least loaded one.")
    process: bool = Field(False, description="`builtin`: run each replica as its own `albatross serve` process "
                          "(restarted if it dies; its in-flight attempts are re-run) instead of in the "
                          "orchestrator. vLLM and SGLang replicas are always processes.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where the built-in engine runs: `auto` "
                                                  "is the GPU after the trainer's (`cuda:<trainer.gpus>`, or the "
                                                  "last GPU when the trainer holds them all) when CUDA is present, "
                                                  "else the CPU.")
    python: str = Field("", description="Python interpreter that runs launched vLLM / SGLang servers. Empty: "
                        "the venv of `albatross engines install TYPE`, else this interpreter.")
    extra_args: list[str] = Field(default_factory=list, description="Extra command-line flags appended to "
                                  "each launched vLLM / SGLang server, e.g. [\"--kv-cache-dtype\", \"fp8\"].")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight dtype of launched vLLM / SGLang servers; `auto`: float32 without a GPU "
        "(so log-probs match the CPU trainer), the checkpoint's dtype on GPU.")
    gpu_memory_utilization: float = Field(0.0, ge=0, le=1, description="Share of GPU memory a launched server "
                                          "may take (vLLM `--gpu-memory-utilization`, SGLang "
                                          "`--mem-fraction-static`); 0: the server's default.")
    max_model_len: int = Field(0, ge=0, description="Context length of launched vLLM / SGLang servers "
                               "(0: the model's own limit).")
    start_timeout_s: float = Field(900.0, gt=0, description="Seconds a launched server may take to answer "
                                   "(vLLM compiles the model on its first start).")
    speculative: Literal["off", "mtp", "ngram"] = Field(
        "off", description="Speculative decoding: `mtp` drafts with the model's multi-token-prediction head "
        "(families with one: qwen3_next, qwen4_exp, glm_moe_dsa, glm5_next; vLLM / SGLang get their MTP "
        "speculative flags), `ngram` with prompt lookup (`builtin`, plain-KV models). Sampled tokens are "
        "distributed exactly as without it; greedy output is the same.")
    draft_tokens: int = Field(2, ge=1, le=16, description="Tokens drafted per step when `speculative` is on.")
    # ---- GPU node: tensor parallelism of launched servers (engine/launch.py) ----
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per launched vLLM / SGLang server (vLLM "
                                      "`--tensor-parallel-size`, SGLang `--tp-size`): server i takes GPUs "
                                      "first + i x this, ... (after the trainer's), so replicas x this GPUs in all.")


class RLConfig(_Section):
    advantage: Literal["grpo", "rloo", "topk"] = Field("grpo", description="Advantage estimator.")
    std_normalize: bool = Field(False, description="Divide GRPO advantages by the group's std.")
    topk: int = Field(2, ge=1, description="k of `topk` centering.")
    success_offset: float = Field(0.0, description="delta: add delta * (y_i - mean y) to advantages.")
    cap_failures: bool = Field(False, description="Cap the advantage of failed attempts at 0.")
    negative_scale: float = Field(1.0, ge=0, le=1, description="Weight of negative advantages. Below 1, "
                                  "failures are pushed down less than successes are pulled up (for tiny "
                                  "models, whose successes otherwise lose probability as a side effect).")
    partial_credit_c: float = Field(0.5, ge=0, lt=1, description="c: a failure scores c * fraction of tests passed.")
    efficiency_lambda: float = Field(0.1, ge=0, description="lambda of the efficiency term for successes.")
    loss: Literal["tis", "ppo_clip", "masked_is", "cispo"] = Field("tis", description="Policy loss.")
    is_cap: float = Field(2.0, gt=0, description="C: cap of the truncated importance ratio (`tis`).")
    clip_low: float = Field(0.2, ge=0, lt=1, description="`ppo_clip` / `cispo`: the ratio is clipped below at "
                            "1 - clip_low.")
    clip_high: float = Field(0.28, ge=0, description="`ppo_clip` / `cispo`: the ratio is clipped above at "
                             "1 + clip_high.")
    mask_low: float = Field(0.5, ge=0, description="`masked_is`: tokens whose ratio is below this give no "
                            "gradient.")
    mask_high: float = Field(2.0, gt=0, description="`masked_is`: tokens whose ratio is above this give no "
                             "gradient.")
    max_staleness: int = Field(6, ge=0, description="Tokens more than this many versions old give no gradient.")
    credit: Literal["all", "divergence"] = Field(
        "all", description="Which model tokens of an attempt with a negative advantage are trained: `all`, or "
        "`divergence`: those up to where it left the path of the group's attempts with a positive advantage (the "
        "longest token prefix it shares with one), the diverging choice included; the turns after it give no "
        "gradient.")
    p_floor: float = Field(0.0, ge=0, lt=1, description="Loss floor: negative-advantage tokens below this "
                           "probability stop contributing.")
    n_floor: int = Field(64, ge=1, description="Token-count floor of the loss denominator.")
    test_weights: str = Field("", description="Partial-credit weights: a `tasks validate --json` report "
                              "(tests that pass untouched weigh 0). Empty: every test weighs 1.")
    kl_coef: float = Field(0.0, ge=0, description="KL penalty to the behaviour policy (k3 estimator); 0 = off.")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus; 0 = off.")
    routing_replay: bool = Field(False, description="MoE models: the built-in engine records each generated "
                                 "token's experts per MoE layer (and its sparse-attention indexers' selected keys), "
                                 "and the trainer routes those tokens through the recorded experts and keys (router "
                                 "math in fp32; gradients reach the router through the replayed experts' scores); "
                                 "each step also logs `mismatch_kl_no_replay`. See docs/models.md.")


class LoRAConfig(_Section):
    enabled: bool = Field(False, description="Train LoRA adapters instead of the whole model (also on when `rank` "
                          "> 0): the base stays frozen, only the adapters get gradients and optimizer state. The "
                          "warm start still trains the whole model.")
    rank: int = Field(0, ge=0, description="Adapter rank r; above 0 turns LoRA on. 0 with `enabled = true`: "
                      "rank 16.")
    alpha: float = Field(32.0, gt=0, description="LoRA alpha: the adapters' update is scaled by alpha / rank.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapters' input during training. Above 0 "
                           "the trainer's log-probs differ from the sampler's even at staleness 0 (the importance "
                           "ratio sees the noise), so RL keeps it at 0.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["attention", "mlp"], description="Linear layers that get adapters: `attention` "
        "(every linear layer of the decoder layers' attention, linear attention included), `mlp` (the dense MLP "
        "and shared experts; MoE routers never), or a glob over module names (`*.q_proj`, "
        "`model.layers.1.mlp.*`) or a module's last name (`q_proj`), and `lm_head`: the output layer (only when "
        "named; a group or glob never selects it), which lets the adapters scale the logits themselves (a model "
        "whose final norm and output layer are frozen may not reach a sharp enough policy without it). One that "
        "selects no linear layer is an error. Experts stored as 3D tensors are not covered. `lm_head` on a model "
        "that ties it to the input embedding adapts the output alone and needs `serve = \"adapter\"` (vLLM and "
        "the built-in engine serve it); `serve = \"merged\"` is refused there.")
    merge: bool = Field(False, description="Also write the merged model (base + adapters) to `<out>/final/merged` "
                        "beside the adapter in `<out>/final`.")
    serve: Literal["adapter", "merged"] = Field(
        "adapter", description="What each step sends the engines: `adapter` (only the adapter, in PEFT's format: "
        "vLLM loads it hot through its LoRA routes and serves it by name, the built-in engine merges it into "
        "the base it holds; a version's tokens all come from the adapter its request started on) or `merged` "
        "(the base with the adapter merged in, as a full fine-tune sends: any engine, any `engine.weight_sync`). "
        "`adapter` needs `engine.weight_sync = \"filesystem\"` and is not available on SGLang yet.")

    @property
    def on(self) -> bool:
        """Whether LoRA trains (``enabled`` or a rank above 0)."""
        return self.enabled or self.rank > 0

    @property
    def sends_adapter(self) -> bool:
        """Whether each weight version the engines get is the adapter alone (LoRA on, ``serve = "adapter"``)."""
        return self.on and self.serve == "adapter"

    @property
    def r(self) -> int:
        """The rank in use: ``rank``, or 16 when only ``enabled`` is set."""
        return self.rank or 16


class TrainerConfig(_Section):
    lr: float = Field(1e-6, gt=0, description="AdamW learning rate (1e-6 suits a pretrained model of 0.5B "
                      "parameters and more; the demo's tiny model uses 4e-5).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Gradient-norm clip.")
    micro_batch_tokens: int = Field(4096, ge=64, description="Token budget of one packed micro-batch.")
    threads: int = Field(1, ge=1, description="torch threads of the trainer process.")
    keep_versions: int = Field(3, ge=1, description="Exported weight versions kept on disk.")
    logprob_chunk: int = Field(1024, ge=0, description="Tokens per chunk of the log-prob/entropy head, so the "
                               "full [tokens x vocab] logits are never held at once; 0 = one chunk.")
    logprob_loss_only: bool = Field(True, description="Apply the LM head only at loss-mask tokens (the model's "
                                    "own turns), not at prompt and observation tokens, whose log-probs no loss "
                                    "reads; exact, and saves the head's work on those tokens.")
    attention: Literal["auto", "varlen", "flash", "dense"] = Field(
        "auto", description="Document masking of packed micro-batches: `auto` is `flash` when the model "
        "runs a flash_attention_* implementation, else `varlen` (per-document SDPA); `dense` builds a "
        "block-diagonal mask.")
    activation_checkpointing: bool = Field(False, description="Recompute decoder-layer activations in "
                                           "the backward pass (less memory, about 1/3 more compute).")
    freeze: list[str] = Field(default_factory=list, description="Glob patterns of parameter names to freeze "
                              "(no gradients, not in the optimizer), e.g. `model.embed_tokens.*`.")
    offload_optimizer: bool = Field(False, description="Keep the AdamW state in host memory (GPU runs).")
    host_params: list[Literal["ngram"]] = Field(default_factory=list, description="Model parts whose parameters "
                                                "stay in host memory when the model runs on a GPU (`ngram`: the "
                                                "n-gram / PLE tables; rows are gathered on the host each step).")
    grouped_experts: bool = Field(False, description="MoE experts as one grouped matmul per projection over "
                                  "tokens sorted by expert (`models/experts.py`), instead of a loop over experts.")
    fast_indexer: bool = Field(False, description="`qwen4_exp`: vectorised QSA indexer top-k and sparse attention "
                               "over the selected keys (`models/indexer.py`): no per-position loop, no [T, T] mask.")
    fused_hyper: bool = Field(False, description="`qwen4_exp`: fused hyper-connection (gated residual) ops "
                              "(`models/hyper.py`): one matmul for the mix and inject weights, one fused residual.")
    precision: Literal["auto", "fp32", "bf16"] = Field("auto", description="`auto`: bf16 on GPU, fp32 on CPU. "
                                                       "bf16 keeps fp32 master weights and optimizer state "
                                                       "(autocast; FSDP: bf16 compute, fp32 reduction).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where the trainer runs: `auto` is CUDA "
                                                  "when present (the first `gpus` devices), else the CPU.")
    gpus: int = Field(1, ge=1, description="Trainer ranks: above 1 the trainer shards the model with FSDP2 over "
                      "this many processes it starts itself (one per GPU; gloo ranks on the CPU), or the ranks of "
                      "a `torchrun` launch.")
    mtp: Literal["off", "train", "frozen"] = Field(
        "off", description="The model's multi-token-prediction head (`mtp.*` / DeepSeek-layout weights, loaded "
        "from `model.path`): `train` adds an auxiliary next-next-token loss on DETACHED hidden states (it never "
        "moves the policy; a model without an MTP head is an error), `frozen` keeps it loaded without "
        "gradients or optimizer state (exported with the weights), `off` drops it.")
    mtp_loss_weight: float = Field(0.1, ge=0, description="Weight of the MTP loss (`mtp = \"train\"`).")
    lora: LoRAConfig = Field(default_factory=LoRAConfig, description="`[trainer.lora]`: train LoRA adapters "
                             "instead of the whole model.")


class OrchestratorConfig(_Section):
    group_size: int = Field(8, ge=2, description="G: attempts per task per group.")
    groups_per_step: int = Field(4, ge=1, description="Groups in one trainer batch.")
    max_steps: int = Field(200, ge=0, description="Trainer steps to run.")
    max_minutes: float = Field(600.0, gt=0, description="Stop training after this wall time (minutes).")
    queue_size: int = Field(2, ge=1, description="Batches that may wait for the trainer.")
    rollout_workers: int = Field(32, ge=1, description="Attempts run concurrently.")
    # ---- checkpoint cadence (trainer/checkpoint.py): by steps or by time, whichever is due first ----
    checkpoint_every: int = Field(50, ge=0, description="Trainer steps between resumable checkpoints (model "
                                  "weights in the model's dtype plus optimizer state, written in the background); "
                                  "0: by time only.")
    checkpoint_minutes: float = Field(30.0, ge=0, description="Minutes between resumable checkpoints; 0: by steps "
                                      "only. A checkpoint is written when either is due (both 0: never).")
    wandb_project: str = Field("", description="Log to this Weights & Biases project (`pip install "
                               "'albatross[wandb]'`; set without wandb installed is an error). The W&B run is "
                               "named after the run directory; a resumed run continues its W&B run.")
    backend: Literal["local", "ray"] = Field("local", description="`local`: trainer in a child process, "
                                             "rollouts on threads here; `ray`: trainer, engine replicas and "
                                             "rollout workers as Ray actors (see [ray]).")


class RayConfig(_Section):
    address: str = Field("", description="Ray cluster to join: `auto` (a `ray start` cluster on this node "
                         "or RAY_ADDRESS), `ray://HOST:PORT`, or empty: the one already initialised in this "
                         "process, else a new local one.")
    rollout_workers: int = Field(2, ge=1, description="Rollout worker actors; each runs its own sandboxes on "
                                 "its node, `orchestrator.rollout_workers / ray.rollout_workers` attempts at once.")
    worker_cpus: float = Field(0.25, gt=0, description="CPUs reserved by each rollout worker actor.")
    engine_cpus: float = Field(0.5, gt=0, description="CPUs reserved by each engine replica actor.")
    engine_gpus: float = Field(0.0, ge=0, description="GPUs reserved by each engine replica actor.")
    trainer_cpus: float = Field(1.0, gt=0, description="CPUs reserved by each trainer rank actor (`trainer.gpus` "
                                "ranks: one per GPU, or gloo ranks on CPUs).")
    trainer_gpus: float = Field(0.0, ge=0, description="GPUs reserved by each trainer rank actor: 1 for a GPU "
                                "trainer (one rank per GPU), 0 on CPUs.")
    trainer_placement: Literal["pack", "spread", "strict_pack", "strict_spread"] = Field(
        "pack", description="Ray placement group strategy of the trainer ranks: `pack` fills a node's GPUs first, "
        "`strict_spread` puts every rank on a different node.")
    trainer_resources: dict[str, float] = Field(default_factory=dict, description="Custom Ray resources each "
                                                "trainer rank asks for (nodes started with `ray start --resources "
                                                "'{\"trainer\": 8}'` take them): pins the trainer to those nodes.")
    engine_resources: dict[str, float] = Field(default_factory=dict, description="Custom Ray resources each "
                                               "engine replica actor asks for: pins the engines to the nodes that "
                                               "have them.")
    worker_resources: dict[str, float] = Field(default_factory=dict, description="Custom Ray resources each "
                                               "rollout worker asks for. Empty: the workers go to the nodes "
                                               "without GPUs (all nodes if every node has some) with the most free "
                                               "CPUs, and move to another node if theirs is lost.")


class EvalConfig(_Section):
    trials: int = Field(3, ge=1, description="Trials per held-out task.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature of base and trained evaluation "
                               "(and of `albatross eval`); training samples at `sampling.temperature`.")
    seed: int = Field(0, ge=-1, description="`sampling.seed` of base and trained evaluation and of `albatross "
                      "eval`: a seeded evaluation gives the same attempts for the same model, tasks and config on "
                      "the same engine type (base and trained share the draws). -1: unseeded.")


class WarmStartConfig(_Section):
    source: Literal["auto", "off", "oracle", "chats"] = Field(
        "auto", description="Supervised warm start before RL: `oracle` plays each training task's oracle steps "
        "through the real harness and sandbox and trains on them; `chats` trains on the JSONL of `chats`; `off` "
        "starts RL from the model as it is. `auto`: `oracle` for the demo's tiny model (no `model.path`), `off` "
        "when `model.path` is set.")
    chats: str = Field("", description="`source = chats`: a JSONL file, one {\"messages\": [...]} chat per "
                       "line, rendered with the model's chat template; assistant messages are trained on.")
    steps: int = Field(300, ge=0, description="Max SFT steps.")
    batch_size: int = Field(32, ge=1, description="Demonstrations per SFT step.")
    lr: float = Field(1e-3, gt=0, description="SFT learning rate.")
    target_pass_rate: float = Field(0.35, gt=0, lt=1, description="Stop SFT once the sampled train pass rate "
                                    "reaches this (checked every `check_every` steps).")
    check_every: int = Field(50, ge=1, description="SFT steps between pass-rate checks.")
    check_tasks: int = Field(24, ge=1, description="Training tasks sampled for each check.")


class RunConfig(_Section):
    name: str = Field("", description="Run name: the prefix of the default `out` and the W&B group. Empty: "
                      "the config file's name without `.toml`, else `run`.")
    out: str = Field("", description="Run directory: trajectories, metrics, weights, summary. Empty: "
                     "`runs/<name>-<YYYYmmdd-HHMMSS>`, a new directory for every run. A directory that already "
                     "holds files is refused unless `--resume` (continue it) or `--overwrite` (replace it).")
    seed: int = Field(0, description="Global seed.")
    model: ModelConfig = Field(default_factory=ModelConfig)
    tasks: TasksConfig = Field(default_factory=TasksConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    harness: HarnessConfig = Field(default_factory=HarnessConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    rl: RLConfig = Field(default_factory=RLConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    orchestrator: OrchestratorConfig = Field(default_factory=OrchestratorConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    warmstart: WarmStartConfig = Field(default_factory=WarmStartConfig)


def default(section: str, name: str) -> Any:
    """The default of config field ``section.name``: code that takes a setting as an argument uses this as its
    own default, so every default is written once, here."""
    model: Any = RunConfig
    for key in section.split(".") if section else ():  # nested: ``default("trainer.lora", "rank")``; top: ""
        model = model.model_fields[key].annotation
    return model.model_fields[name].get_default(call_default_factory=True)


def _parse_value(raw: str, field: FieldInfo | None = None) -> Any:
    """An override's value: JSON where it parses (numbers, booleans, lists), else the text itself. A list
    field also takes a comma-separated list or a single item (``tasks.train=/data/a,/data/b``), a table field
    comma-separated ``key=value`` pairs (``tasks.mix=tasks/swe=2,count_lines=1``)."""
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    if _is_list(field) and not isinstance(value, list):
        return [part.strip() for part in raw.split(",") if part.strip()]
    if field is not None and get_origin(field.annotation) is dict and not isinstance(value, dict):
        pairs = [part.rsplit("=", 1) for part in raw.split(",") if part.strip()]  # tasks.mix=a=2,b=1
        return {k.strip(): _number(v.strip()) for k, v in (p if len(p) == 2 else (p[0], "") for p in pairs)}
    return value


def _number(text: str) -> float | str:
    try:
        return float(text)
    except ValueError:
        return text


def _is_list(field: FieldInfo | None) -> bool:
    return field is not None and get_origin(field.annotation) is list


def _field(dotted: str) -> FieldInfo | None:
    """The pydantic field of a dotted config name, or None when there is none."""
    model: Any = RunConfig
    info = None
    for key in dotted.split("."):
        if not (isinstance(model, type) and issubclass(model, BaseModel)) or key not in model.model_fields:
            return None
        info = model.model_fields[key]
        model = info.annotation
    return info


def field_names() -> list[str]:
    """Every dotted config field name (``trainer.lr``, ``out``, ...)."""
    return [name for name, _default, _desc in describe_fields()]


def suggest(name: str) -> str:
    """``; did you mean X?`` naming the config fields closest to ``name`` (by whole name, or by the last part in
    any section: ``rl.lrr`` -> ``trainer.lr``), or "" when none is close."""
    import difflib

    names = [n for n in field_names() if n != name]
    leaves = {n: n.rsplit(".", 1)[-1] for n in names}
    near_leaves = set(difflib.get_close_matches(name.rsplit(".", 1)[-1], set(leaves.values()), n=3, cutoff=0.75))
    close = [n for n, leaf in leaves.items() if leaf in near_leaves]
    close += difflib.get_close_matches(name, names, n=3, cutoff=0.7)
    close = list(dict.fromkeys(close))[:4]
    return f"; did you mean {' or '.join(close)}?" if close else ""


def _set_path(data: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted}: {key} is not a section")
    node[keys[-1]] = value


def _format_error(source: str, err: ValidationError) -> str:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    msg = first["msg"]
    if first["type"] == "extra_forbidden":
        msg = "unknown field" + suggest(loc)
    return f"{source}: {loc}: {msg}"


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                base: dict[str, Any] | None = None) -> RunConfig:
    """Load a RunConfig from a TOML file (or a run directory's ``config.json``), then apply ``key.path=value``
    overrides. An empty ``name`` becomes
    the file's name without ``.toml`` (``run`` without a file)."""
    data: dict[str, Any] = dict(base or {})
    source = "<defaults>"
    if path is not None:
        source = str(path)
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"{path}: config file not found")
        try:
            text = p.read_text(encoding="utf-8")
            data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)  # a run's config.json too
        except (tomllib.TOMLDecodeError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path}: invalid {'JSON' if p.suffix == '.json' else 'TOML'}: {e}") from None
        except OSError as e:  # unreadable (permissions, a directory in disguise)
            raise ConfigError(f"{path}: cannot read: {e.strerror or e}") from None
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. trainer.lr=1e-4")
        key, raw = item.split("=", 1)
        _set_path(data, key.strip(), _parse_value(raw.strip(), _field(key.strip())))
    if overrides:
        source += " (with overrides)"
    try:
        cfg = RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_error(source, e)) from None
    if not cfg.name:
        cfg.name = Path(path).stem if path is not None else "run"
    return cfg


def describe_fields(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted name, default, description) for every field: the config reference."""
    rows: list[tuple[str, str, str]] = []
    for name, info in model.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows.extend(describe_fields(ann, f"{prefix}{name}."))
        else:
            default = info.get_default(call_default_factory=True)
            rows.append((f"{prefix}{name}", json.dumps(default), info.description or ""))
    return rows
