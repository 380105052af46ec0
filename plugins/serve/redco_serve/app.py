"""The HTTP routes, on Starlette: each request is checked, tokenized (chat messages through the
tokenizer's chat template) and submitted to the engine, which runs in its own thread; its
tokens come back to the event loop through an ``asyncio.Queue`` and leave as one JSON body or,
when ``stream``, as server-sent events. A client that goes away cancels its samples."""
from __future__ import annotations

import asyncio
import json
import threading

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from redco_serve import images
from redco_serve import openai_api as api
from redco_serve.logprobs import token_logprobs
from redco_serve.text import TextStream
from redco_serve.tokenizer_routes import tokenizer_routes
from redco_zoo_models.engine import Engine
from redco_zoo_models.scoring import Scorer


class Job:
    """One HTTP request's samples, seen from the event loop: the engine's thread hands over
    ``(choice, kind, payload)`` events (kind ``"text"``: new text; ``"end"``: the finish
    reason), all that one engine step made at once (one wake-up of the loop a step, not one a
    token). Text is decoded as tokens arrive only when it is needed then (``per_token``: a
    stream, or stop strings to watch for); otherwise once, when a sample ends."""

    def __init__(self, tokenizer, stop: list[str], per_token: bool):
        self.loop, self.queue = asyncio.get_running_loop(), asyncio.Queue()
        self.tokenizer, self.stop, self.per_token = tokenizer, stop, per_token
        self.streams: dict[int, TextStream] = {}
        self.requests, self.first_choice = [], {}
        self.samples = {}  # choice -> (request, index of the sample in it)
        self._pending, self._lock, self._woken = [], threading.Lock(), False

    def submit(self, engine: Engine, prompt: list[int], sampling, images=None) -> None:
        on_token = self._on_token if self.per_token else None
        request = engine.submit(prompt, sampling, on_token, self._on_end, images)
        first = self.first_choice[id(request)] = len(self.streams)
        for index in range(sampling.n):
            self.streams[first + index] = TextStream(self.tokenizer, self.stop)
            self.samples[first + index] = (request, index)
        self.requests.append(request)

    def choice(self, request, index: int) -> int:
        return self.first_choice[id(request)] + index

    def _on_token(self, request, index, token, logprob) -> bool:
        stream = self.streams[self.choice(request, index)]
        delta = stream.push(token)
        if delta:
            self._put(self.choice(request, index), "text", delta)
        return stream.stopped

    def _on_end(self, request, index) -> None:
        choice = self.choice(request, index)
        if not self.per_token:
            self.streams[choice].extend(request.samples[index].tokens)
        self._put(choice, "end", request.samples[index].finish_reason)

    def _put(self, *event) -> None:
        """Queue ``event`` for the loop; wake it once for all that arrive before it runs."""
        with self._lock:
            self._pending.append(event)
            wake, self._woken = not self._woken, True
        if wake:
            self.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            events, self._pending, self._woken = self._pending, [], False
        for event in events:
            self.queue.put_nowait(event)

    async def events(self):
        """``(choice, kind, payload)`` until every sample has ended; cancels what is left when
        the consumer stops early (a client gone)."""
        ended = 0
        try:
            while ended < len(self.streams):
                event = await self.queue.get()
                ended += event[1] == "end"
                yield event
        finally:
            for request in self.requests:
                request.cancel()

    def sample(self, choice: int):
        request, index = self.samples[choice]
        return request.samples[index]


