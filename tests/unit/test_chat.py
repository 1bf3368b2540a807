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
