"""Every harness tool through a real sandbox, and the agent loop's formats, budgets and compression."""

import os
import time
from pathlib import Path

import pytest

from albatross.bench.harness import ScriptedPolicy
from albatross.config import HarnessConfig
from albatross.engine.base import SamplingParams
from albatross.harness.agent import Agent, AttemptSpec
from albatross.harness.chat import TinyChatFormat, TinyTokenizer
from albatross.harness.context import SUMMARY_REQUEST
from albatross.harness.hf_chat import HFChatFormat, toy_chatml_tokenizer
from albatross.harness.parsers import Action
from albatross.harness.tools import TOOLS, Toolbox, tool_call_text
from albatross.sandbox import local_available, make_backend
from albatross.sandbox.base import Limits
from albatross.tasks.builtin import corpus_strings, generate_tasks
from albatross.tasks.format import load_tasks

pytestmark = pytest.mark.skipif(not local_available(), reason="needs root, user/mount namespaces and overlayfs")


@pytest.fixture(scope="module")
def backend(tmp_path_factory):
    b = make_backend("local", hide_paths=[str(tmp_path_factory.getbasetemp())])
    yield b
    b.close()


@pytest.fixture
def box(backend):
    attempt = backend.fork(None, "/app", Limits(command_timeout_s=5))
    toolbox = Toolbox(attempt, limit=400, command_timeout_s=5)
    toolbox.setup()
    yield toolbox
    attempt.close()


def call(box: Toolbox, tool: str, **args) -> str:
    return box.call(Action(tool, args)).text


