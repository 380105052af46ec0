"""GRPO on prompts that hold images, for an image + text model the serving engine places
images for: LLaVA (``redco_zoo_models.llava``) and Gemma 3 (images at fixed sizes), Qwen2.5-VL,
Qwen3-VL and Qwen3.5 (``redco_zoo_models.qwen_vl``: each image at its own size, M-RoPE).

A prompt's messages may hold image parts as an SFT chat's do (``redco_zoo_sft.image_chat``:
HuggingFace's ``{"type": "image", "path"}``, OpenAI's ``{"type": "image_url"}``, local files
or ``data:`` URLs). Each is rendered with the model's processor: the image part becomes its
placeholder (Qwen's between its vision start and end tokens, ``qwen_vl_chat.placeholder``),
the processor expands it to the image's tokens, and its image processor gives the pixels.
Every prompt carries ``K`` image slots, the most images a prompt of the run holds
(``pixel_values`` (K, 3, H, W), blank after its ``n_images``): one shape, so nothing compiles
per image count. The pixels travel with the prompt into its samples, so the rollout (the
engine's prefill, or ``pred_fn``'s ``generate``) and the trainer's forward pass (``loss.py``:
``apply_fn(params, ids, attention_mask, pixel_values, image_mask=...)``, each row's images at
its prompt's image tokens) read the same images: the log-probabilities the trainer recomputes
are the sampler's. ``image_mask`` marks the prompt's image tokens only: an image token the
model samples in a completion was read as text by the sampler, and is by the trainer.

A Qwen-VL prompt (``fit_to_model``, once the model is loaded) carries instead its images'
patches padded to ``P``, the most a prompt of the run has (``pixel_values`` (P, features) and
the tower's ``layout_<key>`` arrays: ``qwen_vl.padded_patches``, as the SFT collate pads a
chat's, ``redco_zoo_sft.qwen_vl_chat``), its grids in ``K`` slots (``image_grid_thw`` (K, 3))
and its M-RoPE positions (``position_ids`` (3, width), left padding at 0) and delta
(``rope_delta``), made on the host by ``mrope.rope_index`` as the engine's prefill makes
them. The engine gets the real patches and grids (``engine_rollouts.engine_images``, its
``max_image_patches`` ``P``); the trainer places a completion's tokens where the engine's
decode steps did, their place in the row plus the delta (``loss.mrope_positions``).

Refused before anything compiles, naming why: a model whose images the engine does not place
(its ``unserved``), a text model, multi-turn environments and asynchronous rollouts
(their prompts are text), and, for ``--engine_rows 0`` (``generate`` places a batch's images
in order over its rows), prompts holding different numbers of images, and Qwen-VL (its
compiled sampler has no host to make a prompt's M-RoPE positions on).
"""
from __future__ import annotations

import numpy as np

from redco.protocols import UsageError
from redco_zoo_grpo.rollout import left_pad
from redco_zoo_models.image_collate import chat_text_and_images, read_image
from redco_zoo_models.mrope import rope_index
from redco_zoo_sft.chat import render
from redco_zoo_sft.qwen_vl_chat import placeholder


def hold_images(parts: tuple[list, list], column: str) -> bool:
    """Whether a prompt of ``parts`` holds an image part (a content part not text)."""
    return any(isinstance(m, dict) and isinstance(m.get("content"), list) and any(
        not (isinstance(p, dict) and p.get("type") == "text") for p in m["content"])
        for rows in parts for row in rows if isinstance(row[column], list) for m in row[column])


def keeps_sizes(processor) -> bool:
    """Whether ``processor``'s images keep their sizes (Qwen-VL's: patches and grids)."""
    return getattr(processor.image_processor, "merge_size", None) is not None


def render_image_prompt(processor, prompt: list[dict], max_len: int, where: str,
                        template_kwargs: dict | None = None) -> tuple[np.ndarray, list, dict]:
    """``(ids, images, encoded)`` of one prompt: its messages rendered with the generation
    prompt, each image part's placeholder expanded by the processor; the images read (PIL);
    the processor's output."""
    mark = placeholder(processor) if keeps_sizes(processor) else processor.image_token
    try:
        chat, sources = chat_text_and_images(prompt, mark, where)
        images = [read_image(s, where) for s in sources]
    except ValueError as e:
        raise UsageError(str(e)) from None
    text = render(processor.tokenizer, chat, where, True, template_kwargs)
    encoded = processor(text=[text], images=images or None, add_special_tokens=False,
                        return_tensors="np")
    ids = np.asarray(encoded["input_ids"][0], np.int32)
    if len(ids) > max_len:
        raise UsageError(f"{where} is {len(ids)} tokens with its {len(images)} images' tokens, "
                         f"longer than --max_prompt_len {max_len}: raise --max_prompt_len or "
                         "give fewer images or shorter text.")
    return ids, images, encoded


