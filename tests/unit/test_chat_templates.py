"""Chat templates, token-in/token-out: the demo tokenizer as a transformers tokenizer, one loader, the template
check, and for several template styles the proof that what the harness concatenates is what the template renders
(or exactly where and why not)."""

import json
import shutil
from pathlib import Path

import pytest

from albatross.config import HarnessConfig
from albatross.engine.base import Completion, SamplingParams, SingleEngine
from albatross.engine.tokenizer import LEGACY_TINY, TINY_CHAT_TEMPLATE, load_tokenizer, tiny_hf_tokenizer
from albatross.harness.agent import Agent, AttemptSpec
from albatross.harness.chat import TinyChatFormat, TinyTokenizer, make_chat_format, resolve_action_format
from albatross.harness.hf_chat import HFChatFormat, check_chat_template, strip_reasoning, toy_chatml_tokenizer
from albatross.harness.templates import toy_tokenizer
from albatross.harness.tools import TOOLS, tool_call_text
from albatross.sandbox import local_available, make_backend
from albatross.sandbox.base import Limits
from albatross.tasks.builtin import DEMO_FAMILIES, corpus_strings, generate_tasks
from albatross.tasks.format import load_tasks

OBSERVATIONS = ["3 apple.txt\n", "bash: line 1: albatross: command not found\n", "ls: cannot access 'zebra.txt'\n",
                "ünïcode ✓ \x00 bytes\n\t", "", "a\nab\nabc b l w\n", "total 8\n-rw-r--r-- 1 root root 12 a.log\n"]


@pytest.fixture(scope="module")
def demo_tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    paths = generate_tasks(root, n_train=12, n_heldout=6, seed=3)
    return load_tasks(paths["train"]) + load_tasks(paths["heldout"])


@pytest.fixture(scope="module")
def tiny():
    return TinyTokenizer.from_corpus(corpus_strings(DEMO_FAMILIES))


@pytest.fixture(scope="module")
def tiny_dir(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny-model")
    tiny.save(out)
    return out


def _task_texts(tasks) -> list[str]:
    texts = []
    for task in tasks:
        texts.append(task.instruction)
        texts += [f"```bash\n{step}\n```" for step in task.demo_steps or []]
        texts += [p.read_text(errors="replace")[:4000] for p in Path(task.env_dir).rglob("*") if p.is_file()]
    return texts


# ---- the demo tokenizer as a transformers tokenizer ------------------------------------------------------


def test_tiny_hf_tokenizer_gives_the_tiny_ids_for_corpus_tasks_and_observations(tiny, demo_tasks):
    hf = tiny_hf_tokenizer(tiny.words)
    # each task's environment carries the same vendored verifier packages (~950 files): once each is enough
    texts = list(dict.fromkeys(corpus_strings(DEMO_FAMILIES) + _task_texts(demo_tasks) + OBSERVATIONS))
    assert len(texts) > 100
    for text in texts:
        ids = hf.encode(text, add_special_tokens=False)
        assert ids == tiny.encode(text), text
        assert hf.decode(ids) == text
    assert len(hf) == tiny.vocab_size
    # unknown words are bytes, even where a one-letter word ("a", "l") would fit inside them
    assert hf.encode("ab", add_special_tokens=False) == tiny.encode("ab") == [6 + ord("a"), 6 + ord("b")]


def test_special_token_strings_are_special_tokens_in_the_transformers_tokenizer(tiny):
    hf = tiny_hf_tokenizer(tiny.words)
    assert hf.encode("<|end|>", add_special_tokens=False) == [tiny.special("<|end|>")]
    assert len(tiny.encode("<|end|>")) > 1  # the legacy tokenizer spells it out


def test_save_writes_transformers_files_and_load_tokenizer_reads_them(tiny, tiny_dir, tmp_path):
    assert {"tokenizer.json", "tokenizer_config.json", LEGACY_TINY} <= {p.name for p in tiny_dir.iterdir()}
    tok = load_tokenizer(tiny_dir)
    assert tok.chat_template == TINY_CHAT_TEMPLATE
    assert tok.encode("wc -l < kiwi.txt", add_special_tokens=False) == tiny.encode("wc -l < kiwi.txt")
    assert tok.eos_token_id == tiny.eos_id and tok.pad_token_id == tiny.pad_id
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    shutil.copy(tiny_dir / LEGACY_TINY, legacy / LEGACY_TINY)
    assert load_tokenizer(legacy).encode("count the lines", add_special_tokens=False) == tiny.encode(
        "count the lines")
    assert TinyTokenizer.load(tiny_dir).vocab == tiny.vocab


def test_load_tokenizer_errors_are_one_line_naming_the_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found") as e:
        load_tokenizer(tmp_path / "nope")
    assert str(tmp_path / "nope") in str(e.value)
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="do not load") as e:
        load_tokenizer(tmp_path)
    assert str(tmp_path) in str(e.value) and "\n" not in str(e.value)


