"""Tokenizers for the CLI and examples: a checkpoint's ``tokenizer.json`` (HF ``tokenizers``), Kimi's
``tiktoken.model`` (``tiktoken``), or a byte-level fallback (UTF-8 bytes as ids) for byte-vocab models; and
:func:`save_tokenizer`, which writes the tokenizer directory transformers' ``AutoTokenizer`` loads."""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["ByteTokenizer", "load_tokenizer", "save_tokenizer", "DEFAULT_CHAT_TEMPLATE"]

#: the chat template written when neither the caller, the tokenizer nor an existing ``tokenizer_config.json`` has
#: one: Kimi's turn markers (``<|im_user|>user<|im_middle|>...<|im_end|>``), as plain text when the vocabulary has
#: no such special tokens; ``add_generation_prompt`` opens the assistant's turn
DEFAULT_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "<|im_{{ message['role'] }}|>{{ message['role'] }}<|im_middle|>{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}")

_SPECIALS = ("bos_token", "eos_token", "pad_token", "unk_token")


class ByteTokenizer:
    """ids = UTF-8 bytes (vocab 256 + optional specials); decoding replaces invalid sequences."""

    def __init__(self, vocab_size: int = 256):
        if vocab_size < 256:
            raise ValueError(f"a byte tokenizer needs vocab_size >= 256, got {vocab_size}")
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        """text → its UTF-8 bytes as ids."""
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        """ids → text; ids ≥ 256 (special tokens) are dropped, invalid UTF-8 becomes U+FFFD."""
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class _HFTokenizer:
    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise ImportError(f"{path} needs the `tokenizers` package: pip install 'k3nn[demo]'") from e
        self.tok = Tokenizer.from_file(str(path))
        self.vocab_size = self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def decode(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])


