"""The OpenAI API's request fields, read and checked before anything runs, and its response
bodies. ``ignore_eos`` (vLLM's extension, for benchmarks) runs past the end token. Unknown
fields are ignored, as OpenAI's own server ignores them; fields this server cannot honour
(``best_of``, penalties, ``logit_bias``, ``suffix``) are refused with a 400 that names them,
never silently dropped."""
from __future__ import annotations

import time
import uuid
from typing import Any

from redco_zoo_models.requests import Sampling
from redco_zoo_models.scoring import MAX_ALTERNATIVES

UNSUPPORTED = {  # field -> the value that asks for nothing
    "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None,
    "suffix": None,
}


class BadRequest(Exception):
    """A request refused with ``status`` and a message naming the field and the fix (or, with
    500, what failed)."""

    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status

    def body(self) -> dict:
        kind = {400: "invalid_request_error", 404: "not_found_error"}.get(self.status,
                                                                          "server_error")
        return {"error": {"message": str(self), "type": kind, "param": self.param,
                          "code": None}}


def number(body: dict, name: str, default, low: float, high: float, integer: bool = False):
    """``body[name]`` (``default`` when absent or null), checked to lie in ``[low, high]``."""
    value = body.get(name)
    if value is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        raise BadRequest(f"{name}={value!r}: give {kind} from {low} to {high}.", name)
    return value


def check_model(body: dict, served: str) -> None:
    if body.get("model") not in (served, None):
        raise BadRequest(f"The model {body.get('model')!r} does not exist here: this server "
                         f"serves {served!r} (GET /v1/models lists it).", "model", 404)


def sampling_of(body: dict, max_tokens_key: str, room: int, max_seqs: int,
                stop_token_ids: tuple[int, ...] = ()) -> tuple[Sampling, list[str]]:
    """The engine's ``Sampling`` and the stop strings of a request; ``room``: the most tokens a
    completion may take (what the prompt leaves of the engine's ``max_len``)."""
    for name, nothing in UNSUPPORTED.items():
        if body.get(name) not in (nothing, None):
            raise BadRequest(f"{name}={body[name]!r} is not supported by redco serve; leave it "
                             "out.", name)
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 4:
        raise BadRequest("stop: give a string or a list of at most 4 strings.", "stop")
    default_tokens = 16 if max_tokens_key == "max_tokens" else room
    max_tokens = number(body, max_tokens_key, None, 1, 10 ** 9, integer=True)
    if max_tokens is None and max_tokens_key != "max_tokens":
        max_tokens = number(body, "max_tokens", None, 1, 10 ** 9, integer=True)
    max_tokens = default_tokens if max_tokens is None else max_tokens
    if max_tokens > room:
        raise BadRequest(f"{max_tokens_key}={max_tokens} is more than the {room} tokens the "
                         "prompt leaves of this server's --max_len: lower it, shorten the prompt, "
                         "or restart the server with a larger --max_len.", max_tokens_key)
    seed = number(body, "seed", None, 0, 2 ** 31 - 1, integer=True)
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadRequest("ignore_eos: give true (run past the end token to max_tokens, as "
                         "vLLM's benchmarks do) or false.", "ignore_eos")
    return Sampling(
        max_tokens=max(1, max_tokens),  # (a chat's default, room, may be 0)
        temperature=float(number(body, "temperature", 1.0, 0, 2)),
        top_p=float(number(body, "top_p", 1.0, 1e-9, 1)),
        top_k=max(0, number(body, "top_k", 0, -1, 10 ** 9, integer=True)),
        n=number(body, "n", 1, 1, max_seqs, integer=True), seed=seed,
        stop_token_ids=() if ignore_eos else stop_token_ids, ignore_eos=ignore_eos), stop


def wants_logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives a place each returned token's log-probability comes with (0: its
    own only), or None: no log-probabilities. Completions: ``logprobs`` (an integer); chat:
    ``logprobs`` (true or false) and ``top_logprobs``."""
    value = body.get("logprobs")
    if chat:
        if value not in (None, True, False):
            raise BadRequest("logprobs: give true or false.", "logprobs")
        top = number(body, "top_logprobs", 0, 0, MAX_ALTERNATIVES, integer=True)
        if top and not value:
            raise BadRequest("top_logprobs needs logprobs=true.", "top_logprobs")
        return top if value else None
    return number(body, "logprobs", None, 0, MAX_ALTERNATIVES, integer=True)


def wants_echo(body: dict, chat: bool, logprobs: int | None) -> bool:
    """Completions' ``echo``: the prompt comes back before the completion (with its tokens'
    log-probabilities when ``logprobs`` asks). Neither it nor alternatives in a stream."""
    echo = False if chat else body.get("echo", False)
    if echo not in (True, False, None):
        raise BadRequest("echo: give true or false.", "echo")
    if body.get("stream") and (echo or logprobs):
        raise BadRequest("echo and alternatives (logprobs above 0, top_logprobs) come with "
                         "whole replies only: leave out stream, or ask for a token's own "
                         "log-probability only.", "stream")
    return bool(echo)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def envelope(kind: str, id_: str, model: str, choices: list[dict], **extra: Any) -> dict:
    return {"id": id_, "object": kind, "created": int(time.time()), "model": model,
            "choices": choices, **extra}


def completion_logprobs(pieces: list[str], logprobs: list, alternatives) -> dict:
    offsets, at = [], 0
    for piece in pieces:
        offsets.append(at)
        at += len(piece)
    return {"tokens": pieces, "token_logprobs": logprobs, "top_logprobs": alternatives,
            "text_offset": offsets}


def chat_logprobs(pieces: list[str], logprobs: list, alternatives) -> dict:
    def top(place):
        return [{"token": p, "logprob": lp, "bytes": list(p.encode())}
                for p, lp in (alternatives[place] if alternatives else {}).items()]
    return {"content": [{"token": p, "logprob": lp, "bytes": list(p.encode()),
                         "top_logprobs": top(i)} for i, (p, lp) in enumerate(zip(pieces, logprobs))]}
