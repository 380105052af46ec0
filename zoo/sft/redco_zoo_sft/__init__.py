"""Supervised fine-tuning on chats through Redco's three functions (``pipeline.py``); chats
rendered with the tokenizer's own template, the loss on the assistant's tokens (``chat.py``)."""
from redco_zoo_sft.chat import pack_chats, render_chat
from redco_zoo_sft.pipeline import collate_fn, loss_fn

__all__ = ["collate_fn", "loss_fn", "pack_chats", "render_chat"]