def prompt_examples(processor, parts: tuple[list, list], column: str, max_len: int,
                    template_kwargs: dict | None = None) -> tuple[tuple[list, list], ...]:
    """``(prompts, rows)`` of each part, as ``pipeline.prompt_examples``'s, each prompt with
    ``pixel_values`` (K, 3, H, W) and ``n_images``; a Qwen-VL prompt with its ``patches`` and
    ``grids`` as the processor gives them, for ``fit_to_model`` (module docstring)."""
    rendered = [[render_image_prompt(processor, row[column] if isinstance(row[column], list)
                                     else [{"role": "user", "content": row[column]}],
                                     max_len, f"{what} row {i}", template_kwargs)
                 for i, row in enumerate(rows)]
                for rows, what in zip(parts, ("--train", "--eval (or the last 5% of --train)"))]
    width = max(len(ids) for part in rendered for ids, _, _ in part)
    slots = max([1, *(len(images) for part in rendered for _, images, _ in part)])
    out = []
    for part, rows in zip(rendered, parts):
        prompts = left_pad([ids for ids, _, _ in part], width,
                           processor.tokenizer.pad_token_id or 0)
        for prompt, (_, images, encoded) in zip(prompts, part):
            if keeps_sizes(processor):
                prompt["patches"] = encoded.get("pixel_values", np.zeros((0, 1), np.float32))
                prompt["grids"] = encoded.get("image_grid_thw", np.zeros((0, 3), np.int64))
            else:
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
                         "serving engine places: GRPO on image prompts runs LLaVA, Gemma 3 and "
                         "Qwen-VL (Qwen2.5-VL, Qwen3-VL, Qwen3.5); "
                         "give such a model or text prompts.")
    if getattr(model, "dynamic_resolution", False) and not engine_rows:
        raise UsageError(f"--engine_rows 0: {type(model).__name__}'s M-RoPE positions are made "
                         "on the host from each prompt's ids and image grids, which pred_fn's "
                         "compiled sampler (generate) does not have: give --engine_rows (the "
                         "engine makes them at its prefill).")
    if unserved := model.unserved():
        raise UsageError(f"--model {where}: {unserved}")
    counts = {int(p["n_images"]) for p in prompts}
    if not engine_rows and len(counts) > 1:
        raise UsageError(f"--engine_rows 0: the prompts hold {sorted(counts)} images; the "
                         "fixed-batch sampler needs the same number in every prompt: give "
                         "--engine_rows (the engine places each prompt's own).")


def fit_to_model(model, parts: list[list[dict]]) -> None:
    """A Qwen-VL model's prompts (all ``parts``' prompts, in place; module docstring): each
    prompt's patches padded to the run's most with their layout, its grids in the run's most
    image slots, its M-RoPE positions and delta. Nothing for LLaVA's."""
    if not getattr(model, "dynamic_resolution", False):
        return
    from redco_zoo_models.qwen_vl import padded_patches
    cfg, prompts = model.cfg, [p for part in parts for p in part]
    merge = cfg.vision.spatial_merge_size
    patches = max([merge ** 2, *(len(p["patches"]) for p in prompts)])
    slots = max([1, *(len(p["grids"]) for p in prompts)])
    for p in prompts:
        real, grids = p.pop("patches"), np.asarray(p.pop("grids"), np.int64)
        p["pixel_values"], layout = padded_patches(real, grids, cfg, patches)
        p.update({f"layout_{key}": value for key, value in layout.items()})
        positions, deltas = rope_index(p["prompt_ids"][None], p["prompt_mask"][None], grids,
                                       cfg.image_token_id, merge)
        p["position_ids"], p["rope_delta"] = positions[:, 0], deltas[0]
        p["image_grid_thw"] = np.zeros((slots, 3), np.int64)
        p["image_grid_thw"][:len(grids)] = grids
