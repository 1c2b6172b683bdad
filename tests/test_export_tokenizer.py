"""`orcinus export-tokenizer DIR`: Hugging Face files that `transformers.AutoTokenizer` loads and that encode,
decode and render chats exactly as the server's own tokenizer (clients' `--tokenizer DIR`: lm-eval, aiperf)."""

from __future__ import annotations

import json

import pytest
from tokenizer_texts import varied_texts

from gateway.cli import main


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    out = tmp_path_factory.mktemp("tokenizer")
    assert main(["export-tokenizer", str(out)]) == 0
    return out


def test_the_exported_tokenizer_encodes_decodes_and_renders_chats_as_the_server(exported, tokenizer):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(exported))
    special = [tokenizer.token_bytes(i).decode() for i in sorted(tokenizer.special_token_ids)]
    for text in varied_texts(special, 400, seed=11):
        ids = tokenizer.encode(text, add_special_tokens=True)
        assert hf.encode(text) == ids, text
        assert hf.decode(ids) == tokenizer.decode(ids), text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2 = ?"}]
    rendered = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = rendered["input_ids"] if isinstance(rendered, dict) or hasattr(rendered, "keys") else rendered
    assert list(ids) == tokenizer.encode(tokenizer.apply_chat_template(messages))
    config = json.loads((exported / "tokenizer_config.json").read_text())
    assert (config["eos_token"], config["model_max_length"]) == (tokenizer.eos_token, 8192)
