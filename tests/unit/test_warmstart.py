"""The warm start's sources: oracle demonstrations in the agent's own action format, or a JSONL of chats."""

import json

import pytest

from albatross.config import load_config
from albatross.errors import UserError
from albatross.pipeline.warmstart import chat_samples, warm_start_source
from model_dirs import bpe_tokenizer


def test_auto_is_oracle_for_the_demo_and_off_for_a_users_model(tmp_path):
    assert warm_start_source(load_config(None, [])) == "oracle"
    assert warm_start_source(load_config(None, [f"model.path={json.dumps(str(tmp_path))}"])) == "off"
    with pytest.raises(UserError, match="warmstart.chats"):
        warm_start_source(load_config(None, ["warmstart.source=chats"]))


@pytest.mark.parametrize("style", ["qwen", "llama"])
def test_chats_are_rendered_with_the_models_template_and_train_on_assistant_messages(tmp_path, style):
    tok = bpe_tokenizer(style)
    chat = [{"role": "user", "content": "count the lines of notes.txt"},
            {"role": "assistant", "content": "```bash\nwc -l < notes.txt\n```"},
            {"role": "user", "content": "3"},
            {"role": "assistant", "content": "```bash\nsubmit\n```"}]
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": chat}) + "\n\n" + json.dumps({"messages": chat[:2]}) + "\n")
    samples = chat_samples(path, tok)
    assert len(samples) == 2
    whole = tok.apply_chat_template(chat, tokenize=True)
    whole = list(whole["input_ids"] if hasattr(whole, "keys") else whole)
    s = samples[0]
    assert s.token_ids == whole  # the template's own rendering, token for token
    trained = tok.decode([t for t, m in zip(s.token_ids, s.loss_mask, strict=True) if m])
    assert "wc -l < notes.txt" in trained and "submit" in trained and "count the lines" not in trained


def test_a_bad_chat_line_is_one_line_naming_the_file_and_line(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n{"oops": 1}\n')
    with pytest.raises(UserError, match=r"chats.jsonl:1: .*no assistant message"):
        chat_samples(path, bpe_tokenizer("qwen"))
