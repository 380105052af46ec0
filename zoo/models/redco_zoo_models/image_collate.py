"""Image + text examples into a batch's arrays, on the host, by the model's own transformers
processor (``LlavaProcessor``, ``Gemma3Processor``: a kept library, the zoo does not
re-implement its resizing or its prompt expansion).

Each example is ``{"text": str, "images": [path or PIL image, ...]}``, the text holding one
image placeholder per image (the processor's ``image_token``: LLaVA's ``<image>``, Gemma 3's
``<start_of_image>``), which the processor expands into the tokenizer's ``image_token`` once
per feature (Gemma 3's then closed by ``<end_of_image>``). What the model could not
read is refused here, naming the example and the fix, before anything compiles: an image file
PIL cannot open, images and placeholders of different counts, and image tokens that would pass
``max_len`` (text past it is cut, image tokens never are). Rows are padded to ``max_len`` on
the tokenizer's padding side; the arrays are ``input_ids``, ``attention_mask``,
``pixel_values`` (images, 3, H, W) and the processor's extras (Gemma 3's ``token_type_ids``).
"""
from __future__ import annotations

from typing import Any

import numpy as np


def _image(source: Any, where: str):
    """``source`` (a path or a PIL image) as an RGB PIL image."""
    from PIL import Image
    if isinstance(source, Image.Image):
        return source.convert("RGB")
    try:
        with Image.open(source) as image:
            return image.convert("RGB")
    except (OSError, ValueError) as e:  # (PIL's UnidentifiedImageError is an OSError)
        raise ValueError(f"{where}: image {source!r} cannot be read ({type(e).__name__}: {e}); "
                         "give a PNG or JPEG file or a PIL image.") from None


def _last_image_position(processor, text: str, images: list) -> int:
    """Where the example's last image token (or end-of-image token) falls in its unpadded,
    uncut ids (-1: none)."""
    tokenizer = processor.tokenizer
    marks = [i for i in (tokenizer.image_token_id, getattr(tokenizer, "eoi_token_id", None))
             if i is not None]
    ids = np.asarray(processor(images=images or None, text=[text], return_tensors="np")
                     ["input_ids"])[0]
    at = np.flatnonzero(np.isin(ids, marks))
    return int(at[-1]) if len(at) else -1


def collate_images(processor, examples: list[dict], max_len: int) -> dict[str, np.ndarray]:
    """The batch's arrays for ``examples`` (module docstring), rows of ``max_len`` tokens."""
    mark, texts, images = processor.image_token, [], []
    for i, example in enumerate(examples):
        where, pictures = f"example {i}", list(example.get("images", ()))
        n_marks = example["text"].count(mark)
        if n_marks != len(pictures):
            raise ValueError(f"{where} has {len(pictures)} images and {n_marks} {mark!r} "
                             "placeholders in its text: write one placeholder where each "
                             "image goes.")
        pictures = [_image(p, where) for p in pictures]
        last = _last_image_position(processor, example["text"], pictures)
        if last >= max_len:
            raise ValueError(f"{where}'s image tokens reach position {last}, past max_len "
                             f"{max_len}: raise max_len to at least {last + 1}, shorten the "
                             "text before the image, or give fewer images.")
        texts.append(example["text"])
        images.append(pictures)
    flat = [p for pictures in images for p in pictures]
    out = processor(images=(images if flat else None), text=texts, padding="max_length",
                    truncation=True, max_length=max_len, return_tensors="np")
    return {k: np.asarray(v) for k, v in out.items()}
