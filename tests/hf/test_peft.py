"""PEFT LoRA on k3nn models: a few steps on the demo corpus lower the loss, the adapter round-trips through
save_pretrained / PeftModel.from_pretrained with identical logits, generation runs k3nn's generate() with the
adapter, and targets k3nn would bypass are refused."""

import pytest
import torch

from k3nn import KimiK3

peft = pytest.importorskip("peft", reason="the hf extra: pip install 'k3nn[hf]'")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "g_proj", "kv_a_proj_with_mqa", "gate_proj", "up_proj"]


def _batches(tok, corpus, seq=32, n=6):
    from k3nn.demo import encode_docs

    stream = encode_docs(tok, [t for _, t in corpus.train])
    return stream[: n * (seq + 1)].reshape(n, seq + 1)[:, :seq]


def test_lora_trains_and_round_trips(k3_dir, tok, corpus, tmp_path, vocab):
    base = KimiK3.from_pretrained(k3_dir)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, task_type="CAUSAL_LM"))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    data = _batches(tok, corpus)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    losses = []
    for step in range(6):
        ids = data[step % len(data)][None]
        loss = model(input_ids=ids, labels=ids).loss  # transformers' causal-LM loss (labels unshifted)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model.eval()
    with torch.no_grad():
        before = KimiK3.from_pretrained(k3_dir)(input_ids=data, labels=data).loss.item()
        after = model(input_ids=data, labels=data).loss.item()
    assert after < before - 0.05, (before, after, losses)

    model.save_pretrained(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    loaded = PeftModel.from_pretrained(KimiK3.from_pretrained(k3_dir), tmp_path / "adapter").eval()
    ids = data[:2]
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)
    # generate() is k3nn's, with the adapter in every forward; merging gives the same tokens
    prompt = data[:1, :8]
    g = loaded.generate(input_ids=prompt, max_new_tokens=6, do_sample=False)
    merged = loaded.merge_and_unload()
    assert type(merged) is KimiK3
    assert torch.equal(g, merged.generate(prompt, max_new_tokens=6, do_sample=False))


def test_loss_matches_a_direct_computation(k3, vocab):
    ids = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :4] = -100
    out = k3(ids, labels=labels)
    ref = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, vocab), labels[:, 1:].reshape(-1))
    torch.testing.assert_close(out.loss, ref)
    total = (labels[:, 1:] != -100).sum()
    torch.testing.assert_close(k3(ids, labels=labels, num_items_in_batch=2 * total).loss, ref / 2)
    with pytest.raises(ValueError, match="labels must have the shape"):
        k3(ids, labels=labels[:, :-1])
    with pytest.raises(ValueError, match="output_attentions=True"):
        k3(ids, output_attentions=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        k3(ids, bogus=1)


def test_plain_peft_model_wraps_the_forward(k3, k3_dir, vocab):
    """Without a task type, get_peft_model gives a PeftModel that passes the caller's arguments through; a fresh
    LoRA (B = 0) leaves the logits unchanged."""
    model = get_peft_model(KimiK3.from_pretrained(k3_dir), LoraConfig(target_modules=["q_proj", "o_proj"]))
    assert type(model) is PeftModel
    ids = torch.randint(0, vocab, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, k3(ids).logits)


def test_adapters_k3nn_would_bypass_are_refused(k3_dir, vocab):
    model = get_peft_model(KimiK3.from_pretrained(k3_dir), LoraConfig(target_modules=["kv_b_proj"]))
    ids = torch.randint(0, vocab, (1, 5))
    with pytest.raises(ValueError, match=r"kv_b_proj would be ignored.*merge_and_unload"):
        model(input_ids=ids)
    base = KimiK3.from_pretrained(k3_dir).prepare_decode()
    model = get_peft_model(base, LoraConfig(target_modules=["q_proj"]))
    with pytest.raises(ValueError, match=r"prepare_decode\(False\)"):
        model(input_ids=ids)