def test_hf_chat_format_over_the_tiny_tokenizer_gives_the_tiny_chat_format_ids(tiny, tiny_dir):
    tiny_fmt, hf = TinyChatFormat(tiny), load_tokenizer(tiny_dir)
    for role in ("user", "tool"):
        fmt = HFChatFormat(hf, observation_role=role)
        assert fmt.append_only and not fmt.supports_tool_calls
        assert fmt.stop_ids == tiny_fmt.stop_ids
        for instruction in ["Count the lines in apple.txt and write the number to answer.txt.", "  zebra ü\n"]:
            assert fmt.initial_prompt(instruction) == tiny_fmt.initial_prompt(instruction)
            assert fmt.initial_prompt(instruction, TOOLS) == tiny_fmt.initial_prompt(instruction, TOOLS)
        for text in OBSERVATIONS:
            assert fmt.observation(text) == tiny_fmt.observation(text)
            assert fmt.user(text) == tiny_fmt.user(text)
            assert fmt.action(text) == tiny_fmt.action(text)
        turns = [("```bash\nwc -l < apple.txt\n```", "3\n"), ("```bash\nsubmit\n```", "")]
        assert fmt.conversation("Count", None, turns) == tiny_fmt.conversation("Count", None, turns)
        assert fmt.decode(fmt.action("```bash\nls\n```")) == "```bash\nls\n```"


# ---- action format -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus():
    return (corpus_strings() + [t["function"]["description"] for t in TOOLS] + OBSERVATIONS
            + ["<think>\nplan\n</think>\n\n", "hello\n\nworld\n\n", tool_call_text("bash", command="ls -la")])


@pytest.fixture(scope="module")
def toys(corpus):
    return {style: toy_tokenizer(style, corpus) for style in ("qwen3", "llama3", "gemma")} | {
        "chatml": toy_chatml_tokenizer(corpus)}


def test_auto_action_format_follows_the_template(tiny_dir, toys):
    auto = HarnessConfig()
    assert auto.action_format == "auto"
    expect = {"qwen3": "tool_calls", "chatml": "tool_calls", "llama3": "bash_block", "gemma": "bash_block"}
    for style, want in expect.items():
        fmt = make_chat_format(toys[style], auto)
        assert resolve_action_format(auto, fmt) == want, style
        assert fmt.observation_role == ("tool" if want == "tool_calls" else "user")
    demo = make_chat_format(load_tokenizer(tiny_dir), auto)  # its template lists tools but has no tool token
    assert resolve_action_format(auto, demo) == "bash_block" and demo.observation_role == "user"
    forced = HarnessConfig(action_format="tool_calls")
    assert make_chat_format(toys["llama3"], forced).observation_role == "tool"
    assert resolve_action_format(HarnessConfig(action_format="bash_block"), toys_fmt(toys, "qwen3")) == "bash_block"


def toys_fmt(toys, style, role="tool", system=""):
    return HFChatFormat(toys[style], observation_role=role, system=system)


def test_a_template_without_a_tool_format_gets_the_tool_list_in_the_user_message(toys):
    fmt = toys_fmt(toys, "gemma")
    assert not fmt.renders_tools and toys_fmt(toys, "qwen3").renders_tools
    text = toys["gemma"].decode(fmt.initial_prompt("Count the lines", TOOLS))
    assert "Count the lines\n\nCall exactly one tool per turn" in text and "- read_file(" in text