def build_app(engine: Engine, tokenizer, model_name: str, eos_ids: tuple[int, ...],
              scorer: Scorer, processor=None) -> Starlette:
    """The OpenAI-compatible application over a started ``engine``; ``scorer`` gives the
    prompts' log-probabilities and each place's alternatives (``echo``, ``logprobs`` > 0);
    ``processor``: an image + text model's, which makes chats with image parts (``images``)."""

    async def health(request: Request):
        stats = {"prefix_cache": engine.prefix_stats} if engine.prefix is not None else {}
        return JSONResponse({"status": "ok", **stats})

    async def models(request: Request):
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": 0, "owned_by": "redco"}]})

    async def completions(request: Request):
        body = await json_body(request)
        api.check_model(body, model_name)
        prompts = prompt_ids(body.get("prompt"), tokenizer)
        return await answer(body, prompts, chat=False, texts=prompt_texts(body, prompts))

    async def chat_completions(request: Request):
        body = await json_body(request)
        api.check_model(body, model_name)
        messages = body.get("messages")
        if processor is None:
            images.refuse_images(messages)
            return await answer(body, [chat_ids(messages, tokenizer)], chat=True)
        prompt, pixels = await asyncio.to_thread(images.chat_with_images, messages, processor,
                                                 chat_text)
        return await answer(body, [prompt], chat=True, pixels=pixels)

    async def answer(body: dict, prompts: list[list[int]], chat: bool, texts=(), pixels=None):
        logprobs = api.wants_logprobs(body, chat)
        echo = api.wants_echo(body, chat, logprobs)
        room = engine.max_len - max(len(p) for p in prompts)
        if room < 1:
            raise api.BadRequest(f"The prompt is {max(len(p) for p in prompts)} tokens; this "
                                 f"server's --max_len is {engine.max_len}, which leaves no room "
                                 "for a completion: shorten it, or restart the server with a "
                                 "larger --max_len.", "messages" if chat else "prompt")
        key = "max_completion_tokens" if chat else "max_tokens"
        sampling, stop = api.sampling_of(body, key, room, engine.max_seqs, eos_ids)
        job = Job(tokenizer, stop, per_token=bool(body.get("stream") or stop))
        for prompt in prompts:
            try:
                job.submit(engine, prompt, sampling, pixels)
            except ValueError as e:
                raise api.BadRequest(str(e)) from e
        reply = Reply(job, model_name, chat, sum(map(len, prompts)))
        reply.logprobs, reply.echo, reply.texts, reply.scorer = logprobs, echo, texts, scorer
        if body.get("stream"):
            return StreamingResponse(reply.stream(), media_type="text/event-stream")
        return JSONResponse(await reply.whole())

    async def refused(request: Request, error: api.BadRequest):
        return JSONResponse(error.body(), status_code=error.status)

    return Starlette(routes=[
        Route("/health", health), Route("/v1/models", models),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        *tokenizer_routes(tokenizer, engine.max_len, json_body, chat_text),
    ], exception_handlers={api.BadRequest: refused})


