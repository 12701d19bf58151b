"""The Hugging Face ecosystem on the GPU with k3nn's kernels: Auto loading in bf16 onto CUDA, the pipeline (CUDA-graph
decode underneath) streaming, PEFT training steps, lm-eval loglikelihoods against the fp32 CPU model.

Run on the H200: ``K3NN_TEST_GPU=1 pytest -m gpu tests/hf/test_gpu.py``."""

import threading

import pytest
import torch

from k3nn import KimiK3

pytestmark = pytest.mark.gpu
transformers = pytest.importorskip("transformers")


def test_auto_pipeline_and_streaming_on_cuda(k3_dir, hf_tok):
    from transformers import AutoModelForCausalLM, TextIteratorStreamer, pipeline

    m = AutoModelForCausalLM.from_pretrained(k3_dir, dtype=torch.bfloat16, device_map="cuda")
    assert type(m) is KimiK3 and m.device.type == "cuda" and m.dtype == torch.bfloat16
    pipe = pipeline("text-generation", model=m, tokenizer=hf_tok)
    ids = hf_tok("def f(x):\n", return_tensors="pt").input_ids.cuda()
    ref = hf_tok.decode(m.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1]:],
                        skip_special_tokens=True)
    streamer = TextIteratorStreamer(hf_tok, skip_prompt=True, skip_special_tokens=True, timeout=300)
    worker = threading.Thread(target=pipe, args=("def f(x):\n",),
                              kwargs=dict(max_new_tokens=16, do_sample=False, streamer=streamer))
    worker.start()
    text = "".join(streamer)
    worker.join()
    assert text == ref


def test_peft_steps_on_cuda(k3_dir, vocab):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(KimiK3.from_pretrained(k3_dir, device="cuda"),
                           LoraConfig(target_modules=["q_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM"))
    ids = torch.randint(0, vocab, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    first = None
    for _ in range(10):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        first = loss.item() if first is None else first
    assert loss.item() < first


def test_lm_eval_on_cuda_matches_cpu(k3_dir, k3):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    reqs = [Instance(request_type="loglikelihood", doc={}, arguments=p, idx=i)
            for i, p in enumerate([("import", " os"), ("def add(a, b):\n    return", " a + b")])]
    gpu = HFLM(pretrained=str(k3_dir), device="cuda", batch_size=2, dtype="float32").loglikelihood(reqs)
    cpu = HFLM(pretrained=k3, tokenizer=str(k3_dir), batch_size=2).loglikelihood(reqs)
    for (a, ga), (b, gb) in zip(gpu, cpu):
        assert a == pytest.approx(b, rel=1e-3, abs=1e-3) and ga == gb
