"""Chats rendered with the tokenizer's own chat template, and which tokens are the assistant's.

A chat is a list of messages ``{"role", "content"}``. ``render_chat`` renders it to text with the
tokenizer's template (transformers' ``apply_chat_template``) and tokenizes that text once, with
each token's character offsets. A token is the assistant's when it starts in one of the
assistant's spans of that text: each assistant message's reply as the template renders it in
the whole chat (for Qwen3, with the ``<think>`` block it renders for that turn) and the
template's end of turn after it (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``, ``<|end|>``),
never the role headers, the system text, the user's messages or what the template puts between
turns (a newline, a final EOS). The spans are found in one of three ways:

* A template with ``{% generation %}`` blocks marks them itself: the spans are its blocks (as
  transformers' ``return_assistant_tokens_mask`` finds them).
* Otherwise a span starts where the chat up to the message, rendered with the generation prompt,
  ends: that rendering must be a prefix of the whole (it is for ChatML, Llama 3, Qwen3, Gemma,
  Phi). It ends with the first end of turn after that: the text the template puts after a
  reply both when the chat ends there and when a user message follows, found by rendering the
  same chat with a probe reply (its trailing whitespace left out). The reply's own text (after
  its reasoning, if any; stripped) must end the span right before that end of turn (or, for a
  message with tool calls, lie in it), or the chat is refused naming the message. This does not
  ask that the chat up to and including a reply render as a prefix of the whole, which Qwen3
  (it drops the reasoning of turns before the last user message, and gives the last turn an
  empty ``<think>`` block) and Phi (it ends a chat with its EOS) do not.
* A template with no end of turn: the chat up to and including the message, rendered, must be a
  prefix of the whole, and the span ends where it ends.

A template that renders the chat up to a message other than as a prefix of the whole is refused
(the mask would be wrong), as is one that refuses the chat (Gemma's system message), a chat with
no assistant message, or one longer than the rows it must fit.

``pack_chats`` puts rendered chats into rows of equal length, best-fit (as
``redco_zoo_lm.packing`` packs documents), each chat with its own segment id, so a chat attends
only to itself and the rest of the row is padding, which no loss counts.
"""
from __future__ import annotations

import re

import numpy as np
from jinja2 import TemplateError

from redco.protocols import UsageError
from redco_zoo_lm.packing import best_fit

GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")
PROBE_REPLY, PROBE_USER = "redco probe reply", "redco probe question"


def render(tokenizer, messages: list[dict], where: str, add_generation_prompt: bool = False,
           template_kwargs: dict | None = None) -> str:
    """``messages`` rendered to text by the tokenizer's chat template; a template that refuses
    them (``raise_exception``) is a ``UsageError`` naming ``where``."""
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             **(template_kwargs or {}))
    except TemplateError as e:
        raise UsageError(f"{where}: the tokenizer's chat template refuses it: {e}") from e


def end_of_turn(tokenizer, head: list[dict], where: str,
                template_kwargs: dict | None = None) -> str:
    """The text the chat template puts after an assistant's reply to ``head`` to end its turn,
    whatever follows (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``, ``<|end|>``): the
    whole tokens that follow a probe reply both where the chat ends with it and where a user
    message follows it, trailing whitespace left out; ``""`` where there are none."""
    reply = {"role": "assistant", "content": PROBE_REPLY}
    try:
        last = render(tokenizer, head + [reply], where, template_kwargs=template_kwargs)
        more = render(tokenizer, head + [reply, {"role": "user", "content": PROBE_USER}], where,
                      template_kwargs=template_kwargs)
    except UsageError:  # the template refuses the probe chats: no end of turn found
        return ""
    if PROBE_REPLY not in last or PROBE_REPLY not in more:
        return ""
    last = last[last.rindex(PROBE_REPLY) + len(PROBE_REPLY):]
    more = more[more.index(PROBE_REPLY) + len(PROBE_REPLY):]
    tokens = tokenizer(last, add_special_tokens=False, return_offsets_mapping=True)
    others = tokenizer(more, add_special_tokens=False)["input_ids"]
    n = 0
    while n < min(len(tokens["input_ids"]), len(others)) and \
            tokens["input_ids"][n] == others[n]:
        n += 1
    return last[:tokens["offset_mapping"][n - 1][1]].rstrip() if n else ""


