"""The SFT pipeline's Gemma 4 batches (``redco_zoo_sft.gemma4_chat``: each image's own patches
repadded to the run's largest, each row's images in its row, blank ones after) against
transformers' PyTorch ``Gemma4ForConditionalGeneration`` (test_parity_gemma4's tiny model, its
clipped linears and standardised soft tokens) run on each chat alone, at the processor's own
padding: the loss on the assistant's tokens is the same (1e-4). The chats' images differ in
aspect and count, so one row carries a blank image and its images are repadded: a padded patch
read at a real place, a row's image tokens not seeing each other both ways, or labels one token
off move the loss. The train step's shape is the run's, not the images': one compile."""
import types

import jax
import numpy as np
from parity import torch, transformers
from PIL import Image
from test_parity_gemma4 import BOI, EOI, IMAGE, gemma4_with_images
from test_parity_qwen_vl_sft import WORDS, chats

from redco_zoo_models.hf import auto_class, from_pretrained
from redco_zoo_models.nnx_utils import split_model
from redco_zoo_models.toy import chat_word_tokenizer
from redco_zoo_sft.image_chat import image_chat_rows, load_processor
from redco_zoo_sft.pipeline import image_collate

SPECIALS = {"boi_token": "<|image>", "eoi_token": "<image|>", "image_token": "<|image|>",
            "boa_token": "<|audio>", "eoa_token": "<audio|>", "audio_token": "<|audio|>"}
MAX_LEN = 200


def save_processor(path) -> None:
    """A word tokenizer whose image marks are the tiny model's ids (58, 59, 60 of its 64) and
    Gemma 4's image processor (patches of 4, 3 x 3 pooling, at most 70 soft tokens), saved as
    the model's directory holds them."""
    fillers = [f"w{i}" for i in range(BOI - 4 - len(WORDS))]  # (4 chat specials first)
    tokenizer = chat_word_tokenizer([*WORDS, *fillers, *SPECIALS.values()],
                                    extra_special_tokens=SPECIALS)
    assert tokenizer.convert_tokens_to_ids(list(SPECIALS.values())[:3]) == [BOI, EOI, IMAGE]
    tokenizer.save_pretrained(str(path))
    transformers.Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=70,
                                         pooling_kernel_size=3).save_pretrained(str(path))
    (path / "processor_config.json").write_text('{"processor_class": "Gemma4Processor"}')


def their_loss(theirs, image_processor, examples) -> float:
    """transformers' mean cross-entropy over the marked tokens, each chat run alone."""
    total, count = 0.0, 0
    for e in examples:
        ids = torch.tensor(e["token_ids"][None].astype(np.int64))
        images = image_processor(images=[Image.open(p) for p in e["images"]],
                                 return_tensors="pt")
        with torch.no_grad():
            logits = theirs(input_ids=ids, attention_mask=torch.ones_like(ids),
                            pixel_values=images["pixel_values"],
                            image_position_ids=images["image_position_ids"],
                            mm_token_type_ids=(ids == IMAGE).long()).logits[0, :-1]
        losses = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none").numpy()
        total, count = total + losses[e["loss_mask"][1:]].sum(), count + e["loss_mask"][1:].sum()
    return total / count


def test_sft_batch_loss_of_gemma4_with_images_equals_transformers(tmp_path):
    theirs = gemma4_with_images()
    theirs.save_pretrained(str(tmp_path))
    save_processor(tmp_path)
    ours = from_pretrained(auto_class(str(tmp_path), images=True), str(tmp_path))
    assert ours.untrained() is None
    processor = load_processor(str(tmp_path))
    examples = image_chat_rows(processor, chats(tmp_path), "messages", MAX_LEN, "chats")
    collate, loss_fn, tower = image_collate(ours, processor, examples, MAX_LEN)  # (the run's)
    assert tower == "vision_tower/" and collate.keywords["per_row"] == 2
    apply_fn, params = split_model(ours)
    state = types.SimpleNamespace(apply_fn=apply_fn)
    loss = jax.jit(lambda p, b: loss_fn(None, state, p, b, False))
    got = loss(params, collate(examples))
    np.testing.assert_allclose(float(got), their_loss(theirs, processor.image_processor,
                                                      examples), rtol=1e-4)
    runs = [np.diff(np.flatnonzero(np.isin(e["token_ids"], [BOI, EOI])))[::2] - 1
            for e in examples]  # (each image's soft tokens)
    assert [len(r) for r in runs] == [1, 2] and len({*np.concatenate(runs)}) > 1  # (aspects)
    assert collate.keywords["patches"] == 9 * max(np.concatenate(runs))
    batch = collate(examples[::-1])  # (the two-image row first: other images in each slot)
    assert (batch["image_position_ids"][1, 1] == -1).all()  # (row 1's blank image)
    np.testing.assert_allclose(float(loss(params, batch)), float(got), rtol=1e-5)
    assert loss._cache_size() == 1
