"""lm-eval with k3nn's models: ``k3nn-lm-eval`` (lm-eval's command line, k3nn registered first) and lm-eval's model
``k3nn`` (:class:`K3LM`).

lm-eval finds models through transformers' Auto classes, and only a process that imported k3nn has k3nn's there.
``k3nn-lm-eval`` is lm-eval's own command line (same arguments as ``lm_eval`` / ``lm-eval``) run after
``import k3nn``::

    k3nn-lm-eval --model hf --model_args pretrained=<k3 checkpoint> --tasks hellaswag
    k3nn-lm-eval --model k3nn --model_args pretrained=<any k3nn checkpoint>,dtype=bfloat16 --tasks hellaswag
    python -m k3nn.hf.lm_eval ...                       # the same without the console script

``--model hf`` loads through ``AutoModelForCausalLM``: k3nn's model for a K3 checkpoint (``"kimi_k3"``),
transformers' own ``KimiLinearForCausalLM`` for a Kimi Linear one. ``--model k3nn`` always loads with
:meth:`k3nn.KimiK3.from_pretrained` (K3, Kimi Linear in any of its layouts, Kimi K2 text), so a Kimi Linear
checkpoint runs on k3nn's kernels; ``k3nn_backend=triton`` picks the kernel backend. In Python, after
``import k3nn``, ``lm_eval.models.huggingface.HFLM(pretrained=<dir or KimiK3>, tokenizer=...)`` works as well.
"""

from __future__ import annotations

import sys

from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

__all__ = ["K3LM", "main"]


@register_model("k3nn")
class K3LM(HFLM):
    """lm-eval's HF causal-LM wrapper with the model loaded by :meth:`k3nn.KimiK3.from_pretrained` (tokenizer,
    batching, loglikelihood and generation are lm-eval's). Model arguments beyond lm-eval's: ``k3nn_backend``
    (``"eager"`` | ``"triton"`` | ``"cuda"`` | ``"auto"``) and the keywords of ``KimiK3.from_pretrained``. One device:
    ``parallelize``, ``tp_plan``, quantization and delta weights are refused; ``peft=<adapter dir>`` loads a PEFT
    adapter on top."""

    def _create_model(self, pretrained: str, revision: str | None = "main", dtype="auto", trust_remote_code=False,
                      parallelize=False, gpus=None, max_memory_per_gpu=None, max_cpu_memory=None,
                      offload_folder=None, tp_plan=None, peft=None, delta=None, autogptq=False, gptqmodel=False,
                      gguf_file=None, quantization_config=None, subfolder="", **kwargs) -> None:
        from ..model import KimiK3

        refused = {"parallelize": parallelize, "tp_plan": tp_plan, "delta": delta, "autogptq": autogptq,
                   "gptqmodel": gptqmodel, "gguf_file": gguf_file, "quantization_config": quantization_config,
                   "subfolder": subfolder}
        bad = [f"{k}={v!r}" for k, v in refused.items() if v]
        if bad:
            raise ValueError(f"lm-eval model 'k3nn' does not support {', '.join(bad)} (k3nn places a model on one "
                             f"device and reads its own checkpoint formats)")
        backend = kwargs.pop("k3nn_backend", None)
        self._model = KimiK3.from_pretrained(pretrained, revision=None if revision in (None, "main") else revision,
                                             dtype=dtype, device=self.device, backend=backend, **kwargs)
        if peft:
            from peft import PeftModel

            self._model = PeftModel.from_pretrained(self._model, peft)


def main(argv: list[str] | None = None) -> None:
    """``k3nn-lm-eval``: lm-eval's command line with k3nn registered (``argv``: the arguments, default
    ``sys.argv[1:]``)."""
    from . import register_transformers

    register_transformers()
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()


if __name__ == "__main__":
    main()