class _TiktokenTokenizer:
    # Kimi's pre-tokenisation pattern (tokenization_kimi.py); specials come from tokenizer_config.json
    PATTERN = (r"[\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
               r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"
               r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
               r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

    def __init__(self, path: Path):
        try:
            import tiktoken
            from tiktoken.load import load_tiktoken_bpe
        except ImportError as e:
            raise ImportError(f"{path} needs the `tiktoken` package: pip install tiktoken") from e
        ranks = load_tiktoken_bpe(str(path))
        self.enc = tiktoken.Encoding(name=path.parent.name, pat_str=self.PATTERN, mergeable_ranks=ranks,
                                     special_tokens={})
        self.vocab_size = self.enc.n_vocab

    def encode(self, text: str) -> list[int]:
        return self.enc.encode(text)

    def decode(self, ids) -> str:
        return self.enc.decode([int(i) for i in ids])


def load_tokenizer(directory: str | os.PathLike | None, vocab_size: int):
    """The tokenizer stored with a checkpoint, else a byte tokenizer when the vocab can hold bytes."""
    if directory is not None:
        d = Path(directory)
        if (d / "tokenizer.json").exists():
            return _HFTokenizer(d / "tokenizer.json")
        if (d / "tiktoken.model").exists():
            return _TiktokenTokenizer(d / "tiktoken.model")
    if vocab_size >= 256:
        return ByteTokenizer(vocab_size)
    raise ValueError(f"no tokenizer found and vocab_size {vocab_size} is too small for bytes: pass token ids "
                     "with --input-ids")


def _backend_of(tokenizer) -> tuple[object, dict]:
    """(a ``tokenizers.Tokenizer``, what the tokenizer object itself says: special tokens, chat template, length)."""
    if isinstance(tokenizer, (str, os.PathLike)):
        d = Path(tokenizer)
        if not (d / "tokenizer.json").is_file():
            raise ValueError(f"tokenizer: {d} has no tokenizer.json")
        from tokenizers import Tokenizer

        known = {}
        if (d / "tokenizer_config.json").is_file():
            cfg = json.loads((d / "tokenizer_config.json").read_text())
            known = {k: cfg[k] for k in (*_SPECIALS, "chat_template", "model_max_length") if cfg.get(k) is not None}
        return Tokenizer.from_file(str(d / "tokenizer.json")), known
    if isinstance(tokenizer, _HFTokenizer):
        return tokenizer.tok, {}
    backend = getattr(tokenizer, "backend_tokenizer", None)  # a transformers fast tokenizer
    if backend is not None:
        known = {k: getattr(tokenizer, k, None) for k in _SPECIALS}
        known["chat_template"] = getattr(tokenizer, "chat_template", None)
        n = getattr(tokenizer, "model_max_length", None)
        known["model_max_length"] = n if isinstance(n, int) and n < 1 << 40 else None
        return backend, {k: v for k, v in known.items() if isinstance(v, (str, int))}
    if callable(getattr(tokenizer, "to_str", None)) and callable(getattr(tokenizer, "token_to_id", None)):
        return tokenizer, {}  # a tokenizers.Tokenizer
    raise TypeError(f"tokenizer must be a tokenizers.Tokenizer, a transformers fast tokenizer, a tokenizer loaded by "
                    f"k3nn.tokenizer.load_tokenizer from a tokenizer.json, or a directory holding tokenizer.json; got "
                    f"{type(tokenizer).__name__} (byte and tiktoken tokenizers have no tokenizer.json to write)")


def _token(backend, name: str, value) -> str:
    """A special token given as its string or its id → its string (it must be in the vocabulary)."""
    if isinstance(value, int) and not isinstance(value, bool):
        tok = backend.id_to_token(value)
        if tok is None:
            raise ValueError(f"{name}: id {value} is not in the tokenizer's vocabulary "
                             f"({backend.get_vocab_size()} tokens)")
        return tok
    if isinstance(value, str):
        if backend.token_to_id(value) is None:
            raise ValueError(f"{name}: {value!r} is not a token of the tokenizer (add it as a special token first)")
        return value
    raise TypeError(f"{name} must be a token string or a token id, got {type(value).__name__}")


def save_tokenizer(tokenizer, directory: str | os.PathLike, *, chat_template: str | None = None,
                   bos_token: str | int | None = None, eos_token: str | int | list[int] | None = None,
                   pad_token: str | int | None = None, unk_token: str | int | None = None,
                   model_max_length: int | None = None, vocab_size: int | None = None,
                   defaults_only: bool = False) -> list[Path]:
    """Write ``tokenizer`` as a directory ``transformers.AutoTokenizer.from_pretrained`` loads: ``tokenizer.json``
    and ``tokenizer_config.json`` (``tokenizer_class: PreTrainedTokenizerFast``, the special tokens, the chat
    template, ``model_max_length``). Returns the paths written.

    ``tokenizer``: a ``tokenizers.Tokenizer``, a transformers fast tokenizer, what :func:`load_tokenizer` returns
    for a ``tokenizer.json``, or a directory holding one. Special tokens are token strings or ids (for a list of eos
    ids, the first); each must be in the vocabulary. With ``defaults_only`` they only fill the ones neither the
    tokenizer nor an existing ``tokenizer_config.json`` in ``directory`` names (``save_pretrained`` passes the model
    config's ids that way). ``chat_template`` (Jinja, rendered as transformers renders it) wins over the
    tokenizer's, which wins over the one already in ``directory``; :data:`DEFAULT_CHAT_TEMPLATE` when there is none.
    Keys an existing ``tokenizer_config.json`` holds that are not set here are kept. ``vocab_size``: the model's;
    a tokenizer with more ids than that is refused.

    >>> save_tokenizer(tok, "ckpt", eos_token="<|endoftext|>")  # doctest: +SKIP
    >>> AutoTokenizer.from_pretrained("ckpt").apply_chat_template([{"role": "user", "content": "hi"}])  # doctest: +SKIP
    """
    backend, known = _backend_of(tokenizer)
    n = backend.get_vocab_size(with_added_tokens=True)
    if vocab_size is not None and n > vocab_size:
        raise ValueError(f"tokenizer: it has {n} token ids, more than the model's vocab_size {vocab_size}")
    if chat_template is not None and (not isinstance(chat_template, str) or not chat_template.strip()):
        raise ValueError(f"chat_template must be a non-empty Jinja template string, got {chat_template!r}")
    if model_max_length is not None and (not isinstance(model_max_length, int) or model_max_length < 1):
        raise ValueError(f"model_max_length must be a positive int, got {model_max_length!r}")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    cfg_path = d / "tokenizer_config.json"
    cfg: dict = {}
    if cfg_path.is_file():
        try:
            cfg = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{cfg_path} exists and is not valid JSON ({e}); remove it or fix it") from None
    given = dict(bos_token=bos_token, eos_token=eos_token, pad_token=pad_token, unk_token=unk_token)
    for name in _SPECIALS:
        value = given[name]
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        have = known.get(name, cfg.get(name))
        if value is None or (defaults_only and have is not None):
            value = have
        if isinstance(value, dict):  # transformers' AddedToken form
            value = value.get("content")
        if value is not None:
            cfg[name] = _token(backend, name, value)
    template = chat_template or known.get("chat_template") or cfg.get("chat_template") or DEFAULT_CHAT_TEMPLATE
    cfg.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=template)
    for stale in ("auto_map", "added_tokens_decoder"):  # a remote tokenizer class / added tokens: tokenizer.json rules
        cfg.pop(stale, None)
    cfg.setdefault("clean_up_tokenization_spaces", False)
    max_len = model_max_length or known.get("model_max_length")
    if max_len is not None:
        cfg["model_max_length"] = max_len
    backend.save(str(d / "tokenizer.json"))
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False, sort_keys=True) + "\n")
    written = [d / "tokenizer.json", cfg_path]
    jinja = d / "chat_template.jinja"  # transformers 5 writes (and prefers) this file: keep it the same template
    if jinja.is_file():
        jinja.write_text(template)
        written.append(jinja)
    return written
