"""DeepSeek-V3's layout (Kimi K2, the text model of Kimi K2.5, and what transformers writes back for them): the MoE
under ``mlp``: per-expert ``mlp.experts.{j}.gate_proj / up_proj / down_proj.weight``, the router as
``mlp.gate.weight`` + ``mlp.gate.e_score_correction_bias``, ``mlp.shared_experts.*``; dense layers keep
``mlp.gate_proj / up_proj / down_proj``. k3nn calls the MoE block ``block_sparse_moe`` and stacks the experts."""

import re

NAME = "deepseek"
_EXPERT = re.compile(r"^(.*)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_MLP = re.compile(r"^(.*\.layers\.\d+)\.mlp\.(.*)$")
_TO_W = {"gate": "w1", "up": "w3", "down": "w2"}
_FROM_W = {v: k for k, v in _TO_W.items()}


def detect(keys: set[str]) -> bool:
    return any(_EXPERT.match(k) for k in keys)


def to_native(key, load, model_keys):
    m = _EXPERT.match(key)
    if m:
        base, j, w = m.groups()
        return [(f"{base}.block_sparse_moe.experts.{_TO_W[w]}", int(j), load())]
    m = _MLP.match(key)
    if m and key not in model_keys:  # the MoE block (dense layers keep `mlp`)
        return [(f"{m.group(1)}.block_sparse_moe.{m.group(2)}", None, load())]
    return [(key, None, load())]


def from_native(state_dict):
    out = {}
    for k, t in state_dict.items():
        m = re.match(r"^(.*)\.block_sparse_moe\.experts\.(w[123])$", k)
        if m:
            base, w = m.groups()
            for j in range(t.shape[0]):
                out[f"{base}.mlp.experts.{j}.{_FROM_W[w]}_proj.weight"] = t[j].clone()
        elif re.search(r"\.experts\.w[123]_(packed|scale)$", k):
            raise ValueError(f"the DeepSeek layout has no MXFP4 experts ({k})")
        else:
            out[k.replace(".block_sparse_moe.", ".mlp.")] = t
    return out
