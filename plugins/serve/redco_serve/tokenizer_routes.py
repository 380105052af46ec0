"""vLLM's tokenizer endpoints, which lm-evaluation-harness's ``local-completions`` looks for
(``tokenizer_backend`` left at ``auto``: it then tokenizes through the server, so no tokenizer
path need be given): ``GET /tokenizer_info`` (the special tokens and the chat template),
``POST /tokenize`` (``prompt`` text, or chat ``messages`` through the chat template, to token
ids) and ``POST /detokenize`` (token ids to text), in vLLM's shapes."""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from redco_serve import openai_api as api


def tokenizer_routes(tokenizer, max_len: int, json_body, chat_text) -> list[Route]:
    """The three routes over ``tokenizer`` (``json_body`` reads a request's checked body,
    ``chat_text`` renders messages: ``redco_serve.app``'s)."""
    async def info(request: Request):
        return JSONResponse({
            "tokenizer_class": type(tokenizer).__name__, "model_max_length": max_len,
            **{f"{kind}_token": getattr(tokenizer, f"{kind}_token", None)
               for kind in ("eos", "bos", "pad", "unk")},
            "chat_template": getattr(tokenizer, "chat_template", None)})

    async def tokenize(request: Request):
        body = await json_body(request)
        if "messages" in body:
            text, special = chat_text(body["messages"], tokenizer), False
        elif isinstance(body.get("prompt"), str):
            text, special = body["prompt"], body.get("add_special_tokens", True)
        else:
            raise api.BadRequest("tokenize: give a string prompt, or chat messages.", "prompt")
        tokens = tokenizer(text, add_special_tokens=bool(special))["input_ids"]
        return JSONResponse({"count": len(tokens), "max_model_len": max_len, "tokens": tokens,
                             "token_strs": None})

    async def detokenize(request: Request):
        tokens = (await json_body(request)).get("tokens")
        if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise api.BadRequest("detokenize: give tokens, a list of token ids.", "tokens")
        return JSONResponse({"prompt": tokenizer.decode(tokens)})

    return [Route("/tokenizer_info", info), Route("/tokenize", tokenize, methods=["POST"]),
            Route("/detokenize", detokenize, methods=["POST"])]
