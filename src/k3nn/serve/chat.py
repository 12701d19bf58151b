"""Chat templates: a checkpoint's Jinja template rendered as transformers renders it.

:func:`load_chat_template` finds the template of a checkpoint directory where transformers keeps it:
``chat_template.jinja`` (what transformers writes today), the ``chat_template`` entry of ``tokenizer_config.json``
(a string, or a list of ``{"name", "template"}`` of which ``"default"`` is used), or ``chat_template.json``.
:class:`ChatTemplate` compiles it in jinja2's immutable sandbox with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension and transformers' template globals: ``raise_exception(msg)``, ``strftime_now(fmt)``, a
``tojson`` filter that keeps non-ASCII characters, and the ``{% generation %}`` block (rendered as its body). The
render context is ``messages``, ``add_generation_prompt``, ``tools=None``, ``documents=None``, the tokenizer's
special tokens (``bos_token``, ``eos_token``, ... from ``tokenizer_config.json``) and the request's
``chat_template_kwargs``.

:func:`normalize_messages` checks OpenAI chat messages (roles, string or text-part content) and turns them into
the plain ``{"role", "content"[, "name"]}`` dicts templates read.
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from jinja2 import nodes

from .protocol import APIError

__all__ = ["ChatTemplate", "ChatTemplateError", "load_chat_template", "special_tokens", "normalize_messages",
           "ROLES"]

ROLES = ("system", "developer", "user", "assistant", "tool")
_RESERVED = ("messages", "add_generation_prompt", "tools", "documents")


class ChatTemplateError(ValueError):
    """The template does not compile, or refused to render the messages (``raise_exception`` or a Jinja error)."""


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %} ... {% endgeneration %}`` (transformers marks the assistant's tokens with it for
    ``return_assistant_tokens_mask``): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template. ``source``: the Jinja text; ``special_tokens``: names → strings available to the
    template (``bos_token``, ``eos_token``, ...); ``origin``: where it came from (for messages)."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None, origin: str = "chat template"):
        if not isinstance(source, str) or not source.strip():
            raise ChatTemplateError(f"{origin}: the chat template is empty")
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=[jinja2.ext.loopcontrols, _GenerationBlock])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"{origin}: the chat template does not compile: {e}") from None
        self.source, self.origin = source, origin
        self.special_tokens = dict(special_tokens or {})

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               variables: dict[str, Any] | None = None) -> str:
        """The prompt text of ``messages`` (plain dicts, see :func:`normalize_messages`); ``variables``: extra
        template variables (a request's ``chat_template_kwargs``; they may override the special tokens, as in
        transformers)."""
        kwargs = dict(variables or {})
        bad = [k for k in kwargs if k in _RESERVED]
        if bad:
            raise ChatTemplateError(f"chat_template_kwargs must not set {bad}: the server sets them")
        ctx = {**self.special_tokens, **kwargs}
        try:
            return self.template.render(messages=messages, tools=None, documents=None,
                                        add_generation_prompt=add_generation_prompt, **ctx)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template refused the messages: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as e:  # a template reading what is not there
            raise ChatTemplateError(f"the chat template failed on the messages: {type(e).__name__}: {e}") from None


def special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """The special-token strings of a ``tokenizer_config.json`` (values given as strings or as transformers'
    ``AddedToken`` dicts with ``content``)."""
    out = {}
    for name in ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"):
        v = config.get(name)
        if isinstance(v, dict):
            v = v.get("content")
        if isinstance(v, str):
            out[name] = v
    return out


def load_chat_template(directory: str | os.PathLike | None, override: str | None = None) -> ChatTemplate | None:
    """The chat template of a checkpoint (tokenizer) directory, or None when it has none. ``override``: a template
    file, or the template text itself (``--chat-template``), used instead of the directory's."""
    d = Path(directory) if directory is not None else None
    cfg: dict[str, Any] = {}
    if d is not None and (d / "tokenizer_config.json").is_file():
        try:
            cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
        except ValueError as e:
            raise ChatTemplateError(f"{d / 'tokenizer_config.json'} is not valid JSON: {e}") from None
    toks = special_tokens(cfg)
    if override is not None:
        p = Path(override)
        if len(override) < 4096 and p.is_file():
            return ChatTemplate(p.read_text(encoding="utf-8"), toks, origin=str(p))
        return ChatTemplate(override, toks, origin="--chat-template")
    if d is None:
        return None
    if (d / "chat_template.jinja").is_file():
        return ChatTemplate((d / "chat_template.jinja").read_text(encoding="utf-8"), toks,
                            origin=str(d / "chat_template.jinja"))
    src = cfg.get("chat_template")
    if src is None and (d / "chat_template.json").is_file():
        src = json.loads((d / "chat_template.json").read_text(encoding="utf-8")).get("chat_template")
    if src is None:
        return None
    if isinstance(src, list):  # named templates
        named = {t.get("name"): t.get("template") for t in src if isinstance(t, dict)}
        if "default" not in named:
            raise ChatTemplateError(f"{d}: the named chat templates {sorted(named)} have no 'default'; pass "
                                    f"--chat-template")
        src = named["default"]
    return ChatTemplate(src, toks, origin=str(d / "tokenizer_config.json"))


def normalize_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI chat messages as the plain dicts templates read: ``{"role", "content"}`` (+ ``"name"`` when given).
    ``content``: a string, or a list of ``{"type": "text", "text": ...}`` parts (joined with newlines); null only
    for an assistant message. Anything else is an :class:`~k3nn.serve.protocol.APIError` naming the message."""
    if not isinstance(messages, list) or not messages:
        raise APIError("messages must be a non-empty list of message objects", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise APIError(f"{where} must be an object with role and content, got {type(m).__name__}", param=where)
        extra = [k for k in m if k not in ("role", "content", "name")]
        if extra:
            raise APIError(f"{where}.{extra[0]}: this field is not supported by k3nn serve (no tool calls or "
                           f"audio)", param=f"{where}.{extra[0]}", code="unsupported_parameter")
        role = m.get("role")
        if role not in ROLES:
            raise APIError(f"{where}.role must be one of {list(ROLES)}, got {role!r}", param=f"{where}.role")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise APIError(f"{where}.content[{j}]: only text parts ({{'type': 'text', 'text': ...}}) are "
                                   f"supported, got {kind!r}", param=f"{where}.content[{j}]")
                texts.append(part["text"])
            content = "\n".join(texts)
        elif content is None:
            if role != "assistant":
                raise APIError(f"{where}.content is required for role {role!r}", param=f"{where}.content")
        elif not isinstance(content, str):
            raise APIError(f"{where}.content must be a string or a list of text parts, got "
                           f"{type(content).__name__}", param=f"{where}.content")
        msg: dict[str, Any] = {"role": role, "content": content}
        if "name" in m:
            if not isinstance(m["name"], str):
                raise APIError(f"{where}.name must be a string", param=f"{where}.name")
            msg["name"] = m["name"]
        out.append(msg)
    return out
