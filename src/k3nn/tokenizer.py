"""Tokenizers for the CLI and examples: a checkpoint's ``tokenizer.json`` (HF ``tokenizers``), Kimi's
``tiktoken.model`` (``tiktoken``), or a byte-level fallback (UTF-8 bytes as ids) for byte-vocab models."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["ByteTokenizer", "load_tokenizer"]


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
