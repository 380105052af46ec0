"""Chats rendered with the tokenizer's own chat template, and which tokens are the assistant's.

A chat is a list of messages ``{"role", "content"}``. ``render_chat`` renders it to text with the
tokenizer's template (transformers' ``apply_chat_template``) and tokenizes that text once, with
each token's character offsets. The assistant's characters are found by rendering again: for
each assistant message, the chat up to it with the generation prompt, and up to and including
it; what lies between the two is the assistant's turn (its content and the template's end of
turn, which the model must learn to emit). A token is the assistant's when it starts there. A
template whose partial renderings are not prefixes of the whole is refused: the mask would be
wrong. So is a chat with no assistant message, or longer than the rows it must fit.

``pack_chats`` puts rendered chats into rows of equal length, best-fit (as
``redco_zoo_lm.packing`` packs documents), each chat with its own segment id, so a chat attends
only to itself and the rest of the row is padding, which no loss counts.
"""
from __future__ import annotations

import numpy as np

from redco.protocols import UsageError
from redco_zoo_lm.packing import best_fit


def assistant_spans(tokenizer, messages: list[dict], text: str, where: str,
                    learn_from: int = 0) -> list[tuple[int, int]]:
    """The character spans of ``text`` (the whole chat rendered) that are the assistant's, in
    the messages from ``learn_from`` on."""
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant" or i < learn_from:
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False,
                                               add_generation_prompt=True)
        through = tokenizer.apply_chat_template(messages[:i + 1], tokenize=False)
        if not (through.startswith(before) and text.startswith(through)):
            raise UsageError(f"{where}: the tokenizer's chat template renders the chat up to "
                             f"message {i} as other than a prefix of the whole chat, so its "
                             "assistant tokens cannot be told apart. Use a template that renders "
                             "turns one after another (ChatML, LLaMA 3, ...).")
        spans.append((len(before), len(through)))
    return spans


def require_chat_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError("The tokenizer has no chat template: give the model directory's "
                         "tokenizer_config.json a 'chat_template' (or pass one to the tokenizer).")


def render_prompt(tokenizer, prompt: list[dict] | str, max_len: int,
                  where: str = "a prompt") -> np.ndarray:
    """A prompt's token ids (int32): its messages (a string: one user message) rendered with
    the chat template and the generation prompt, so that what follows is the assistant's."""
    require_chat_template(tokenizer)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) > max_len:
        raise UsageError(f"{where} is {len(ids)} tokens once rendered, longer than "
                         f"--max_prompt_len {max_len}: raise --max_prompt_len or shorten it.")
    return np.asarray(ids, np.int32)


def render_chat(tokenizer, messages: list[dict], max_len: int, where: str = "a chat",
                learn_from: int = 0) -> dict:
    """``{"token_ids", "loss_mask"}`` (int32, bool; one per token) of a chat rendered with
    ``tokenizer``'s chat template: the mask marks the assistant's tokens (of the messages from
    ``learn_from`` on: a preference pair's response, not its prompt). ``where`` names the chat
    in errors."""
    require_chat_template(tokenizer)
    if not any(m.get("role") == "assistant" for m in messages[learn_from:]):
        raise UsageError(f"{where} has no assistant message: nothing to learn from it. Give "
                         "every chat at least one {'role': 'assistant', ...} message.")
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans = assistant_spans(tokenizer, messages, text, where, learn_from)
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