# ---- the template-equivalence proof ---------------------------------------------------------------------

TURNS = [("<think>\nI count the lines.\n</think>\n\n" + tool_call_text("bash", command="wc -l < apple.txt"), "3\n"),
         ("```bash\ncat answer.txt\n```", "3\nhello\n\nworld\n"),
         ("<think>\nDone.\n</think>\n\n" + tool_call_text("submit"), "")]


@pytest.mark.parametrize("style", ["chatml", "qwen3", "llama3", "gemma"])
def test_whole_conversation_renders_as_the_concatenation_the_trainer_trains_on(toys, style):
    """system + user with tools + (assistant, tool)*: the template's text of the whole conversation is the
    concatenation of the first prompt, the completions and the observation deltas. The ids are equal too,
    except where a BPE merge would cross a message boundary (Llama's ``<|end_header_id|>\\n\\n`` + completion):
    there the concatenation keeps each piece's own ids, which is what the engine saw."""
    tok, fmt = toys[style], toys_fmt(toys, style, system="You are terse.")
    assert fmt.append_only, fmt.template_drift()
    concat, bounds = fmt.initial_prompt("Count the lines in apple.txt", TOOLS), []
    for action, obs in TURNS:
        bounds.append(len(concat))
        concat += fmt.action(action)
        bounds.append(len(concat))
        concat += fmt.observation(obs)
    full_text = tok.apply_chat_template(fmt._messages("Count the lines in apple.txt", TOOLS, TURNS), tools=TOOLS,
                                        tokenize=False, add_generation_prompt=True)
    assert tok.decode(concat, skip_special_tokens=False) == full_text
    full = tok.encode(full_text, add_special_tokens=False)
    if style != "llama3":
        assert concat == full
        return
    first = next(i for i, (a, b) in enumerate(zip(concat, full, strict=False)) if a != b)
    assert first + 1 in bounds, "the ids differ only at a message boundary"
    assert tok.convert_ids_to_tokens(concat[first:first + 1]) == ["ĊĊ"]  # "\n\n" then the completion
    assert tok.convert_ids_to_tokens(full[first:first + 2]) == ["Ċ", "Ċ"]


def test_qwen3_drops_earlier_think_blocks_after_a_user_message_and_the_check_says_where(toys):
    assert toys_fmt(toys, "qwen3", role="tool").template_drift() is None
    drift = toys_fmt(toys, "qwen3", role="user").template_drift()
    assert drift is not None and drift.startswith("action 1 differs") and "<think>" in drift
    assert not toys_fmt(toys, "qwen3", role="user").append_only
    # non-canonical reasoning whitespace is normalised by the template: the harness keeps what the model wrote
    fmt = toys_fmt(toys, "qwen3")
    terse = [("<think>plan</think>ls", "x\n"), ("ok", "y\n")]
    assert fmt._find_drift(terse) is not None and fmt._find_drift([("ls", "x\n"), ("ok", "y\n")]) is None


def test_strip_reasoning():
    assert strip_reasoning("<think>\nplan\n</think>\n\n```bash\nls\n```") == "```bash\nls\n```"
    assert strip_reasoning("no reasoning") == "no reasoning"


# ---- the agent: one sample per turn for history-rewriting templates, exact ids always ---------------------


class Scripted(SingleEngine):
    """A fake engine: the i-th call answers ``ids[i]`` (exact token ids), and records each prompt."""

    def __init__(self, ids: list[list[int]]) -> None:
        self.ids, self.prompts = ids, []

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        out = []
        for prompt in prompts:
            ids = self.ids[min(len(self.prompts), len(self.ids) - 1)]
            self.prompts.append(list(prompt))
            out.append(Completion(list(ids), [-0.5] * len(ids), [2] * len(ids), "stop"))
        return out


