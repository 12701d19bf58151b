"""transformers' runtime ``kimi_linear`` layout: ``mlp.experts.gate_up_proj [E, 2I, D]`` (gate then up),
``mlp.experts.down_proj [E, D, I]``, MoE router under ``mlp.gate``, fused ``self_attn.conv1d.weight [3C, 1, W]``
(q, k, v), gate parameters under ``self_attn.forget_gate``."""

import re

import torch

NAME = "transformers"


def detect(keys: set[str]) -> bool:
    return any(k.endswith("experts.gate_up_proj") or k.endswith("self_attn.conv1d.weight") for k in keys)


def _moe_prefix(key: str, model_keys) -> str:
    # transformers names the MoE block `mlp`; k3nn (and Moonshot) call it `block_sparse_moe`
    m = re.match(r"^(model\.layers\.\d+)\.mlp\.(.*)$", key)
    if m and f"{m.group(1)}.mlp.{m.group(2)}" not in model_keys:
        return f"{m.group(1)}.block_sparse_moe.{m.group(2)}"
    return key


def to_native(key, load, model_keys):
    if key.endswith("experts.gate_up_proj"):
        t = load()
        I = t.shape[1] // 2
        base = _moe_prefix(key[: -len(".gate_up_proj")], model_keys)
        return [(f"{base}.w1", None, t[:, :I]), (f"{base}.w3", None, t[:, I:])]
    if key.endswith("experts.down_proj"):
        return [(_moe_prefix(key[: -len(".down_proj")], model_keys) + ".w2", None, load())]
    if key.endswith("self_attn.conv1d.weight"):
        t = load()
        C = t.shape[0] // 3
        base = key[: -len(".conv1d.weight")]
        return [(f"{base}.{n}_conv1d.weight", None, t[i * C:(i + 1) * C]) for i, n in enumerate("qkv")]
    key = key.replace(".self_attn.forget_gate.", ".self_attn.")
    t = load()
    if key.endswith("self_attn.A_log"):
        t = t.reshape(-1)
    return [(_moe_prefix(key, model_keys), None, t)]


def from_native(state_dict):
    out = {}
    for k, t in state_dict.items():
        k2 = k.replace(".block_sparse_moe.", ".mlp.")
        if k.endswith("experts.w1"):
            out[k2[: -len(".w1")] + ".gate_up_proj"] = torch.cat([t, state_dict[k[:-2] + "w3"]], 1)
        elif k.endswith("experts.w3"):
            continue
        elif k.endswith("experts.w2"):
            out[k2[: -len(".w2")] + ".down_proj"] = t
        elif re.search(r"\.[qkv]_conv1d\.weight$", k):
            if ".q_conv1d." in k:
                base = k[: -len(".q_conv1d.weight")]
                out[base + ".conv1d.weight"] = torch.cat(
                    [state_dict[f"{base}.{n}_conv1d.weight"] for n in "qkv"], 0)
        elif re.search(r"self_attn\.(f_a_proj|f_b_proj|dt_bias|A_log)", k):
            name = k.split(".self_attn.")[1]
            out[k.split(".self_attn.")[0] + ".self_attn.forget_gate." + name] = (
                t.reshape(1, 1, -1, 1) if name == "A_log" else t)
        else:
            out[k2] = t
    return out
