import pytest

from albatross.harness.chat import TinyChatFormat, TinyTokenizer
from albatross.harness.parsers import FormatError, parse_bash_block


def tok():
    return TinyTokenizer.from_corpus(["Count the lines in apple.txt and write the number to answer.txt."])


def test_roundtrip_any_text():
    t = tok()
    for text in ["wc -l < apple.txt > answer.txt", "ünïcode ✓ \x00 bytes\n\t", "", "```bash\nls\n```"]:
        assert t.decode(t.encode(text)) == text


def test_known_words_are_single_tokens():
    t = tok()
    assert len(t.encode(" apple")) == 1
    assert len(t.encode("apple.txt")) == 2
    assert len(t.encode("zebra")) == 5  # unknown word: bytes


def test_save_load(tmp_path):
    t = tok()
    t.save(tmp_path)
    t2 = TinyTokenizer.load(tmp_path)
    assert t2.vocab == t.vocab


def test_chat_format_is_append_only():
    t = tok()
    fmt = TinyChatFormat(t)
    prompt = fmt.initial_prompt("Count the lines in apple.txt")
    action = fmt.action("```bash\nwc -l < apple.txt\n```")
    obs = fmt.observation("3\n")
    ids = prompt + action + obs
    assert ids[: len(prompt)] == prompt
    assert action[-1] in fmt.stop_ids
    assert t.decode(obs) == "3\n"


def test_parse_bash_block():
    assert parse_bash_block("```bash\nls -l\n```") == "ls -l"
    with pytest.raises(FormatError):
        parse_bash_block("just text")
    with pytest.raises(FormatError):
        parse_bash_block("```bash\na\n``` ```bash\nb\n```")
    with pytest.raises(FormatError):
        parse_bash_block("```bash\n\n```")


# ---- chat formats: demo layout, tools, HF chat templates ------------------------------------------------

from albatross.config import HarnessConfig  # noqa: E402
from albatross.harness.chat import make_chat_format  # noqa: E402
from albatross.harness.hf_chat import HFChatFormat, toy_chatml_tokenizer  # noqa: E402
from albatross.harness.tools import TOOLS, tool_call_text  # noqa: E402


def test_tiny_prompt_is_unchanged_without_tools_and_lists_tools_with_them():
    t = tok()
    fmt = TinyChatFormat(t)
    plain = fmt.initial_prompt("  Count the lines in apple.txt\n")
    assert plain == [t.special("<|user|>")] + t.encode("Count the lines in apple.txt") + [t.special("<|assistant|>")]
    with_tools = t.decode(fmt.initial_prompt("Count the lines", TOOLS))
    assert "<tool_call>" in with_tools and all(x["function"]["name"] in with_tools for x in TOOLS)
    assert fmt.observation("3\n", closed=False) == fmt.observation("3\n") == fmt.user("3\n")


@pytest.fixture(scope="module")
def hf_tok():
    return toy_chatml_tokenizer(["hello world ls -la cat file.txt count the lines", tool_call_text("bash", command="ls")])


def _conversation():
    return [{"role": "user", "content": "Count the lines"},
            {"role": "assistant", "content": tool_call_text("bash", command="wc -l a.txt")},
            {"role": "tool", "content": "3 a.txt\n"},
            {"role": "assistant", "content": tool_call_text("submit")},
            {"role": "user", "content": "Summarise."}]


def test_hf_deltas_reproduce_the_template_token_for_token(hf_tok):
    fmt = HFChatFormat(hf_tok, observation_role="tool")
    msgs = _conversation()
    ids = fmt.initial_prompt(msgs[0]["content"], TOOLS)
    ids += fmt.action(msgs[1]["content"]) + fmt.observation(msgs[2]["content"])
    ids += fmt.action(msgs[3]["content"]) + fmt.user(msgs[4]["content"])
    full = hf_tok.apply_chat_template(msgs, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert hf_tok.decode(ids) == full
    assert ids == hf_tok.encode(full, add_special_tokens=False)
    assert fmt.stop_ids[0] == hf_tok.convert_tokens_to_ids("<|im_end|>")
    assert fmt.decode(fmt.action("hi")) == "hi"


def test_hf_unclosed_completion_gets_the_turn_end_first(hf_tok):
    fmt = HFChatFormat(hf_tok, observation_role="user")
    closed, unclosed = fmt.observation("x"), fmt.observation("x", closed=False)
    assert unclosed[0] == fmt.stop_ids[0] and unclosed[1:] == closed
    assert hf_tok.decode(closed).startswith("\n<|im_start|>user\nx<|im_end|>")


def test_hf_templates_that_rewrite_history_are_detected_and_broken_ones_refused(hf_tok):
    counting = "{{ messages|length }}{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}"
    fmt = HFChatFormat(hf_tok, template=counting)
    assert not fmt.append_only and fmt.template_drift().startswith("the first prompt differs")
    assert HFChatFormat(hf_tok).append_only
    rewriting = "{% for m in messages %}<|im_start|>{{ m.content }}{{ '' if loop.last else '!' }}<|im_end|>{% endfor %}"
    with pytest.raises(ValueError, match="no longer renders"):
        HFChatFormat(hf_tok, template=rewriting).observation("x")
    no_stop = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    with pytest.raises(ValueError, match="special token"):
        HFChatFormat(hf_tok, template=no_stop)


def test_make_chat_format_follows_the_tokenizer_and_action_format(hf_tok):
    assert isinstance(make_chat_format(tok(), HarnessConfig()), TinyChatFormat)
    tools = make_chat_format(hf_tok, HarnessConfig().model_copy(update={"action_format": "tool_calls"}))
    assert isinstance(tools, HFChatFormat) and tools.observation_role == "tool"
    assert make_chat_format(hf_tok, HarnessConfig(action_format="bash_block")).observation_role == "user"
    assert make_chat_format(hf_tok, HarnessConfig()).observation_role == "tool"  # auto: ChatML has <tool_call>