def stop_token_id(tokenizer) -> int:
    """The token that ends an assistant's turn under the tokenizer's chat template (Gemma's
    ``<end_of_turn>``, Phi's ``<|end|>``, Llama 3's ``<|eot_id|>``), where it is one token; else
    the tokenizer's EOS. Sampling stops there, as the model learnt to end its replies."""
    marker = end_of_turn(tokenizer, [{"role": "user", "content": PROBE_USER}], "the template")
    ids = tokenizer(marker, add_special_tokens=False)["input_ids"] if marker else []
    return ids[0] if len(ids) == 1 else tokenizer.eos_token_id


def reply_text(message: dict) -> str:
    """The part of an assistant message that every template renders as it is, right before
    its end of turn (after it only the message's tool calls, if any): its content after its
    reasoning (after the last ``</think>``), stripped; ``""`` for content other than a
    string."""
    content = message.get("content")
    return content.split("</think>")[-1].strip() if isinstance(content, str) else ""


def generation_spans(tokenizer, messages: list[dict], text: str, where: str,
                     template_kwargs: dict | None = None) -> list[tuple[int, int]]:
    """The character spans of ``text`` that the template's ``{% generation %}`` blocks mark."""
    from transformers.utils.chat_template_utils import render_jinja_template
    try:
        rendered, spans = render_jinja_template(
            conversations=[messages], chat_template=tokenizer.get_chat_template(),
            return_assistant_tokens_mask=True,
            **{**tokenizer.special_tokens_map, **(template_kwargs or {})})
    except TemplateError as e:
        raise UsageError(f"{where}: the tokenizer's chat template refuses it: {e}") from e
    if rendered[0] != text:
        raise UsageError(f"{where}: the chat template renders the chat differently with its "
                         "{% generation %} blocks tracked; its assistant tokens cannot be told "
                         "apart.")
    return [tuple(span) for span in spans[0]]


def assistant_spans(tokenizer, messages: list[dict], text: str, where: str,
                    learn_from: int = 0,
                    template_kwargs: dict | None = None) -> list[tuple[int, int]]:
    """The character spans of ``text`` (the whole chat rendered) that are the assistant's, in
    the messages from ``learn_from`` on (see the module's docstring for how they are found)."""
    if GENERATION_BLOCK.search(tokenizer.get_chat_template()):
        start = len(render(tokenizer, messages[:learn_from], where, True, template_kwargs)) \
            if learn_from else 0
        spans = [(max(a, start), b) for a, b in generation_spans(
            tokenizer, messages, text, where, template_kwargs) if b > max(a, start)]
        if not spans:
            raise UsageError(f"{where}: the chat template's {{% generation %}} blocks mark none "
                             f"of the assistant's messages (from message {learn_from} on).")
        return spans
    spans, end, marker = [], 0, None
    for i, message in enumerate(messages):
        if message.get("role") != "assistant" or i < learn_from:
            continue
        if i == 0:
            raise UsageError(f"{where}: message 0 is the assistant's; a chat begins with the user's "
                             "(or the system's) message that the assistant answers.")
        before = render(tokenizer, messages[:i], where, True, template_kwargs)
        if not text.startswith(before) or len(before) < end:
            raise UsageError(f"{where}: the tokenizer's chat template renders the chat up to "
                             f"message {i} as other than a prefix of the whole chat, so its "
                             "assistant tokens cannot be told apart. Use a template that renders "
                             "turns one after another (ChatML, Llama 3, Qwen3, Gemma, Phi, ...) "
                             "or mark the replies with {% generation %} blocks.")
        if marker is None:  # the same after every reply: found once, at the first
            marker = end_of_turn(tokenizer, messages[:i], where, template_kwargs)
        if marker:
            stop = text.find(marker, len(before))
            reply, turn = reply_text(message), text[len(before):max(stop, len(before))].rstrip()
            if stop < 0 or not (reply in turn if message.get("tool_calls") else
                                turn.endswith(reply)):
                raise UsageError(
                    f"{where}: message {i} (the assistant's) is not where the chat template "
                    f"rendered it: its reply {reply[:40]!r} and the template's end of turn "
                    f"{marker!r} do not follow the chat up to it, so its tokens cannot be "
                    "told apart. Mark the replies with {% generation %} blocks in the template.")
            end = stop + len(marker)
        else:
            through = render(tokenizer, messages[:i + 1], where, template_kwargs=template_kwargs)
            if not (through.startswith(before) and text.startswith(through)):
                raise UsageError(f"{where}: the tokenizer's chat template renders the chat up to "
                                 f"message {i} as other than a prefix of the whole chat, and "
                                 "ends no turn with a token of its own, so its assistant tokens "
                                 "cannot be told apart. Mark the replies with "
                                 "{% generation %} blocks in the template.")
            end = len(through)
        spans.append((len(before), end))
    return spans


