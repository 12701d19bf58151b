"""``KimiK3PretrainedConfig``: a k3nn config.json as transformers' ``AutoConfig`` returns it (model_type ``kimi_k3``).

Imports transformers; :func:`k3nn.hf.register_transformers` imports this module only once transformers' Auto
classes are in use.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from ..config import KimiK3Config

__all__ = ["KimiK3PretrainedConfig"]


class KimiK3PretrainedConfig(PretrainedConfig):
    """A Kimi K3 family config.json (as :meth:`k3nn.KimiK3Config.to_dict` writes it) held as a transformers config:
    every key is an attribute (``config.hidden_size``, ``config.linear_attn_config``, ...), saved back by
    ``save_pretrained``. :meth:`to_k3nn` gives the :class:`k3nn.KimiK3Config` the model is built from (validated
    there: a bad value is an error naming the key).

    ``AutoConfig.from_pretrained(dir)`` returns one for a checkpoint with ``"model_type": "kimi_k3"`` once
    :func:`k3nn.hf.register_transformers` ran (``import k3nn`` arranges it), and ``AutoModelForCausalLM`` maps it
    to :class:`k3nn.KimiK3`.
    """

    model_type = "kimi_k3"

    def to_k3nn(self) -> KimiK3Config:
        """The k3nn config of these keys (transformers' own bookkeeping keys dropped)."""
        from ..hf_surface import _own_keys

        return KimiK3Config.from_dict(_own_keys(self.to_dict()))

    @classmethod
    def from_k3nn(cls, config: KimiK3Config) -> "KimiK3PretrainedConfig":
        """The transformers view of a k3nn config (its config.json keys, under model_type ``kimi_k3``)."""
        if not isinstance(config, KimiK3Config):
            raise TypeError(f"config must be a k3nn KimiK3Config, got {type(config).__name__}")
        d = config.to_dict()
        d.pop("model_type", None)
        return cls(**d)