class Reply:
    """A job's answer, whole or as server-sent events, in the completions or the chat shape;
    with ``logprobs`` (alternatives a place, None: none) and ``echo`` (the prompt ``texts``
    first) set by the route."""

    def __init__(self, job: Job, model: str, chat: bool, prompt_tokens: int):
        self.job, self.model, self.chat = job, model, chat
        self.kind = "chat.completion" if chat else "text_completion"
        self.id, self.prompt_tokens = api.new_id("chatcmpl" if chat else "cmpl"), prompt_tokens
        self.logprobs, self.echo, self.texts, self.scorer = None, False, (), None

    def _logprobs(self, choice: int) -> dict | None:
        """A choice's log-probabilities body (a forward pass when alternatives or the prompt's
        are asked for: called off the event loop then; without log-probabilities, whole replies
        make no thread hop)."""
        if self.logprobs is None:
            return None
        request, index = self.job.samples[choice]
        found = token_logprobs(self.job.tokenizer, self.scorer, request.prompt,
                               request.samples[index], self.logprobs, self.echo,
                               request.sampling.temperature)
        shape = api.chat_logprobs if self.chat else api.completion_logprobs
        return shape(found.pieces, found.logprobs, found.alternatives)

    def _choice(self, choice: int, reason: str | None, logprobs: dict | None = None) -> dict:
        return {"index": choice, "finish_reason": reason, "logprobs": logprobs}

    def _whole_choice(self, choice: int, text: str, reason: str, logprobs) -> dict:
        """A sample's whole answer: its text (after the prompt's, with ``echo``), or the chat's
        assistant message."""
        if self.echo:
            request = self.job.samples[choice][0]
            given = self.texts[self.job.requests.index(request)]
            text = (given if given is not None else self.job.tokenizer.decode(request.prompt)) \
                + text
        content = {"message": {"role": "assistant", "content": text}} if self.chat else {"text": text}
        return {**self._choice(choice, reason, logprobs), **content}

    def _chunk_choice(self, choice: int, text: str, reason: str | None, first: bool) -> dict:
        """A piece of a sample's answer, streamed; in a chat, its first delta names the role."""
        if not self.chat:
            return {**self._choice(choice, reason), "text": text}
        delta = {"role": "assistant", "content": text} if first else {"content": text}
        return {**self._choice(choice, reason), "delta": delta if text or first else {}}

    def _usage(self) -> dict:
        streams = self.job.streams.values()
        return api.usage(self.prompt_tokens, sum(len(s.tokens) for s in streams))

    async def whole(self) -> dict:
        reasons = {}
        async for choice, kind, payload in self.job.events():
            if kind == "end":
                reasons[choice] = payload
        failed = next((r.error for r in self.job.requests if r.error is not None), None)
        if failed is not None:
            raise api.BadRequest(f"The engine failed while running this request: {failed!r}",
                                 status=500)
        for stream in self.job.streams.values():
            stream.finish()
        logprobs = {c: None for c in reasons} if self.logprobs is None else \
            await asyncio.to_thread(lambda: {c: self._logprobs(c) for c in reasons})
        choices = [self._whole_choice(c, s.text, reasons[c], logprobs[c])
                   for c, s in sorted(self.job.streams.items())]
        return api.envelope(self.kind, self.id, self.model, choices, usage=self._usage())

    async def stream(self):
        kind = self.kind + ".chunk" if self.chat else self.kind
        started = set()
        async for choice, what, payload in self.job.events():
            text = payload if what == "text" else self.job.streams[choice].finish()
            reason = payload if what == "end" else None
            body = self._chunk_choice(choice, text, reason, first=choice not in started)
            body["logprobs"] = self._logprobs(choice) if reason else None  # (no forward pass)
            started.add(choice)
            yield f"data: {json.dumps(api.envelope(kind, self.id, self.model, [body]))}\n\n"
        yield "data: [DONE]\n\n"


async def json_body(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except ValueError as e:
        raise api.BadRequest(f"The body is not JSON: {e}.") from e
    if not isinstance(body, dict):
        raise api.BadRequest("The body must be a JSON object.")
    return body


def prompt_ids(prompt, tokenizer) -> list[list[int]]:
    """A completions ``prompt`` (a string, a list of strings, token ids or lists of them) as
    token id lists."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt or not all(
            isinstance(p, str) and p or isinstance(p, list) and p and
            all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompt):
        raise api.BadRequest("prompt: give a non-empty string, a list of them, a list of token "
                             "ids, or a list of such lists.", "prompt")
    return [tokenizer(p, add_special_tokens=True)["input_ids"] if isinstance(p, str) else p
            for p in prompt]


def prompt_texts(body: dict, prompts: list[list[int]]) -> list[str]:
    """Each prompt as text, as ``echo`` returns it: as given, or its token ids decoded."""
    given = body.get("prompt")
    given = [given] if isinstance(given, str) else given
    return [g if isinstance(g, str) else None for g in given] if isinstance(given, list) and \
        len(given) == len(prompts) else [None] * len(prompts)


def chat_ids(messages, tokenizer) -> list[int]:
    """``messages`` rendered with the tokenizer's chat template and the generation prompt, as
    token ids."""
    return tokenizer(chat_text(messages, tokenizer), add_special_tokens=False)["input_ids"]


def chat_text(messages, tokenizer) -> str:
    """``messages`` rendered with the tokenizer's chat template and the generation prompt."""
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise api.BadRequest("messages: give a non-empty list of {\"role\", \"content\"} "
                             "objects.", "messages")
    if not getattr(tokenizer, "chat_template", None):
        raise api.BadRequest("This model's tokenizer has no chat template: use "
                             "/v1/completions, or give tokenizer_config.json a chat_template.",
                             "messages")
    from jinja2 import TemplateError
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True)
    except TemplateError as e:
        raise api.BadRequest(f"The chat template refuses these messages: {e}",
                             "messages") from e
    return text
