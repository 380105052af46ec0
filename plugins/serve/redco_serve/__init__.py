"""``redco-serve``: ``redco serve --model DIR``, a zoo model behind an OpenAI-compatible HTTP API.

* ``engine`` is ``redco_zoo_models.engine``: continuous batching, a request's samples sharing its
  prompt's prefill, each request sampled its own way.
* ``text.py``: a sample's text as its tokens arrive (stop strings, characters split over tokens).
* ``openai_api.py``: the OpenAI request fields read and checked, and the response bodies built.
* ``app.py``: the HTTP routes (Starlette): ``/v1/completions``, ``/v1/chat/completions`` (the
  tokenizer's chat template), server-sent events when ``stream``, ``/v1/models``, ``/health``.
* ``command.py``: the ``serve`` command (uvicorn; SIGTERM finishes the requests in flight).

Building the ``redco`` command line imports this module alone; the rest is imported by ``run``.
"""
from __future__ import annotations

import redco
from redco_serve.command import ServeCommand

__all__ = ["ServeCommand"]


@redco.hookimpl
def register_commands(register):
    register("serve", ServeCommand())
