"""``k3nn serve``: an OpenAI-compatible HTTP server over :class:`k3nn.engine.Engine` (the ``serve`` extra:
``pip install 'k3nn[serve]'`` brings FastAPI, uvicorn, prometheus-client and jinja2).

* :mod:`.protocol`: request schemas, validation, OpenAI's error JSON, the mapping onto ``SamplingParams``;
* :mod:`.async_engine`: :class:`AsyncEngine`, the Engine on its own thread, driven from asyncio;
* :mod:`.chat`: the checkpoint's Jinja chat template, rendered as transformers renders it;
* :mod:`.metrics`: the Prometheus metrics of ``/metrics``;
* :mod:`.app`: :class:`OpenAIServer` (the FastAPI app) and :func:`run_server` (uvicorn);
* :mod:`.cli`: the ``k3nn serve`` command.

In Python::

    from k3nn.engine import Engine
    from k3nn.serve import AsyncEngine, OpenAIServer, load_chat_template, run_server

    engine = Engine(model, max_num_seqs=16, tokenizer=tok)
    server = OpenAIServer(AsyncEngine(engine), tok, served_model_names=["k3"], max_model_len=8192,
                          chat_template=load_chat_template(checkpoint_dir))
    run_server(server, host="127.0.0.1", port=8000)   # or serve server.app with any ASGI server

The names are imported on first use, so ``import k3nn.serve`` works without the extra installed.
"""

from __future__ import annotations

import importlib

__all__ = ["AsyncEngine", "RequestStream", "OpenAIServer", "run_server", "ChatTemplate", "load_chat_template",
           "APIError", "ServeMetrics"]

_WHERE = {"AsyncEngine": "async_engine", "RequestStream": "async_engine", "OpenAIServer": "app",
          "run_server": "app", "ChatTemplate": "chat", "load_chat_template": "chat", "APIError": "protocol",
          "ServeMetrics": "metrics"}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