def _host_procs_with(marker: str) -> list[int]:
    """Live (not zombie) host processes whose command line contains ``marker``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            alive = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
            if alive and marker in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode():
                found.append(int(pid))
        except (OSError, IndexError):
            continue
    return found


def _wait_for(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# ---- bash: a persistent session -------------------------------------------------------------------------


def test_session_keeps_cwd_env_and_functions(box):
    assert call(box, "bash", command="mkdir -p w && cd w && export GREETING=hi && greet() { echo \"$GREETING $1\"; }") == ""
    assert call(box, "bash", command="pwd; greet there") == "/app/w\nhi there\n"
    assert call(box, "bash", command="ls /nope").endswith("[exit code 2]\n")


def test_timeout_interrupts_the_command_not_the_session(box):
    call(box, "bash", command="cd /tmp && export KEEP=1")
    t0 = time.monotonic()
    obs = box.call(Action("bash", {"command": "echo started; while true; do :; done", "timeout": 2}))
    assert obs.timed_out and obs.exit_code == -1 and time.monotonic() - t0 < 6
    assert obs.text.startswith("started\n") and "timed out after 2s" in obs.text
    assert call(box, "bash", command="pwd; echo $KEEP") == "/tmp\n1\n"


def test_ten_megabytes_of_output_go_to_a_file(box):
    obs = call(box, "bash", command="seq 1 1500000")  # 10.4 MB
    assert len(obs) < 800
    assert obs.startswith("1\n2\n3\n") and obs.endswith("1499999\n1500000\n")
    size = len("".join(f"{i}\n" for i in range(1, 1500001)))
    assert f"bytes left out; the whole output ({size} bytes) is in /tmp/albatross/out/" in obs
    path = obs.split(" is in ")[1].split()[0]
    hits = sum("77777" in str(i) for i in range(1, 1500001))
    assert call(box, "bash", command=f"wc -c < {path}; grep -c 77777 {path}") == f"{size}\n{hits}\n"


def test_binary_output_is_described_not_shown(box):
    obs = call(box, "bash", command="head -c 5000 /dev/urandom")
    assert obs.startswith("[binary output: 5000 bytes; saved to /tmp/albatross/out/")
    path = obs.split("saved to ")[1].split(";")[0]
    assert call(box, "bash", command=f"wc -c < {path}") == "5000\n"
    assert call(box, "bash", command="printf 'a\\001\\002\\003\\004\\005\\006b'").startswith("[binary output")
    # an incomplete UTF-8 sequence then a NUL: in a UTF-8 locale bash's read -N stopped there (random bytes hit
    # it about one time in four), and 5,003 bytes showed as a 1-byte output with no file kept
    obs = call(box, "bash", command="export LC_ALL=C.UTF-8; printf 'x\\303\\000'; printf 'y%.0s' $(seq 5000)")
    assert obs.startswith("[binary output: 5003 bytes; saved to /tmp/albatross/out/"), obs
    assert call(box, "bash", command="echo $LC_ALL") == "C.UTF-8\n"  # the session's locale is left as it was


def test_exit_and_syntax_errors_still_show_output(box):
    assert call(box, "bash", command="echo bye; exit 3") == "bye\n[exit code 3]\n"
    assert "unexpected EOF" in call(box, "bash", command="echo 'unterminated")


def test_plain_mode_cuts_long_output_in_the_middle(backend):
    attempt = backend.fork(None, "/app", Limits(command_timeout_s=5))
    try:
        box = Toolbox(attempt, limit=400, command_timeout_s=5, redirect=False)
        box.setup()
        call(box, "bash", command="f() { echo fn; }")
        assert call(box, "bash", command="f") == "fn\n"
        obs = call(box, "bash", command="seq 1 100000")
        assert "characters cut" in obs and "/tmp/albatross/out" not in obs and len(obs) < 500
    finally:
        attempt.close()


# ---- background jobs -----------------------------------------------------------------------------------


def test_jobs_start_list_log_wait_kill(box):
    assert call(box, "job_start", command="for i in 1 2 3; do echo tick $i; sleep 0.3; done") == \
        "job 1 started: for i in 1 2 3; do echo tick $i; sleep 0.3; done\n"
    assert call(box, "job_list").startswith("1\trunning\t")
    assert call(box, "job_log", job_id=1).startswith("[job 1: running]\ntick 1\n")
    done = call(box, "job_wait", job_id=1, timeout=10)
    assert done == "[job 1: exited 0]\ntick 1\ntick 2\ntick 3\n"
    call(box, "job_start", command="sleep 4243.5")
    assert call(box, "job_kill", job_id=2) == "job 2 killed\n"
    assert call(box, "job_list").splitlines()[1].startswith("2\tkilled")
    assert call(box, "job_log", job_id=7) == "Error: job: no job 7; see: job list\n"
    assert call(box, "job_wait", job_id=2, timeout=1).startswith("[job 2: killed]")


def test_job_survives_a_command_timeout_and_turns(box):
    call(box, "bash", command="cd /tmp")
    call(box, "job_start", command="for i in $(seq 1 40); do echo t$i; sleep 0.1; done; pwd")
    assert box.call(Action("bash", {"command": "sleep 30", "timeout": 1})).timed_out
    assert "running" in call(box, "job_list") or "exited 0" in call(box, "job_list")
    assert call(box, "job_wait", job_id=1, timeout=10).endswith("t40\n/tmp\n")


def test_job_wait_past_its_timeout_reports_running(box):
    call(box, "job_start", command="sleep 4244.5")
    t0 = time.monotonic()
    assert call(box, "job_wait", job_id=1, timeout=1) == "[job 1: running]\n"
    assert time.monotonic() - t0 < 4


# ---- files ---------------------------------------------------------------------------------------------


def test_write_read_edit(box):
    assert call(box, "write_file", path="pkg/m.py", content="def f():\n    return 1\n\ndef g():\n    return 1\n") \
        == "wrote 45 bytes to pkg/m.py\n"
    assert call(box, "read_file", path="pkg/m.py", start_line=4, end_line=5) == "     4\tdef g():\n     5\t    return 1\n"
    missing = call(box, "edit_file", path="pkg/m.py", old_string="return 3", new_string="x")
    assert missing.startswith("Error: old_string not found in pkg/m.py")
    ambiguous = call(box, "edit_file", path="pkg/m.py", old_string="return 1", new_string="x")
    assert ambiguous.startswith("Error: old_string occurs 2 times in pkg/m.py")
    ok = call(box, "edit_file", path="pkg/m.py", old_string="g():\n    return 1", new_string="g():\n    return 2")
    assert ok == "edited pkg/m.py: replaced 1 occurrence (first at line 4)\n"
    assert call(box, "bash", command="cat pkg/m.py") == "def f():\n    return 1\n\ndef g():\n    return 2\n"
    assert call(box, "edit_file", path="pkg/m.py", old_string="return", new_string="yield", replace_all=True) \
        .startswith("edited pkg/m.py: replaced 2 occurrences")
    assert call(box, "read_file", path="nope.txt") == "Error: no such file: nope.txt\n"
    assert call(box, "edit_file", path="pkg", old_string="a", new_string="b") == "Error: not a regular file: pkg\n"


def test_large_and_odd_files(box):
    content = "".join(f"line {i} with 'quotes' and $dollars\n" for i in range(20000))  # 700 KB: many chunks
    call(box, "write_file", path="big's file.txt", content=content)
    assert call(box, "bash", command="md5sum < \"big's file.txt\"").split()[0] == \
        __import__("hashlib").md5(content.encode()).hexdigest()
    page = call(box, "read_file", path="big's file.txt", start_line=100)
    assert page.startswith("   100\tline 99 with 'quotes'") and "read on with start_line" in page
    call(box, "bash", command="head -c 300 /dev/urandom > blob.bin")
    assert call(box, "read_file", path="blob.bin").startswith("Error: blob.bin is a binary file")
    assert "not a UTF-8 text file" in call(box, "edit_file", path="blob.bin", old_string="a", new_string="b")
    assert call(box, "write_file", path="empty.txt", content="") == "wrote 0 bytes to empty.txt\n"


# ---- the agent loop: formats, budgets, compression ------------------------------------------------------


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("tasks")
    return load_tasks(generate_tasks(root, families=["count_lines"], n_train=2, n_heldout=0, seed=5)["train"])


def make_agent(backend, fmt, **knobs) -> Agent:
    known = {k: knobs.pop(k) for k in list(knobs) if k in HarnessConfig.model_fields and k != "action_format"}
    cfg = HarnessConfig(**{"max_turns": 8, "max_tokens_per_turn": 200, "max_context_tokens": 4096, **known})
    return Agent(None, backend, fmt, cfg.model_copy(update=knobs), SamplingParams(), Limits(command_timeout_s=5))


def tiny_fmt() -> TinyChatFormat:
    return TinyChatFormat(TinyTokenizer.from_corpus(corpus_strings() + [SUMMARY_REQUEST]))


def play(agent: Agent, task, actions: list[str]):
    return agent.run(AttemptSpec(task, "g", 0), engine=ScriptedPolicy(actions, agent.fmt, version=3))


def oracle_calls(task) -> list[str]:
    return [tool_call_text("bash", command=s) for s in task.demo_steps[:-1]] + [tool_call_text("submit")]


def test_tool_calls_solve_a_task_in_the_models_chat_template(backend, tasks):
    task = tasks[0]
    hf = toy_chatml_tokenizer(corpus_strings() + [t["function"]["description"] for t in TOOLS])
    agent = make_agent(backend, HFChatFormat(hf, observation_role="tool"), action_format="tool_calls")
    traj = play(agent, task, oracle_calls(task))
    assert traj.status == "ok" and traj.success, [t.observation for t in traj.turns]
    assert [t.tool for t in traj.turns] == ["bash"] * (len(task.demo_steps) - 1) + ["submit"]
    messages = [{"role": "user", "content": task.instruction.strip()}]
    for turn in traj.turns[:-1]:
        messages += [{"role": "assistant", "content": turn.action}, {"role": "tool", "content": turn.observation}]
    rendered = hf.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    sample = traj.samples[0]
    assert hf.decode(sample.token_ids) == rendered + traj.turns[-1].action + "<|im_end|>"
    assert all(v == 3 for v, m in zip(sample.versions, sample.loss_mask, strict=True) if m)


def test_malformed_json_tool_calls_become_observations_then_end_the_attempt(backend, tasks):
    agent = make_agent(backend, tiny_fmt(), action_format="tool_calls", max_format_errors=3)
    actions = ['<tool_call>{"name": "bash", "arguments": {"command": "ls"</tool_call>',
               '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
               tool_call_text("bash", command="echo fine"),  # resets the count
               '<tool_call>{"name": "read_file", "arguments": {}}</tool_call>', "prose", "more prose"]
    traj = play(agent, tasks[0], actions)
    assert traj.status == "format_error"
    obs = [t.observation for t in traj.turns]
    assert "not valid JSON" in obs[0] and "unknown tool 'nope'" in obs[1] and obs[2] == "fine\n"
    assert "read_file needs argument(s) path" in obs[3] and "no tool call" in obs[4]
    assert len(traj.turns) == 6 and traj.turns[0].tool is None and traj.turns[2].tool == "bash"


def test_each_budget_ends_the_attempt_with_its_own_status(backend, tasks):
    fmt, task = tiny_fmt(), tasks[0]
    loop = ["```bash\necho again\n```"]
    assert play(make_agent(backend, fmt, max_turns=3), task, loop).status == "max_turns"
    gen = play(make_agent(backend, fmt, max_generated_tokens=25), task, loop)
    assert gen.status == "max_tokens" and gen.completion_tokens == 25
    ctx = play(make_agent(backend, fmt, max_context_tokens=300, compression="none", max_turns=50), task,
               ["```bash\nseq 1 60\n```"])
    assert ctx.status == "max_context" and len(ctx.samples) == 1 and len(ctx.samples[0].token_ids) + 200 > 300
    slow = play(make_agent(backend, fmt, attempt_timeout_s=2.0, max_turns=50), task, ["```bash\nsleep 1\n```"])
    assert slow.status == "agent_timeout" and 2.0 < slow.wall_seconds < 8
    fmt_err = play(make_agent(backend, fmt, max_format_errors=2), task, ["no block"])
    assert fmt_err.status == "format_error"


def test_compression_fires_in_the_middle_and_the_attempt_still_solves(backend, tasks):
    task = tasks[0]
    steps = ["seq 1 30", "ls", *(f"seq {i}00 {i}30" for i in range(1, 10)), *task.demo_steps]
    agent = make_agent(backend, tiny_fmt(), max_turns=30, max_context_tokens=1200, max_tokens_per_turn=100,
                       compress_at=0.8, compress_target=0.5, keep_observations=1, summary_max_tokens=150)
    traj = play(agent, task, [f"```bash\n{s}\n```" for s in steps])
    assert traj.status == "ok" and traj.success, (traj.status, traj.error)
    assert [c["method"] for c in traj.compressions] == ["mask", "summary"]  # masking first, then a summary
    assert all(0 < c["turn"] < len(traj.turns) for c in traj.compressions)
    assert all(c["tokens_after"] < c["tokens_before"] for c in traj.compressions)
    assert len(traj.samples) > len(traj.compressions)  # the summary is a sample of its own
    assert sum(len(s.token_ids) for s in traj.samples) == traj.prompt_tokens + traj.completion_tokens
    assert sum(s.num_model_tokens for s in traj.samples) == traj.completion_tokens
    assert max(t.context_tokens for t in traj.turns) + 100 <= 0.8 * 1200
    for c in traj.compressions:  # every compressed context starts with the first prompt, masked
        sample = traj.samples[c["sample"]]
        assert sample.token_ids[: c["tokens_after"]] and sample.loss_mask[: c["tokens_after"]] == [0] * c["tokens_after"]
    summary = next(c for c in traj.compressions if c["method"] == "summary")
    text = agent.fmt.tokenizer.decode(traj.samples[summary["sample"]].token_ids)
    assert text.startswith(task.instruction.strip()) and "Commands run so far: seq 1 30; ls" in text


def test_jobs_die_with_the_attempt(backend, tasks):
    agent = make_agent(backend, tiny_fmt())
    traj = play(agent, tasks[0], ["```bash\njob start sleep 4245.25\n```", "```bash\njob list\n```",
                                  "```bash\nsubmit\n```"])
    assert traj.turns[1].observation.startswith("1\trunning\tsleep 4245.25")
    assert _wait_for(lambda: not _host_procs_with("sleep 4245.25"))


def test_jobs_die_with_an_unisolated_attempt_too(tasks):
    backend = make_backend("process")
    attempt = backend.fork(None, "/app")
    try:
        box = Toolbox(attempt, 400, 5)
        box.setup()
        assert call(box, "job_start", command="sleep 4246.75").startswith("job 1 started")
        assert _wait_for(lambda: _host_procs_with("sleep 4246.75"))
        box.kill_jobs()
        assert _wait_for(lambda: not _host_procs_with("sleep 4246.75"))
    finally:
        box.kill_jobs()
        attempt.close()
        backend.close()


def test_repo_diff_is_empty_without_a_repository_or_a_working_directory(box):
    from albatross.harness.tools import repo_diff

    call(box, "bash", command="echo x > f.txt")
    assert repo_diff(box.attempt, "/app") == ""  # no git repository here (the repository case: test_swe.py)
    assert repo_diff(box.attempt, "/gone") == ""  # a working directory the agent removed
    assert call(box, "bash", command="cat f.txt") == "x\n"  # the session goes on
