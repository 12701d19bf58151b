"""k3nn's own layout: the module tree's state_dict, experts stacked ``...experts.w1 [E, I, D]``."""

import re

NAME = "k3nn"
_STACKED = re.compile(r"\.experts\.(w[123])(_packed|_scale)?$")


def detect(keys: set[str]) -> bool:
    return any(_STACKED.search(k) for k in keys)


def to_native(key, load, model_keys):
    t = load()
    if key.endswith("self_attn.A_log"):
        t = t.reshape(-1)
    return [(key, None, t)]


def from_native(state_dict):
    return dict(state_dict)