def require_chat_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError("The tokenizer has no chat template: give the model directory's "
                         "tokenizer_config.json a 'chat_template' (or pass one to the tokenizer).")


def render_prompt(tokenizer, prompt: list[dict] | str, max_len: int,
                  where: str = "a prompt", template_kwargs: dict | None = None) -> np.ndarray:
    """A prompt's token ids (int32): its messages (a string: one user message) rendered with
    the chat template and the generation prompt, so that what follows is the assistant's.
    ``template_kwargs`` go to the template (Qwen3's ``{"enable_thinking": False}`` ends the
    prompt with an empty ``<think>`` block, so the model answers without reasoning)."""
    require_chat_template(tokenizer)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    text = render(tokenizer, messages, where, True, template_kwargs)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) > max_len:
        raise UsageError(f"{where} is {len(ids)} tokens once rendered, longer than "
                         f"--max_prompt_len {max_len}: raise --max_prompt_len or shorten it.")
    return np.asarray(ids, np.int32)


def render_chat(tokenizer, messages: list[dict], max_len: int, where: str = "a chat",
                learn_from: int = 0, template_kwargs: dict | None = None) -> dict:
    """``{"token_ids", "loss_mask"}`` (int32, bool; one per token) of a chat rendered with
    ``tokenizer``'s chat template: the mask marks the assistant's tokens (of the messages from
    ``learn_from`` on: a preference pair's response, not its prompt). ``where`` names the chat
    in errors; ``template_kwargs`` go to the template."""
    require_chat_template(tokenizer)
    if not any(m.get("role") == "assistant" for m in messages[learn_from:]):
        raise UsageError(f"{where} has no assistant message: nothing to learn from it. Give "
                         "every chat at least one {'role': 'assistant', ...} message.")
    text = render(tokenizer, messages, where, template_kwargs=template_kwargs)
    spans = assistant_spans(tokenizer, messages, text, where, learn_from, template_kwargs)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, starts = encoded["input_ids"], [start for start, _ in encoded["offset_mapping"]]
    if len(ids) > max_len:
        raise UsageError(f"{where} is {len(ids)} tokens once rendered, longer than --max_len "
                         f"{max_len}: raise --max_len or shorten the chat.")
    mask = [any(a <= s < b for a, b in spans) for s in starts]
    return {"token_ids": np.asarray(ids, np.int32), "loss_mask": np.asarray(mask, bool)}


def pack_chats(chats: list[dict], width: int, seed: int = 0) -> list[dict]:
    """Rendered chats (``render_chat``'s) in rows of ``width`` tokens: ``{"token_ids",
    "segment_ids", "loss_mask"}``, best-fit, longest first (ties in an order fixed by ``seed``)."""
    lengths = np.array([len(c["token_ids"]) for c in chats])
    tie_break = np.random.default_rng(seed).permutation(len(chats))
    row_of = best_fit(lengths, width, np.lexsort((tie_break, -lengths)))
    rows = [{"token_ids": np.zeros(width, np.int32), "segment_ids": np.zeros(width, np.int32),
             "loss_mask": np.zeros(width, bool)} for _ in range(row_of.max() + 1)]
    filled = np.zeros(len(rows), np.int64)
    for i in np.lexsort((tie_break, row_of)):  # each row's chats in a fixed order
        row, at, n = rows[row_of[i]], filled[row_of[i]], lengths[i]
        row["token_ids"][at:at + n] = chats[i]["token_ids"]
        row["loss_mask"][at:at + n] = chats[i]["loss_mask"]
        row["segment_ids"][at:at + n] = row["segment_ids"].max() + 1
        filled[row_of[i]] += n
    return rows


def template_kwargs_arg(value: str) -> dict:
    """``--chat_template_kwargs``: a JSON object of the chat template's own variables."""
    import argparse
    import json
    try:
        kwargs = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): give an object, e.g. "
                                         "'{\"enable_thinking\": false}'") from e
    if not isinstance(kwargs, dict):
        raise argparse.ArgumentTypeError(f"{value!r} is not a JSON object: give one, e.g. "
                                         "'{\"enable_thinking\": false}'")
    return kwargs
