"""The original Moonshot layout (Kimi Linear / K3 remote code, and what transformers v5 writes back):
experts unstacked ``block_sparse_moe.experts.{j}.w1.weight`` (or ``.weight_packed`` / ``.weight_scale`` for
compressed-tensors MXFP4), ``A_log`` as [1, 1, H, 1]; dense MLPs may appear as ``mlp.*`` or ``block_sparse_moe.*``."""

import re

NAME = "moonshot"
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w[123])\.(weight|weight_packed|weight_scale)$")
_DENSE = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.(gate_proj|up_proj|down_proj)\.weight$")
_SUFFIX = {"weight": "", "weight_packed": "_packed", "weight_scale": "_scale"}


def detect(keys: set[str]) -> bool:
    return any(_EXPERT.match(k) for k in keys)


def to_native(key, load, model_keys):
    m = _EXPERT.match(key)
    if m:
        base, j, w, kind = m.groups()
        return [(f"{base}.{w}{_SUFFIX[kind]}", int(j), load())]
    m = _DENSE.match(key)
    if m and f"{m.group(1)}.mlp.{m.group(2)}.weight" in model_keys:
        return [(f"{m.group(1)}.mlp.{m.group(2)}.weight", None, load())]
    t = load()
    if key.endswith("self_attn.A_log"):
        t = t.reshape(-1)
    return [(key, None, t)]


def from_native(state_dict):
    out = {}
    for k, t in state_dict.items():
        m = re.match(r"^(.*\.experts)\.(w[123])(_packed|_scale)?$", k)
        if m:
            base, w, suf = m.groups()
            kind = {None: "weight", "_packed": "weight_packed", "_scale": "weight_scale"}[suf]
            for j in range(t.shape[0]):
                out[f"{base}.{j}.{w}.{kind}"] = t[j].clone()  # own storage: safetensors refuses shared views
        elif k.endswith("self_attn.A_log"):
            out[k] = t.reshape(1, 1, -1, 1)
        else:
            out[k] = t
    return out
