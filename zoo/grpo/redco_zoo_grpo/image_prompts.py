"""GRPO on prompts that hold images, for an image + text model whose images the serving engine
places at fixed sizes (LLaVA: ``redco_zoo_models.llava``; Gemma 3, not tested end to end).

A prompt's messages may hold image parts as an SFT chat's do (``redco_zoo_sft.image_chat``:
HuggingFace's ``{"type": "image", "path"}``, OpenAI's ``{"type": "image_url"}``, local files
or ``data:`` URLs). Each is rendered with the model's processor: the image part becomes its
placeholder, the processor expands it to the image's tokens, and its image processor gives the
pixels. Every prompt carries ``K`` image slots, the most images a prompt of the run holds
(``pixel_values`` (K, 3, H, W), blank after its ``n_images``): one shape, so nothing compiles
per image count. The pixels travel with the prompt into its samples, so the rollout (the
engine's prefill, or ``pred_fn``'s ``generate``) and the trainer's forward pass (``loss.py``:
``apply_fn(params, ids, attention_mask, pixel_values, image_mask=...)``, each row's images at
its prompt's image tokens) read the same images: the log-probabilities the trainer recomputes
are the sampler's. ``image_mask`` marks the prompt's image tokens only: an image token the
model samples in a completion was read as text by the sampler, and is by the trainer.

Refused before anything compiles, naming why: Qwen2.5-VL, Qwen3-VL and Qwen3.5 (the engine
serves them, but the rollout's and the trainer's M-RoPE positions from each prompt's grids are
not built here yet), a model whose images the engine does not place (its ``unserved``), a
text model, multi-turn environments and asynchronous rollouts
(their prompts are text), and, for ``--engine_rows 0`` (``generate`` places a batch's images
in order over its rows), prompts holding different numbers of images.
"""
from __future__ import annotations

import numpy as np

from redco.protocols import UsageError
from redco_zoo_grpo.rollout import left_pad
from redco_zoo_models.image_collate import chat_text_and_images, read_image
from redco_zoo_sft.chat import render


def hold_images(parts: tuple[list, list], column: str) -> bool:
    """Whether a prompt of ``parts`` holds an image part (a content part not text)."""
    return any(isinstance(m, dict) and isinstance(m.get("content"), list) and any(
        not (isinstance(p, dict) and p.get("type") == "text") for p in m["content"])
        for rows in parts for row in rows if isinstance(row[column], list) for m in row[column])


def render_image_prompt(processor, prompt: list[dict], max_len: int, where: str,
                        template_kwargs: dict | None = None) -> tuple[np.ndarray, list]:
    """``(ids, images)`` of one prompt: its messages rendered with the generation prompt, each
    image part's placeholder expanded by the processor; the images read (PIL)."""
    try:
        chat, sources = chat_text_and_images(prompt, processor.image_token, where)
        images = [read_image(s, where) for s in sources]
    except ValueError as e:
        raise UsageError(str(e)) from None
    text = render(processor.tokenizer, chat, where, True, template_kwargs)
    ids = np.asarray(processor(text=[text], images=images or None, add_special_tokens=False,
                               return_tensors="np")["input_ids"][0], np.int32)
    if len(ids) > max_len:
        raise UsageError(f"{where} is {len(ids)} tokens with its {len(images)} images' tokens, "
                         f"longer than --max_prompt_len {max_len}: raise --max_prompt_len or "
                         "give fewer images or shorter text.")
    return ids, images


def prompt_examples(processor, parts: tuple[list, list], column: str, max_len: int,
                    template_kwargs: dict | None = None) -> tuple[tuple[list, list], ...]:
    """``(prompts, rows)`` of each part, as ``pipeline.prompt_examples``'s, each prompt with
    ``pixel_values`` (K, 3, H, W) and ``n_images`` (module docstring)."""
    rendered = [[render_image_prompt(processor, row[column] if isinstance(row[column], list)
                                     else [{"role": "user", "content": row[column]}],
                                     max_len, f"{what} row {i}", template_kwargs)
                 for i, row in enumerate(rows)]
                for rows, what in zip(parts, ("--train", "--eval (or the last 5% of --train)"))]
    width = max(len(ids) for part in rendered for ids, _ in part)
    slots = max([1, *(len(images) for part in rendered for _, images in part)])
    out = []
    for part, rows in zip(rendered, parts):
        prompts = left_pad([ids for ids, _ in part], width, processor.tokenizer.pad_token_id or 0)
        for prompt, (_, images) in zip(prompts, part):
            prompt["pixel_values"] = pixel_slots(processor.image_processor, images, slots)
            prompt["n_images"] = np.int32(len(images))
            prompt["image_mask"] = prompt["prompt_ids"] == processor.tokenizer.image_token_id
        out.append((prompts, rows))
    return tuple(out)


def pixel_slots(image_processor, images: list, slots: int) -> np.ndarray:
    """(slots, 3, H, W): ``images`` through the image processor, blank slots after."""
    from PIL import Image
    pixels = np.asarray(image_processor(images=images or [Image.new("RGB", (8, 8))],
                                        return_tensors="np")["pixel_values"], np.float32)
    out = np.zeros((slots, *pixels.shape[1:]), np.float32)
    out[:len(images)] = pixels[:len(images)]
    return out


def check_run(run) -> None:
    """Refuse what image prompts cannot run with (module docstring), before anything loads."""
    if run.environment:
        raise UsageError(f"--environment {run.environment}: a multi-turn episode's prompts are "
                         "text; image prompts run single-turn (drop --environment).")
    if run.asynchronous.rollout_devices:
        raise UsageError("--rollout_devices: asynchronous rollouts sample text prompts only; "
                         "image prompts roll out on the training devices (drop the flag).")


def check_model(model, where: str, prompts: list[dict], engine_rows: int) -> None:
    """Refuse a model that cannot roll out image prompts, and ``pred_fn``'s rollouts of
    prompts with different image counts (module docstring)."""
    if not hasattr(model, "encode_rows"):
        raise UsageError(f"--model {where} ({type(model).__name__}) does not read images the "
                         "serving engine places: GRPO on image prompts runs LLaVA (and Gemma 3); "
                         "give such a model or text prompts.")
    if getattr(model, "dynamic_resolution", False):
        raise UsageError(f"--model {where} ({type(model).__name__}): its M-RoPE positions come "
                         "from each prompt's image grids, which GRPO's rollouts and training "
                         "step do not build yet (redco serve does); give a LLaVA model or "
                         "text prompts.")
    if unserved := model.unserved():
        raise UsageError(f"--model {where}: {unserved}")
    counts = {int(p["n_images"]) for p in prompts}
    if not engine_rows and len(counts) > 1:
        raise UsageError(f"--engine_rows 0: the prompts hold {sorted(counts)} images; the "
                         "fixed-batch sampler needs the same number in every prompt: give "
                         "--engine_rows (the engine places each prompt's own).")
