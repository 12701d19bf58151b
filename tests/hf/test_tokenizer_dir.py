"""The tokenizer directory written beside a checkpoint: AutoTokenizer loads it, with special tokens and a chat
template; an existing tokenizer_config.json is merged, not clobbered; bad input is refused by name."""

import json

import pytest

from k3nn import KimiK3, KimiK3Config
from k3nn.demo import EOS, MASK
from k3nn.tokenizer import DEFAULT_CHAT_TEMPLATE, load_tokenizer, save_tokenizer

transformers = pytest.importorskip("transformers")
from transformers import AutoTokenizer  # noqa: E402


def test_checkpoint_tokenizer_loads_with_autotokenizer(k3_dir, tok):
    cfg = json.loads((k3_dir / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and cfg["chat_template"] == DEFAULT_CHAT_TEMPLATE
    t = AutoTokenizer.from_pretrained(k3_dir)
    assert t.eos_token == EOS and t.eos_token_id == tok.token_to_id(EOS)  # named from the model config's eos id
    text = "def f(x):\n    return x\n"
    assert t(text).input_ids == tok.encode(text).ids and t.decode(t(text).input_ids) == text
    chat = t.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>"
    # the CLI's loader reads the same directory
    assert load_tokenizer(k3_dir, 0).encode(text) == tok.encode(text).ids


def test_an_existing_tokenizer_config_is_merged(tmp_path, tok):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{{ messages[0]['content'] }}", "padding_side": "left", "eos_token": MASK}))
    save_tokenizer(tok, tmp_path, eos_token=EOS, defaults_only=True)  # what save_pretrained passes
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == "{{ messages[0]['content'] }}" and cfg["padding_side"] == "left"
    assert cfg["eos_token"] == MASK  # the existing file named it: a default does not override it
    save_tokenizer(tok, tmp_path, eos_token=EOS, chat_template="{{ 'x' }}")  # given explicitly: it wins
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["eos_token"] == EOS and cfg["chat_template"] == "{{ 'x' }}" and cfg["padding_side"] == "left"
    assert AutoTokenizer.from_pretrained(tmp_path).padding_side == "left"


def test_sources_a_transformers_tokenizer_and_a_directory(tmp_path, k3_dir, hf_tok):
    hf_tok.chat_template = "{{ 'T' }}"
    try:
        save_tokenizer(hf_tok, tmp_path / "a")
    finally:
        hf_tok.chat_template = DEFAULT_CHAT_TEMPLATE
    a = AutoTokenizer.from_pretrained(tmp_path / "a")
    assert a.chat_template == "{{ 'T' }}" and a.eos_token == EOS
    save_tokenizer(k3_dir, tmp_path / "b")
    assert AutoTokenizer.from_pretrained(tmp_path / "b").eos_token == EOS


def test_save_pretrained_with_a_tokenizer(tmp_path, tok, vocab):
    m = KimiK3(KimiK3Config.tiny(vocab_size=vocab, eos_token_id=tok.token_to_id(EOS)), seed=0)
    m.save_pretrained(tmp_path / "m", tokenizer=tok, chat_template="{{ 'C' }}")
    t = AutoTokenizer.from_pretrained(tmp_path / "m")
    assert t.chat_template == "{{ 'C' }}" and t.eos_token == EOS
    assert KimiK3.from_pretrained(tmp_path / "m").config == m.config
    small = KimiK3(KimiK3Config.tiny(vocab_size=256), seed=0)
    with pytest.raises(ValueError, match=f"tokenizer: it has {vocab} token ids, more than the model's vocab_size 256"):
        small.save_pretrained(tmp_path / "s", tokenizer=tok)
    with pytest.raises(ValueError, match="chat_template is written with the tokenizer"):
        m.save_pretrained(tmp_path / "c", chat_template="{{ 'C' }}")


@pytest.mark.parametrize("kw,err,match", [
    (dict(eos_token="<|nope|>"), ValueError, r"eos_token: '<\|nope\|>' is not a token"),
    (dict(pad_token=10**6), ValueError, "pad_token: id 1000000 is not in the tokenizer's vocabulary"),
    (dict(bos_token=1.5), TypeError, "bos_token must be a token string or a token id"),
    (dict(chat_template=""), ValueError, "chat_template must be a non-empty"),
    (dict(model_max_length=0), ValueError, "model_max_length must be a positive int"),
])
def test_bad_arguments_are_named(tmp_path, tok, kw, err, match):
    with pytest.raises(err, match=match):
        save_tokenizer(tok, tmp_path, **kw)


def test_tokenizers_without_a_tokenizer_json_are_refused(tmp_path):
    from k3nn.tokenizer import ByteTokenizer

    with pytest.raises(TypeError, match="byte and tiktoken tokenizers have no tokenizer.json"):
        save_tokenizer(ByteTokenizer(), tmp_path)
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        save_tokenizer(tmp_path, tmp_path / "out")
