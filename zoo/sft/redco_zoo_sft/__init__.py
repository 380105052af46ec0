"""Supervised fine-tuning on chats through Redco's three functions (``pipeline.py``); chats
rendered with the tokenizer's own template, the loss on the assistant's tokens (``chat.py``)."""
from redco.plugins import deferred_exports

# Imported on first use: redco loads this package's plugin module without its pipeline.
__all__, __getattr__ = deferred_exports(__name__, {
    "chat": ["pack_chats", "render_chat"],
    "pipeline": ["collate_fn", "loss_fn"],
})