@pytest.fixture(scope="module")
def count_task(tmp_path_factory):
    root = tmp_path_factory.mktemp("count")
    return load_tasks(generate_tasks(root, families=["count_lines"], n_train=1, n_heldout=0, seed=4)["train"])[0]


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    """The isolated sandbox where this machine has it (tasks run in /app); else the unisolated one, where a
    task's verifier cannot run (the attempt ends as infra_error, its turns and samples are still recorded)."""
    b = (make_backend("local", hide_paths=[str(tmp_path_factory.getbasetemp())]) if local_available()
         else make_backend("process"))
    yield b
    b.close()


def _ended(traj, n_turns: int) -> bool:
    """Every scripted turn ran; solved where the sandbox can verify."""
    return len(traj.turns) == n_turns and (traj.success if local_available() else traj.status == "infra_error")


def _run(backend, fmt, cfg, actions_ids, task):
    engine = Scripted(actions_ids)
    agent = Agent(engine, backend, fmt, cfg, SamplingParams(), Limits(command_timeout_s=10))
    return agent.run(AttemptSpec(task, "g", 0)), engine


def _solution(task, think: bool) -> list[str]:
    steps = [f"```bash\n{s}\n```" for s in task.demo_steps]
    return [(f"<think>\nstep {i}\n</think>\n\n" if think else "") + s for i, s in enumerate(steps)]


def test_history_rewriting_template_starts_a_new_sample_per_turn(toys, count_task, backend):
    fmt = make_chat_format(toys["qwen3"], HarnessConfig(action_format="bash_block"))
    assert fmt.observation_role == "user" and not fmt.append_only
    actions = [fmt.action(a) for a in _solution(count_task, think=True)]
    cfg = HarnessConfig(action_format="bash_block", max_turns=8, max_tokens_per_turn=400, max_context_tokens=8000)
    traj, engine = _run(backend, fmt, cfg, actions, count_task)
    assert _ended(traj, len(actions)), (traj.status, traj.error)
    assert len(traj.samples) == len(traj.turns)  # one sample per turn
    tok = toys["qwen3"]
    for k, (sample, prompt) in enumerate(zip(traj.samples, engine.prompts, strict=True)):
        cut = len(prompt)
        assert sample.token_ids[:cut] == prompt and sample.token_ids[cut:cut + len(actions[k])] == actions[k]
        assert sum(sample.loss_mask) == len(actions[k])  # only this turn's completion is trained on
        turns = [(t.action, t.observation) for t in traj.turns[:k]]
        assert prompt == fmt.conversation(count_task.instruction, None, turns)  # the template's own rendering
        assert tok.decode(prompt, skip_special_tokens=False).count("<think>") == 0  # earlier reasoning dropped


def test_append_only_template_keeps_one_sample_and_strip_reasoning_splits_it(toys, count_task, backend):
    fmt = make_chat_format(toys["qwen3"], HarnessConfig(action_format="bash_block"))
    fmt.observation_role = "tool"  # tool results keep the history (and reasoning) as rendered
    actions = [fmt.action(a) for a in _solution(count_task, think=True)]
    cfg = HarnessConfig(action_format="bash_block", max_turns=8, max_tokens_per_turn=400, max_context_tokens=8000)
    kept, _ = _run(backend, fmt, cfg, actions, count_task)
    assert _ended(kept, len(actions)) and len(kept.samples) == 1
    assert sum(kept.samples[0].loss_mask) == sum(len(a) for a in actions)
    stripped, engine = _run(backend, fmt, cfg.model_copy(update={"reasoning": "strip"}), actions, count_task)
    assert _ended(stripped, len(actions)) and len(stripped.samples) == len(stripped.turns)
    last = toys["qwen3"].decode(engine.prompts[-1], skip_special_tokens=False)
    assert "step 0" not in last and all(s in last for s in count_task.demo_steps[:-1])


def test_completion_ids_are_never_retokenised(toys, count_task, backend):
    """A completion in ids that the tokenizer would merge differently (one token per character) stays exactly as
    the engine wrote it: decoding the sample and encoding it again would change it."""
    tok = toys["chatml"]
    fmt = make_chat_format(tok, HarnessConfig())
    odd = [sum((tok.encode(ch, add_special_tokens=False) for ch in text), []) + [fmt.stop_ids[0]]
           for text in [tool_call_text("bash", command=s) for s in count_task.demo_steps[:-1]]
           + [tool_call_text("submit")]]
    cfg = HarnessConfig(max_turns=8, max_tokens_per_turn=400, max_context_tokens=8000)
    traj, engine = _run(backend, fmt, cfg, odd, count_task)
    assert _ended(traj, len(odd)) and len(traj.samples) == 1
    sample = traj.samples[0]
    model_ids = [i for i, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m]
    assert model_ids == sum(odd, [])
    assert tok.encode(tok.decode(sample.token_ids, skip_special_tokens=False), add_special_tokens=False) != \
        sample.token_ids


