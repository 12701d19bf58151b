"""transformers' text-generation pipeline on k3nn models: from a model object or a checkpoint directory, greedy and
sampled, chat messages, and streaming with TextStreamer / TextIteratorStreamer. The tokens are k3nn's generate()."""

import threading

import pytest
import torch

from k3nn import KimiK3

transformers = pytest.importorskip("transformers")
from transformers import TextIteratorStreamer, TextStreamer, pipeline  # noqa: E402

PROMPT = "def read_lines(path):\n"


def _reference(model, tok, prompt, n):
    ids = tok(prompt, return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=n, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_pipeline_from_a_model_object(k3, hf_tok):
    pipe = pipeline("text-generation", model=k3, tokenizer=hf_tok)
    assert pipe.model is k3
    out = pipe(PROMPT, max_new_tokens=8, do_sample=False, return_full_text=False)
    assert out[0]["generated_text"] == _reference(k3, hf_tok, PROMPT, 8)
    # the pipeline's default is sampling (do_sample=True, temperature=0.7): k3nn's sampler, right length
    sampled = pipe(PROMPT, max_new_tokens=5, return_tensors=True)[0]["generated_token_ids"]
    assert len(sampled) == len(hf_tok(PROMPT).input_ids) + 5


def test_pipeline_from_a_checkpoint_directory(k3_dir, k3, hf_tok):
    """model= a directory: AutoConfig, AutoModelForCausalLM (k3nn's model) and AutoTokenizer from the directory."""
    pipe = pipeline("text-generation", model=str(k3_dir))
    assert type(pipe.model) is KimiK3
    out = pipe([PROMPT, "import os\n"], max_new_tokens=6, do_sample=False, return_full_text=False)
    assert out[0][0]["generated_text"] == _reference(k3, hf_tok, PROMPT, 6)
    assert out[1][0]["generated_text"] == _reference(k3, hf_tok, "import os\n", 6)


def test_pipeline_chat_uses_the_checkpoint_template(k3, hf_tok):
    pipe = pipeline("text-generation", model=k3, tokenizer=hf_tok)
    chat = [{"role": "user", "content": "hello"}]
    out = pipe(chat, max_new_tokens=4, do_sample=False)
    text = hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    ids = hf_tok(text, return_tensors="pt", add_special_tokens=False).input_ids
    ref = hf_tok.decode(k3.generate(ids, max_new_tokens=4, do_sample=False)[0, ids.shape[1]:],
                        skip_special_tokens=True)
    assert out[0]["generated_text"][-1] == {"role": "assistant", "content": ref}


def test_pipeline_streams(k3, hf_tok, capsys):
    pipe = pipeline("text-generation", model=k3, tokenizer=hf_tok)
    ref = _reference(k3, hf_tok, PROMPT, 10)
    streamer = TextIteratorStreamer(hf_tok, skip_prompt=True, skip_special_tokens=True, timeout=120)
    worker = threading.Thread(target=pipe, args=(PROMPT,),
                              kwargs=dict(max_new_tokens=10, do_sample=False, streamer=streamer))
    worker.start()
    pieces = list(streamer)
    worker.join()
    assert "".join(pieces) == ref and len(pieces) >= 1
    pipe(PROMPT, max_new_tokens=10, do_sample=False, streamer=TextStreamer(hf_tok, skip_prompt=True))
    assert capsys.readouterr().out.strip() == ref.strip()


def test_generation_config_surface(k3):
    """What the pipeline reads: can_generate(), generation_config (derived from the config, assignable, deletable)."""
    from k3nn import GenerationConfig

    m = KimiK3(k3.config, seed=0)
    assert KimiK3.can_generate() and m.generation_config.eos_token_id == k3.config.eos_token_id
    assert m.generation_config.to_diff_dict() == {"eos_token_id": k3.config.eos_token_id}
    m.generation_config.max_new_tokens = 3  # edited in place: kept, and generate() reads it
    ids = torch.tensor([[5, 6, 7]])
    assert m.generate(ids, eos_token_id=[]).shape == (1, 6)
    m.generation_config = transformers.GenerationConfig(max_new_tokens=2)  # a transformers config is converted
    assert isinstance(m.generation_config, GenerationConfig) and m.generate(ids, eos_token_id=[]).shape == (1, 5)
    del m.generation_config
    assert m.generation_config.max_new_tokens is None


def test_pipeline_on_a_kimi_linear_checkpoint(kl_dir, hf_tok):
    """A Kimi Linear checkpoint: the pipeline over k3nn's model gives transformers' own model's greedy text."""
    from transformers import KimiLinearForCausalLM

    ours = pipeline("text-generation", model=KimiK3.from_pretrained(kl_dir), tokenizer=hf_tok)
    theirs = pipeline("text-generation", model=KimiLinearForCausalLM.from_pretrained(kl_dir).eval(), tokenizer=hf_tok)
    kw = dict(max_new_tokens=6, do_sample=False, return_full_text=False)
    assert ours(PROMPT, **kw)[0]["generated_text"] == theirs(PROMPT, **kw)[0]["generated_text"]
