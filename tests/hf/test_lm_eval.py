"""lm-eval on k3nn models: HFLM's loglikelihoods equal a direct computation (from a checkpoint directory through the
Auto classes, and from a model object), lm-eval's model ``k3nn`` loads any k3nn checkpoint, and the ``k3nn-lm-eval``
command line scores a tiny local task."""

import json
import subprocess
import sys

import pytest
import torch

from k3nn import KimiK3

pytest.importorskip("lm_eval", reason="the hf extra: pip install 'k3nn[hf]'")
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402

PAIRS = [("def add(a, b):\n    return", " a + b"), ("import", " os"), ("for i in range(10):\n", "    print(i)")]


def _requests(pairs):
    return [Instance(request_type="loglikelihood", doc={}, arguments=p, idx=i) for i, p in enumerate(pairs)]


def _direct(model, tok, pairs):
    """log p(continuation | context) and whether it is the greedy continuation, computed here, with the request split
    into tokens as lm-eval splits it: the context's trailing whitespace joins the continuation, whose tokens are those
    of context + continuation after the context's."""
    out = []
    for ctx, cont in pairs:
        n = len(ctx) - len(ctx.rstrip())
        if n:
            ctx, cont = ctx[:-n], ctx[-n:] + cont
        a = tok(ctx).input_ids
        b = tok(ctx + cont).input_ids[len(a):]
        ids = torch.tensor([a + b])
        with torch.no_grad():
            logp = model(ids).logits.float().log_softmax(-1)[0, len(a) - 1:-1]
        tgt = torch.tensor(b)
        out.append((logp.gather(-1, tgt[:, None]).sum().item(), bool((logp.argmax(-1) == tgt).all())))
    return out


def _close(got, ref):
    assert len(got) == len(ref)
    for (lp, greedy), (lp_ref, greedy_ref) in zip(got, ref):
        assert lp == pytest.approx(lp_ref, rel=1e-5, abs=1e-4) and greedy == greedy_ref


def test_hflm_from_a_checkpoint_directory(k3_dir, k3, hf_tok):
    lm = HFLM(pretrained=str(k3_dir), device="cpu", batch_size=2)
    assert type(lm.model) is KimiK3
    _close(lm.loglikelihood(_requests(PAIRS)), _direct(k3, hf_tok, PAIRS))


def test_hflm_from_a_model_object(k3, hf_tok):
    lm = HFLM(pretrained=k3, tokenizer=hf_tok, batch_size=3)
    _close(lm.loglikelihood(_requests(PAIRS)), _direct(k3, hf_tok, PAIRS))
    # generate_until runs k3nn's generate() with lm-eval's stop sequences
    (text,) = lm.generate_until([Instance(request_type="generate_until", doc={}, idx=0,
                                          arguments=("def f(x):\n", {"until": ["\n\n"], "max_gen_toks": 6,
                                                                     "do_sample": False}))])
    assert isinstance(text, str)


def test_lm_eval_model_k3nn_loads_a_kimi_linear_checkpoint(kl_dir, hf_tok):
    from k3nn.hf.lm_eval import K3LM

    lm = K3LM(pretrained=str(kl_dir), device="cpu", batch_size=3, dtype="float32")
    assert type(lm.model) is KimiK3
    _close(lm.loglikelihood(_requests(PAIRS)), _direct(KimiK3.from_pretrained(kl_dir), hf_tok, PAIRS))
    with pytest.raises(ValueError, match="parallelize=True"):
        K3LM(pretrained=str(kl_dir), device="cpu", parallelize=True)


def _tiny_task(tmp_path):
    """A two-question multiple-choice task read from a local jsonl file: (task directory, docs)."""
    docs = [{"context": "def add(a, b):\n    return", "choices": [" a + b", " None"], "label": 0},
            {"context": "import", "choices": [" os", " 12"], "label": 1}]
    (tmp_path / "tiny.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "k3nn_tiny.yaml").write_text(
        "task: k3nn_tiny\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {tmp_path / 'tiny.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{context}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{label}}'\ntarget_delimiter: ''\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    return tmp_path / "tasks", docs


def _accuracy(model, tok, docs):
    right = 0
    for d in docs:
        scores = [lp for lp, _ in _direct(model, tok, [(d["context"], c) for c in d["choices"]])]
        right += int(max(range(len(scores)), key=scores.__getitem__) == d["label"])
    return right / len(docs)


@pytest.fixture
def offline_datasets(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def test_simple_evaluate_with_model_hf_on_a_local_task(k3_dir, k3, hf_tok, tmp_path, offline_datasets):
    """lm-eval's evaluator with ``model="hf"`` (what ``--model hf`` selects) on a k3nn checkpoint directory."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    tasks, docs = _tiny_task(tmp_path)
    res = simple_evaluate(model="hf", model_args={"pretrained": str(k3_dir), "backend": "causal"},
                          tasks=["k3nn_tiny"], device="cpu", batch_size=2,
                          task_manager=TaskManager(include_path=str(tasks), include_defaults=False))
    assert res["results"]["k3nn_tiny"]["acc,none"] == pytest.approx(_accuracy(k3, hf_tok, docs))


@pytest.mark.slow  # lm-eval's command line indexes its ~14k bundled task files first (tens of seconds on 2 cores)
def test_k3nn_lm_eval_command_line(k3_dir, k3, hf_tok, tmp_path, offline_datasets):
    """``k3nn-lm-eval`` (lm-eval's own arguments) in a fresh process: the accuracy equals the one computed here."""
    tasks, docs = _tiny_task(tmp_path)
    r = subprocess.run([sys.executable, "-m", "k3nn.hf.lm_eval", "run", "--model", "hf", "--model_args",
                        f"pretrained={k3_dir}", "--tasks", "k3nn_tiny", "--include_path", str(tasks), "--device",
                        "cpu", "--batch_size", "2", "--output_path", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    (res,) = list((tmp_path / "out").rglob("results_*.json"))
    acc = json.loads(res.read_text())["results"]["k3nn_tiny"]["acc,none"]
    assert acc == pytest.approx(_accuracy(k3, hf_tok, docs))