# ---- the start-up check -----------------------------------------------------------------------------------


def test_check_chat_template_accepts_real_styles_and_names_what_is_wrong(toys, tiny_dir, tmp_path):
    for tok in [*toys.values(), load_tokenizer(tiny_dir)]:
        check_chat_template(tok, tmp_path)  # history-rewriting Qwen3 included: a new sample per turn
    check_chat_template(toys["qwen3"], tmp_path, observation_role="user")
    bare = toy_chatml_tokenizer(["hello world"])
    bare.chat_template = None
    with pytest.raises(ValueError, match="no chat template") as e:
        check_chat_template(bare, tmp_path / "m")
    assert str(e.value).startswith(str(tmp_path / "m"))
    bare.chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    with pytest.raises(ValueError, match="special token to stop on"):
        check_chat_template(bare, tmp_path)
    bare.chat_template = ("{% for m in messages %}<|im_start|>{{ m.content }}{{ '' if loop.last else '!' }}"
                          "<|im_end|>{% endfor %}")
    with pytest.raises(ValueError, match="no longer renders"):
        check_chat_template(bare, tmp_path)


def test_check_chat_template_refuses_a_tokenizer_that_does_not_round_trip(tmp_path, corpus):
    from tokenizers import normalizers

    tok = toy_tokenizer("llama3", corpus)
    tok.backend_tokenizer.normalizer = normalizers.Lowercase()
    with pytest.raises(ValueError, match="does not round-trip") as e:
        check_chat_template(tok, tmp_path)
    assert "\n" not in str(e.value)


def test_saved_toy_tokenizers_load_with_their_templates(toys, tmp_path):
    for style, tok in toys.items():
        tok.save_pretrained(tmp_path / style)
        back = load_tokenizer(tmp_path / style)
        assert back.chat_template == tok.chat_template
        check_chat_template(back, tmp_path / style)
        assert json.loads((tmp_path / style / "tokenizer_config.json").read_text())["eos_token"] == tok.eos_token


@pytest.mark.parametrize("style", ["chatml", "qwen3", "llama3", "gemma", "tiny"])
def test_an_attempt_in_each_template_is_that_templates_rendering(toys, tiny_dir, count_task, backend, style):
    """The oracle, played through the real agent with ``action_format = "auto"``: the attempt's one sample
    decodes to the template's rendering of its conversation, then the last action and its stop token."""
    tok = load_tokenizer(tiny_dir) if style == "tiny" else toys[style]
    fmt = make_chat_format(tok, HarnessConfig())
    tools = resolve_action_format(HarnessConfig(), fmt) == "tool_calls"
    texts = ([tool_call_text("bash", command=s) for s in count_task.demo_steps[:-1]] + [tool_call_text("submit")]
             if tools else [f"```bash\n{s}\n```" for s in count_task.demo_steps])
    cfg = HarnessConfig(max_turns=8, max_tokens_per_turn=400, max_context_tokens=8000)
    traj, _ = _run(backend, fmt, cfg, [fmt.action(t) for t in texts], count_task)
    assert _ended(traj, len(texts)) and len(traj.samples) == 1, (traj.status, traj.error)
    turns = [(t.action, t.observation) for t in traj.turns[:-1]]
    rendered = tok.apply_chat_template(fmt._messages(count_task.instruction, TOOLS if tools else None, turns),
                                       tools=TOOLS if tools else None, tokenize=False, add_generation_prompt=True)
    stop = tok.convert_ids_to_tokens(fmt.stop_ids[0])
    assert tok.decode(traj.samples[0].token_ids, skip_special_tokens=False) == rendered + texts[-1] + stop
