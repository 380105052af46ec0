"""Image captioning through the three functions, and ``redco zoo run captioning``. The model
is a VisionEncoderDecoder: a ViT encoder and a GPT-2 decoder that cross-attends to it."""
from __future__ import annotations

import dataclasses
from functools import partial

import jax.numpy as jnp
import numpy as np

from redco_zoo_captioning.plugin import DESCRIPTION
from redco_zoo_models import flags, generate, runner
from redco_zoo_models.metrics import text_scores, token_cross_entropy
from redco_zoo_models.settings import RunConfig


def pixels(image, size: int) -> np.ndarray:
    """An image (PIL or HxWx3 uint8) as (3, size, size) floats in [-1, 1]."""
    if not isinstance(image, np.ndarray):
        image = np.asarray(image.convert("RGB").resize((size, size)))
    return (image.astype(np.float32).transpose(2, 0, 1) / 255 - 0.5) / 0.5


def collate_fn(examples: list[dict], tokenizer, image_size: int, max_len: int, bos_id: int,
               eos_id: int, pad_id: int) -> dict:
    """``image`` and ``caption`` -> pixel values in [-1, 1], decoder inputs (BOS, caption) and
    labels (caption, EOS), right-padded with a mask."""
    captions = [tokenizer.encode(e["caption"], add_special_tokens=False).ids for e in examples]
    labels, label_mask = runner.pad_ids([c + [eos_id] for c in captions], max_len, pad_id)
    decoder_input_ids, _ = runner.pad_ids([[bos_id] + c for c in captions], max_len, pad_id)
    return {"pixel_values": np.stack([pixels(e["image"], image_size) for e in examples]),
            "decoder_input_ids": decoder_input_ids, "labels": labels, "label_mask": label_mask}


def loss_fn(rng, state, params, batch, is_training):
    """Cross-entropy of the caption tokens (padding excluded)."""
    logits = state.apply_fn(params, batch["pixel_values"], batch["decoder_input_ids"])
    return token_cross_entropy(logits, batch["labels"], batch["label_mask"])


def pred_fn(rng, params, batch, model, max_new_tokens: int, num_beams: int, bos_id: int,
            eos_id: int, pad_id: int):
    """Beam-search caption ids (B, max_new_tokens) for each image."""
    start = jnp.full((batch["pixel_values"].shape[0], 1), bos_id, jnp.int32)
    return generate(model, params, start, max_new_tokens, num_beams=num_beams,
                    eos_token_id=eos_id, pad_token_id=pad_id,
                    encoder_inputs={"pixel_values": batch["pixel_values"]})


def metric_fn(examples: list[dict], preds: list[str]) -> dict:
    """ROUGE-1/2/L and exact match of the predicted captions."""
    return text_scores(preds, [e["caption"] for e in examples])


@dataclasses.dataclass(frozen=True)
class Captions:
    """A captioning run's own settings (``RunConfig.task``): each image's caption is its
    ``caption_column``, at most ``max_len`` tokens, decoded with ``num_beams`` beams."""
    caption_column: str = "caption"
    max_len: int = 32
    num_beams: int = 4


class CaptioningPipeline:
    description = DESCRIPTION

    def add_arguments(self, parser) -> None:
        flags.add_arguments(parser)
        flags.add_training_levers(parser)
        parser.add_argument("--caption_column", default=Captions.caption_column)
        parser.add_argument("--max_len", type=int, default=Captions.max_len, help="caption tokens")
        parser.add_argument("--num_beams", type=int, default=Captions.num_beams)

    def run(self, args):
        return train_captioning(RunConfig.of_flags(args, Captions))


def train_captioning(config: RunConfig[Captions]):
    """The whole captioning run of ``config``; returns the trainer."""
    captions, source = config.task, config.source
    tokenizer = runner.load_tokenizer(source.model)
    model, hf = runner.load_source(source, config.jax_seed)
    ids = dict(bos_id=hf["decoder"]["bos_token_id"], eos_id=hf["decoder"]["eos_token_id"],
               pad_id=hf.get("pad_token_id") or hf["decoder"]["eos_token_id"])
    column = captions.caption_column
    train, evaluate = ([{"image": r["image"], "caption": r[column]} for r in part]
                       for part in runner.split_eval(config.data, {"--caption_column": column}))
    return runner.train_and_eval(
        config, model, (train, evaluate),
        partial(collate_fn, tokenizer=tokenizer, image_size=hf["encoder"]["image_size"],
                max_len=captions.max_len, **ids), loss_fn,
        pred_fn=partial(pred_fn, model=model, max_new_tokens=captions.max_len,
                        num_beams=captions.num_beams, **ids),
        output_fn=partial(runner.detokenize, tokenizer=tokenizer, eos_id=ids["eos_id"]),
        metric_fn=metric_fn, best_metric="rougeL")
