"""Chat templates: found where transformers keeps them, rendered as transformers renders them (checked against
transformers' own apply_chat_template), refusals as errors; the demo's template; message checks."""

import json

import pytest

from k3nn.serve.chat import ChatTemplate, ChatTemplateError, load_chat_template, normalize_messages
from k3nn.serve.protocol import APIError

MSGS = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi ünïcode"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]

# a template in the style of real checkpoints: whitespace control, loop variables, raise_exception, tojson
CHATML = ("{% for message in messages %}"
          "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
          "{{ raise_exception('Unknown role: ' + message['role']) }}{% endif %}"
          "{{ bos_token if loop.first else '' }}<|im_start|>{{ message['role'] }}\n"
          "{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_render_matches_transformers(tmp_path):
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
         "chat_template": CHATML}))
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = load_chat_template(tmp_path)
    for gen in (True, False):
        assert ours.render(MSGS, add_generation_prompt=gen) == \
            hf.apply_chat_template(MSGS, tokenize=False, add_generation_prompt=gen)
    with pytest.raises(ChatTemplateError, match="Unknown role: tool"):
        ours.render([{"role": "tool", "content": "x"}])


def test_special_tokens_as_strings_or_added_token_dicts():
    from k3nn.serve.chat import special_tokens

    assert special_tokens({"bos_token": "<s>", "eos_token": {"__type": "AddedToken", "content": "</s>"},
                           "pad_token": None, "unk_token": 5}) == {"bos_token": "<s>", "eos_token": "</s>"}


def test_where_templates_are_found(tmp_path):
    assert load_chat_template(tmp_path) is None
    assert load_chat_template(None) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "chat_template": [
        {"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ eos_token }}"}]}))
    assert load_chat_template(tmp_path).render(MSGS) == "D</s>"
    (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}")  # transformers 5 writes this file
    assert load_chat_template(tmp_path).render(MSGS) == "J4"
    assert load_chat_template(tmp_path, override="O{{ eos_token }}").render(MSGS) == "O</s>"
    f = tmp_path / "mine.jinja"
    f.write_text("F")
    assert load_chat_template(tmp_path, override=str(f)).render(MSGS) == "F"
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "x", "template": "T"}]}))
    with pytest.raises(ChatTemplateError, match="no 'default'"):
        load_chat_template(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(ChatTemplateError, match="not valid JSON"):
        load_chat_template(tmp_path)


def test_template_globals_and_sandbox():
    t = ChatTemplate("{{ messages | tojson }}|{{ strftime_now('%Y') | length }}|"
                     "{% generation %}G{% endgeneration %}|{% for m in messages %}{% if loop.index > 1 %}"
                     "{% break %}{% endif %}{{ m.role }}{% endfor %}")
    out = t.render([{"role": "user", "content": "é"}])
    assert out == '[{"role": "user", "content": "é"}]|4|G|user'  # tojson keeps non-ASCII
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for %}")
    with pytest.raises(ChatTemplateError):  # the sandbox: no attribute escapes
        ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}").render(MSGS)
    with pytest.raises(ChatTemplateError):  # immutable: no appends to the caller's messages
        ChatTemplate("{{ messages.append(1) }}").render(MSGS)
    with pytest.raises(ChatTemplateError, match="must not set"):
        ChatTemplate("x").render(MSGS, variables={"add_generation_prompt": False})
    assert ChatTemplate("{{ flavour }}{{ eos_token }}", {"eos_token": "E"}).render(
        MSGS, variables={"flavour": "mint", "eos_token": "X"}) == "mintX"
    with pytest.raises(ChatTemplateError, match="empty"):
        ChatTemplate("  ")


def test_demo_template(tmp_path):
    from k3nn.demo import CHAT_TEMPLATE, EOS, write_chat_template

    path = write_chat_template(tmp_path)
    cfg = json.loads(path.read_text())
    assert cfg["chat_template"] == CHAT_TEMPLATE and cfg["eos_token"] == EOS
    t = load_chat_template(tmp_path)
    assert t.render([{"role": "user", "content": "reverse a list\nplease"}]) == \
        "# user: reverse a list\n# please\n# assistant:\n"
    assert t.render(MSGS, add_generation_prompt=False) == \
        "# system: Be terse.\n# user: Hi ünïcode\n# assistant:\nHello.\n# user: Bye\n"
    path.write_text(json.dumps({"chat_template": "mine", "eos_token": "</s>", "other": 1}))
    write_chat_template(tmp_path)  # an existing template is kept
    assert json.loads(path.read_text()) == {"chat_template": "mine", "eos_token": "</s>", "other": 1}


@pytest.mark.parametrize("messages,param", [
    ([], "messages"), (None, "messages"), ("hi", "messages"), ([3], "messages[0]"),
    ([{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}], "messages[1].role"),
    ([{"content": "a"}], "messages[0].role"),
    ([{"role": "system", "content": None}], "messages[0].content"),
    ([{"role": "user", "content": {"text": "a"}}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "input_audio"}]}],
     "messages[0].content[1]"),
    ([{"role": "user", "content": "a", "name": 3}], "messages[0].name"),
    ([{"role": "tool", "content": "a", "tool_call_id": "x"}], "messages[0].tool_call_id"),
])
def test_bad_messages(messages, param):
    with pytest.raises(APIError) as ei:
        normalize_messages(messages)
    assert ei.value.param == param and ei.value.status == 400


def test_messages_normalised():
    assert normalize_messages([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                            {"type": "text", "text": "b"}], "name": "u"},
                               {"role": "assistant", "content": None}, {"role": "developer", "content": "d"}]) == [
        {"role": "user", "content": "a\nb", "name": "u"}, {"role": "assistant", "content": None},
        {"role": "developer", "content": "d"}]
