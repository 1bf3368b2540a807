import pytest

from albatross.bench.harness import ScriptedPolicy
from albatross.engine.base import SamplingParams
from albatross.harness.chat import TinyChatFormat, TinyTokenizer
from albatross.harness.context import SUMMARY_HEADER, SUMMARY_REQUEST, Context, masked_note
from albatross.harness.tools import (
    Toolbox,
    ToolError,
    _whole_lines,
    format_observation,
    looks_binary,
    replace_exact,
    truncate_middle,
)
from albatross.sandbox.base import ExecResult


def fmt() -> TinyChatFormat:
    return TinyChatFormat(TinyTokenizer.from_corpus(["count the lines in apple.txt", SUMMARY_REQUEST]))


def play(ctx: Context, n: int, obs: str = "line\n" * 30) -> None:
    for i in range(n):
        ids = ctx.fmt.action(f"```bash\necho {i}\n```")
        ctx.add_action(ids, [-0.5] * len(ids), [3] * len(ids))
        ctx.add_observation(f"{i}: {obs}")


def test_context_is_append_only_token_in_token_out():
    ctx = Context(fmt(), "count the lines in apple.txt")
    prompt = list(ctx.sample.token_ids)
    play(ctx, 3)
    ids = ctx.sample.token_ids
    assert ids[: len(prompt)] == prompt
    rebuilt = list(prompt)
    for t in ctx.turns:
        rebuilt += t.action + t.observation
    assert rebuilt == ids
    assert ctx.sample.num_model_tokens == sum(len(t.action) for t in ctx.turns)
    assert all(t.closed for t in ctx.turns)
    assert ctx.masked_ids(keep=3) == ids  # nothing old enough to mask


def test_masking_keeps_actions_and_the_last_observations():
    f = fmt()
    ctx = Context(f, "count the lines in apple.txt")
    play(ctx, 5)
    masked = ctx.masked_ids(keep=2)
    assert len(masked) < len(ctx)
    text = f.tokenizer.decode(masked)
    for i in range(5):
        assert f"echo {i}" in text  # every action is kept, token for token
    assert "0: line" not in text and "2: line" not in text
    assert "3: line" in text and "4: line" in text
    assert text.count("[output omitted to save context") == 3
    assert masked_note(len(ctx.turns[0].observation)) in f.tokenizer.decode(ctx.turns[0].masked)


def test_summary_context_starts_from_the_instruction_plus_summary():
    f = fmt()
    ctx = Context(f, "count the lines in apple.txt")
    play(ctx, 6)
    ids = ctx.summarised("I counted nothing yet", keep=1)
    text = f.tokenizer.decode(ids)
    assert text.startswith("count the lines in apple.txt" + SUMMARY_HEADER + "I counted nothing yet")
    assert "echo 5" in text and "5: line" in text and "echo 4" not in text
    sample = ctx.restart(ids)
    assert sample.token_ids == ids and sample.num_model_tokens == 0 and set(sample.versions) == {-1}
    play(ctx, 1)  # the turn after a summary masks relative to the summary point
    assert "echo 0" in f.tokenizer.decode(ctx.sample.token_ids)


def test_scripted_policy_answers_summary_requests_without_advancing():
    f = fmt()
    policy = ScriptedPolicy(["```bash\nls\n```", "```bash\nsubmit\n```"], f)
    params = SamplingParams(max_tokens=200)
    prompt = f.initial_prompt("count")
    first = policy.generate([prompt], params)[0]
    asked = prompt + first.token_ids + f.user(SUMMARY_REQUEST, closed=False)
    summary = f.tokenizer.decode(policy.generate([asked], params)[0].token_ids)
    assert summary.startswith("Commands run so far: ls")
    assert f.tokenizer.decode(policy.generate([prompt], params)[0].token_ids).strip().endswith("submit\n```")
    assert len(policy.generate([asked], SamplingParams(max_tokens=3))[0].token_ids) == 3


def test_replace_exact():
    assert replace_exact("a b a", "b", "c", False) == ("a c a", 1)
    assert replace_exact("a b a", "a", "x", True) == ("x b x", 2)
    with pytest.raises(ToolError, match="not found"):
        replace_exact("abc", "z", "y", False)
    with pytest.raises(ToolError, match="occurs 2 times"):
        replace_exact("a b a", "a", "x", False)
    with pytest.raises(ToolError, match="empty"):
        replace_exact("abc", "", "y", False)


def test_output_helpers():
    assert looks_binary("a\x00b") and looks_binary("\ufffd" * 50 + "x")
    assert not looks_binary("plain text\n\twith tabs and ünïcode ✓\n")
    assert _whole_lines("1\n2\n3", "4\n5\n6\n") == ("1\n2\n", "5\n6\n")
    assert _whole_lines("abc", "def") == ("abc\n", "def")
    assert truncate_middle("x" * 1000, 100).count("x") < 100
    obs = format_observation(ExecResult("out\n", -1, True, 3.0), 400)
    assert obs.startswith("out\n") and "timed out after 3s" in obs
    assert format_observation(ExecResult("", 2), 400) == "[exit code 2]\n"


def test_rendered_output_trailer_is_parsed():
    assert Toolbox._parse("no trailer here", "abc") is None
    short = Toolbox._parse("hello\n\nabc|0|6|", "abc")
    assert (short.body, short.exit_code, short.size, short.path) == ("hello\n", 0, 6, "")
    long = Toolbox._parse("HEAD\nabc|cut\nTAIL\nabc|3|99999|/tmp/albatross/out/1.log", "abc")
    assert (long.body, long.tail, long.exit_code, long.path) == ("HEAD", "TAIL", 3, "/tmp/albatross/out/1.log")
