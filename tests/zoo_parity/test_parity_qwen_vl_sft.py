"""The SFT pipeline's Qwen2.5-VL and Qwen3-VL batches (``redco_zoo_sft.qwen_vl_chat``: each
row's patches padded to the run's most, M-RoPE positions made on the host at collate time)
against transformers' PyTorch ``Qwen2_5_VLForConditionalGeneration`` and
``Qwen3VLForConditionalGeneration`` run on each chat alone, unpadded, with their own
``get_rope_index``: the loss on the assistant's tokens is the same (1e-4). The chats' images
differ in size, so one row's patches are padded: a padded patch a real one attends to, or a
position made from the text alone, moves the loss."""
import json
import types

import jax
import numpy as np
import pytest
from parity import jiggle_torch, load_hf, torch, transformers
from PIL import Image

from redco_zoo_models.hf import auto_class, from_pretrained
from redco_zoo_models.nnx_utils import split_model
from redco_zoo_models.toy_vision import save_tiny_qwen_vl
from redco_zoo_sft.image_chat import image_chat_rows, load_processor
from redco_zoo_sft.qwen_vl_chat import (
    collate_qwen_chats,
    patches_per_row,
    placeholder,
    qwen_loss_fn,
)

WORDS = ["system", "user", "assistant", "what", "is", "this", "?", "red", "blue", "circle",
         "square", "and"]
SIZES = [[(24, 40)], [(32, 16), (16, 16)]]  # (height, width) of each chat's images


def chats(folder) -> list[dict]:
    """Two chats: one image (5 x 3 merge blocks), then two smaller ones and a two-turn reply."""
    rng, rows = np.random.RandomState(0), []
    for i, sizes in enumerate(SIZES):
        parts = []
        for j, (h, w) in enumerate(sizes):
            path = str(folder / f"{i}{j}.png")
            Image.fromarray((rng.rand(h, w, 3) * 255).astype(np.uint8)).save(path)
            parts.append({"type": "image", "path": path})
        messages = [{"role": "user", "content": [*parts, {"type": "text",
                                                           "text": "what is this ?"}]},
                    {"role": "assistant", "content": "red circle"}]
        if i:
            messages += [{"role": "user", "content": "and this ?"},
                         {"role": "assistant", "content": "blue square and red circle"}]
        rows.append({"messages": messages})
    return rows


def their_loss(theirs, processor, examples) -> float:
    """transformers' mean cross-entropy over the marked tokens, each chat run alone."""
    total, count = 0.0, 0
    for e in examples:
        ids = e["token_ids"][None].astype(np.int64)
        images = processor.image_processor(images=[Image.open(p) for p in e["images"]],
                                           return_tensors="np")
        with torch.no_grad():
            logits = theirs(input_ids=torch.tensor(ids),
                            attention_mask=torch.ones(ids.shape, dtype=torch.long),
                            pixel_values=torch.tensor(np.asarray(images["pixel_values"])),
                            image_grid_thw=torch.tensor(np.asarray(images["image_grid_thw"])),
                            mm_token_type_ids=torch.tensor(
                                (ids == theirs.config.image_token_id).astype(np.int64)),
                            ).logits[0, :-1]
        losses = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[0, 1:]),
                                                   reduction="none").numpy()
        total, count = total + losses[e["loss_mask"][1:]].sum(), count + e["loss_mask"][1:].sum()
    return total / count


def qwen3_vl_like(path: str):
    """transformers' tiny Qwen3-VL with the tokens and widths of the Qwen2.5-VL saved in
    ``path`` (learned positions, DeepStack after block 0, interleaved M-RoPE)."""
    with open(f"{path}/config.json") as f:
        config = json.load(f)
    text = {k: config["text_config"][k] for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "eos_token_id", "pad_token_id")}
    return transformers.Qwen3VLForConditionalGeneration(transformers.Qwen3VLConfig(
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=4,
                           patch_size=4, spatial_merge_size=2, temporal_patch_size=2,
                           out_hidden_size=64, num_position_embeddings=16,
                           deepstack_visual_indexes=[0]),
        text_config=dict(text, head_dim=16, rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
            "mrope_interleaved": True}),
        **{k: config[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id",
                                  "vision_end_token_id")}))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_sft_batch_loss_of_qwen_vl_equals_transformers(tmp_path, family):
    path = save_tiny_qwen_vl(str(tmp_path / "qwen"), WORDS)
    theirs = jiggle_torch(qwen3_vl_like(path) if family == "qwen3_vl" else
                          load_hf(transformers.Qwen2_5_VLForConditionalGeneration, path))
    theirs.save_pretrained(path)  # (the jiggled weights; the processor's files stay)
    ours = from_pretrained(auto_class(path), path)
    processor = load_processor(path)
    examples = image_chat_rows(processor, chats(tmp_path), "messages", 64, "chats",
                               placeholder(processor))
    patches = patches_per_row(examples, 2, ours.cfg.image_token_id)
    batch = collate_qwen_chats(examples, processor.image_processor, ours.cfg, 64, patches, 0)
    apply_fn, params = split_model(ours)
    state = types.SimpleNamespace(apply_fn=apply_fn)
    got = jax.jit(lambda p, b: qwen_loss_fn(None, state, p, b, False))(params, batch)
    want = their_loss(theirs, processor, examples)
    np.testing.assert_allclose(float(got), want, rtol=1e-4)
    assert patches == 60 and [len(e["images"]) for e in examples] == [1, 2]
    assert (batch["layout_frame"][1] == -1).sum() == 60 - 32 - 16  # (row 1 is padded)
