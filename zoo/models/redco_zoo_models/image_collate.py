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

import os
from typing import Any

import numpy as np

from redco.protocols import UsageError


def chat_text_and_images(messages: list[dict], placeholder: str,
                         where: str) -> tuple[list[dict], list]:
    """``messages`` with each list content made text, an image part as ``placeholder`` where
    it stands and the parts joined by newlines, and the images in order (paths or PIL images,
    ``image_of_part``); an image in an assistant message is refused (the model writes text)."""
    out, images = [], []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(part.get("text", ""))
                continue
            if message.get("role") == "assistant":
                raise ValueError(f"{where}: message {i} (the assistant's) holds an image; the "
                                 "model writes text only: move the image to a user message.")
            images.append(image_of_part(part, f"{where} message {i}"))
            parts.append(placeholder)
        out.append({**message, "content": "\n".join(parts)})
    return out, images


def image_of_part(part: dict, where: str) -> Any:
    """The image a chat message's content part names, as a path or a PIL image: HuggingFace's
    ``{"type": "image", "path" | "image" | "url": ...}`` or OpenAI's ``{"type": "image_url",
    "image_url": {"url": ...}}``; a ``file://`` URL is its path, a ``data:`` URL (base64) is
    decoded here; an http(s) URL is refused (nothing is downloaded)."""
    if not isinstance(part, dict) or part.get("type") not in ("image", "image_url"):
        raise ValueError(f"{where}: a content part {str(part)[:60]} is neither text nor an "
                         "image: give {'type': 'text', 'text': ...}, {'type': 'image', "
                         "'path': ...} or {'type': 'image_url', 'image_url': {'url': ...}}.")
    if part.get("type") == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
    else:
        url = next((part[k] for k in ("path", "image", "url") if part.get(k) is not None), None)
    if url is None or not isinstance(url, (str, os.PathLike)) and not hasattr(url, "convert"):
        raise ValueError(f"{where}: the image part {str(part)[:80]} names no image: give "
                         "{'type': 'image', 'path': ...} or {'type': 'image_url', 'image_url': "
                         "{'url': 'file://...' or 'data:image/png;base64,...'}}.")
    if not isinstance(url, str):
        return url
    if url.startswith("data:"):
        return _data_url_image(url, where)
    if url.startswith(("http://", "https://")):
        raise ValueError(f"{where}: image {url[:60]!r} is on the web; nothing is downloaded "
                         "here: save it and give its path, or send it as a data: URL.")
    return url.removeprefix("file://")


def _data_url_image(url: str, where: str):
    """A ``data:[type];base64,...`` URL's image, decoded (PIL)."""
    import base64
    import binascii
    import io
    head, _, body = url.partition(",")
    if not head.endswith(";base64"):
        raise ValueError(f"{where}: the data: URL is not base64 ({head[:40]!r}): send "
                         "'data:image/png;base64,<the PNG's bytes in base64>'.")
    try:
        data = base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"{where}: the data: URL's base64 does not decode ({e}): send "
                         "'data:image/png;base64,<the PNG's bytes in base64>'.") from None
    return read_image(io.BytesIO(data), where)


def read_image(source: Any, where: str):
    """``source`` (a path or a PIL image) as an RGB PIL image."""
    from PIL import Image
    if isinstance(source, Image.Image):
        return source.convert("RGB")
    try:
        with Image.open(source) as image:
            return image.convert("RGB")
    except (OSError, ValueError) as e:  # (PIL's UnidentifiedImageError is an OSError)
        name = "the data: URL's image" if hasattr(source, "read") else f"image {source!r}"
        raise ValueError(f"{where}: {name} cannot be read ({type(e).__name__}: {e}); "
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
        pictures = [read_image(p, where) for p in pictures]
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


def image_placeholder(processor) -> str:
    """What an image part becomes in a chat's text: the processor's image token, between the
    tokenizer's vision start and end tokens where it names them (Qwen-VL's
    ``<|vision_start|><|image_pad|><|vision_end|>``, as Qwen's chat template writes one)."""
    tokenizer = processor.tokenizer
    marks = [getattr(tokenizer, f"vision_{k}_token", None) for k in ("start", "end")]
    if None in marks:
        return processor.image_token
    return marks[0] + processor.image_token + marks[1]


def load_processor(path: str):
    """The transformers processor saved in the model directory ``path``, offline."""
    from transformers import AutoProcessor
    try:
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        processor = images_only_processor(path, e)
    except (AttributeError, ImportError):  # (one whose video processor this install cannot
        # make: Qwen's, Gemma 4's without torchvision)
        processor = images_only_processor(path, None)
    if processor is None:
        raise UsageError(f"{path}: no image processor there that transformers can read; "
                         "save the model's processor with processor.save_pretrained(dir).")
    if not hasattr(processor, "image_processor"):
        raise UsageError(f"{path}: its processor is a {type(processor).__name__} without an "
                         "image processor; save the model's own (LlavaProcessor, "
                         "Gemma3Processor) with processor.save_pretrained(dir).")
    if not getattr(processor.tokenizer, "chat_template", None):
        processor.tokenizer.chat_template = getattr(processor, "chat_template", None)
    return processor


def images_only_processor(path: str, error: Exception | None):
    """The processor ``processor_config.json`` names in ``path`` (Qwen2.5-VL's, Qwen3-VL's,
    Gemma 4's) made of its image processor and tokenizer alone, where transformers cannot make
    its video processor (it needs torchvision); None where there is no such file (``error``:
    why)."""
    import inspect
    import json
    import os

    import transformers
    from transformers import AutoImageProcessor, AutoTokenizer
    try:
        with open(os.path.join(path, "processor_config.json")) as f:
            kind = getattr(transformers, json.load(f).get("processor_class", ""), None)
    except (OSError, ValueError):
        kind = None
    if kind is None:
        return None

    class Unmade(transformers.ProcessorMixin):
        """Drops the parts not made (Gemma 4's audio and video: ``None``) on their way to
        ``ProcessorMixin``, which checks only the parts ``ImagesOnly`` names."""
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{k: v for k, v in kwargs.items()
                                       if v is not None or k == "chat_template"})

    class ImagesOnly(kind, Unmade):
        def __init__(self, image_processor, tokenizer, chat_template=None):
            unmade = {k: None for k in ("feature_extractor", "video_processor")
                      if k in inspect.signature(kind.__init__).parameters}
            super().__init__(image_processor=image_processor, tokenizer=tokenizer,
                             chat_template=chat_template, **unmade)
    try:
        return ImagesOnly(AutoImageProcessor.from_pretrained(path, local_files_only=True),
                          AutoTokenizer.from_pretrained(path, local_files_only=True))
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: its {kind.__name__} cannot be read ({error or e}); save "
                         "the model's processor with processor.save_pretrained(dir).") from e
