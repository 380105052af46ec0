"""LLaVA (CLIP tower + projector + a zoo decoder) against transformers' PyTorch
``LlavaForConditionalGeneration``: inputs made by a real ``LlavaProcessor`` (CLIP's image
processor on PIL images drawn here, a word-level tokenizer built here) give the same float32
logits on image + text, the same greedy tokens, and an exported checkpoint transformers loads
back; a prompt whose image tokens do not match the images is refused, text alone still runs."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from parity import (
    check_beams,
    close,
    hf_beams,
    hf_greedy,
    jiggle_ours,
    jiggle_torch,
    load_hf,
    saved,
    scanned_tower,
    torch,
    torch_logits,
    transformers,
    word_tokenizer,
    zoo_beams,
)
from PIL import Image

from redco_zoo_models.engine import Engine
from redco_zoo_models.generation import generate
from redco_zoo_models.hf import auto_class, from_pretrained, save_pretrained
from redco_zoo_models.llava import LlavaConfig, LlavaForConditionalGeneration

WORDS = ["<unk>", "<s>", "USER:", "ASSISTANT:", "what", "is", "in", "this", "picture", "?"]
IMAGE, PAD, EOS = 60, 62, 63
VISION = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=48,
              num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8)
TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, eos_token_id=EOS, pad_token_id=PAD)
DEFAULTS = dict(text_config={**TEXT, "model_type": "llama"})  # layer -2, no CLS, GELU, biases
VARIANT = dict(text_config={**TEXT, "model_type": "qwen2", "tie_word_embeddings": True},
               vision_config={**VISION, "hidden_act": "gelu"}, vision_feature_layer=[-1, 0],
               vision_feature_select_strategy="full", projector_hidden_act="gelu_pytorch_tanh",
               multimodal_projector_bias=False)
PROMPTS = ["USER: <image> what is in this picture ? ASSISTANT:", "<image> picture ?"]


def llava_config(**changes):
    kwargs = {"vision_config": VISION, "image_token_index": IMAGE, **changes}
    return transformers.LlavaConfig(**kwargs)


def processor(strategy: str = "default"):
    """A real LlavaProcessor: CLIP's image processor (resize, crop to 32, normalise) and a
    word-level tokenizer whose ``<image>`` is id ``IMAGE``."""
    vocab = {**{w: i for i, w in enumerate(WORDS)}, "<image>": IMAGE, "<pad>": PAD, "</s>": EOS}
    tokenizer = word_tokenizer(vocab, pad_token="<pad>", eos_token="</s>",
                               extra_special_tokens={"image_token": "<image>"})
    images = transformers.CLIPImageProcessorPil(size={"shortest_edge": 32},
                                                crop_size={"height": 32, "width": 32})
    return transformers.LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=8,
                                       vision_feature_select_strategy=strategy,
                                       num_additional_image_tokens=1)


def inputs(strategy: str = "default") -> dict:
    """The processor's arrays for two prompts (left-padded) with one PIL image each."""
    rng = np.random.RandomState(0)
    images = [Image.fromarray((rng.rand(40, 48, 3) * 255).astype(np.uint8)) for _ in PROMPTS]
    out = processor(strategy)(images=images, text=PROMPTS, padding=True, return_tensors="np")
    return {k: np.asarray(v) for k, v in out.items()}


def ours_call(model, batch, **changes):
    args = {k: jnp.asarray(v) for k, v in {**batch, **changes}.items()}
    return np.asarray(model(args.pop("input_ids"), **args))


@pytest.mark.parametrize("changes", [DEFAULTS, VARIANT], ids=["defaults", "variant"])
def test_llava_logits_match_transformers(tmp_path, changes):
    """fp32 logits within 1e-4 (``close``) on the processor's image + text inputs, padding
    left out; the variant: another feature layer list with the CLS token kept, exact GELU in
    the tower, tanh GELU in a bias-free projector, a tied Qwen2 decoder. With ``scan_layers``
    (the tower's layers stacked and scanned) the same features, its export the unrolled one's."""
    theirs = jiggle_torch(transformers.LlavaForConditionalGeneration(llava_config(**changes)))
    path = saved(theirs, tmp_path)
    ours = from_pretrained(auto_class(path), path)
    batch = inputs(changes.get("vision_feature_select_strategy", "default"))
    assert (batch["input_ids"] == IMAGE).sum() == 2 * ours.cfg.features_per_image()
    valid = batch["attention_mask"] > 0
    close(ours_call(ours, batch)[valid], torch_logits(theirs, **batch)[valid])
    # the projected image features alone, to 1e-5 of their scale (~30): the two GELUs differ by
    # up to ~5e-4, which the logits' tolerance could hide (seen: 1.7e-5 right, 1.0e-3 swapped)
    with torch.no_grad():
        want = theirs.get_image_features(torch.tensor(batch["pixel_values"])).pooler_output
    want = torch.stack(list(want)).numpy()
    got = np.asarray(ours.encode(jnp.asarray(batch["pixel_values"])))
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    scanned = scanned_tower(path, "vision_tower/encoder/layers/", tmp_path)  # (CLIP's 2 layers
    got = np.asarray(scanned.encode(jnp.asarray(batch["pixel_values"])))  # one stack: the
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()  # feature layers its ys)


def test_llava_export_loads_back_in_transformers(tmp_path):
    cfg = LlavaConfig.from_hf(json.loads(llava_config(**VARIANT).to_json_string()))
    ours = jiggle_ours(LlavaForConditionalGeneration(cfg, nnx.Rngs(0)))
    save_pretrained(ours, str(tmp_path))
    back = load_hf(transformers.LlavaForConditionalGeneration, tmp_path)
    assert back.config.vision_feature_layer == [-1, 0] and back.config.image_token_index == IMAGE
    with pytest.raises(ValueError, match=r"vision_feature_layer \(-1, 3\) is outside the "
                                         "tower's 3 hidden states"):
        LlavaConfig.from_hf({**json.loads(back.config.to_json_string()),
                             "vision_feature_layer": [-1, 3]})
    batch = inputs("full")
    valid = batch["attention_mask"] > 0
    close(ours_call(ours, batch)[valid], torch_logits(back, **batch)[valid])


def test_llava_greedy_generation_matches_transformers(tmp_path):
    """The prefill places the images, the decode steps continue in text: transformers' greedy
    tokens for two left-padded prompts."""
    theirs = jiggle_torch(transformers.LlavaForConditionalGeneration(llava_config(**DEFAULTS)))
    ours = from_pretrained(LlavaForConditionalGeneration, saved(theirs, tmp_path))
    batch = inputs()
    ids, mask, pixels = batch["input_ids"], batch["attention_mask"], batch["pixel_values"]
    got = generate(ours, nnx.state(ours, nnx.Param), jnp.asarray(ids), 8,
                   prompt_mask=jnp.asarray(mask),
                   encoder_inputs={"pixel_values": jnp.asarray(pixels)},
                   eos_token_id=EOS, pad_token_id=PAD)
    want = hf_greedy(theirs, ids, ids.shape[1], 8, EOS, PAD, attention_mask=mask,
                     pixel_values=pixels)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_llava_refuses_image_tokens_that_miss_the_images_and_reads_text_alone(tmp_path):
    theirs = jiggle_torch(transformers.LlavaForConditionalGeneration(llava_config(**DEFAULTS)))
    ours = from_pretrained(LlavaForConditionalGeneration, saved(theirs, tmp_path))
    batch = inputs()
    two_images = np.concatenate([batch["pixel_values"]] * 2)  # 4 images, 2 prompts' tokens
    with pytest.raises(ValueError, match=r"32 image tokens \(id 60\) but pixel_values give "
                                         r"4 images x 16 features = 64"):
        ours_call(ours, batch, pixel_values=two_images)
    text = {"input_ids": np.array([[1, 4, 5, 6, 7, 8, 9]])}
    with pytest.raises(ValueError, match="give 0 images"):  # image tokens without images
        ours_call(ours, {"input_ids": batch["input_ids"]})
    close(ours_call(ours, text), torch_logits(theirs, **text))
    with pytest.raises(ValueError, match="a prompt is read whole .* drop --prefill_chunk"):
        Engine(ours, nnx.state(ours, nnx.Param), max_len=64, prefill_chunk=16)
    with pytest.raises(ValueError, match=r"\(images, channels, 32, 32\)"):
        ours_call(ours, batch, pixel_values=batch["pixel_values"][:, :, :24, :24])


def test_llava_trained_at_dp4_mp2_exports_what_transformers_reads(tmp_path):
    """Fine-tuned through redco's Trainer on 8 devices (data parallel 4 x model parallel 2, the
    tower's and projector's matrices split by the default rules), the model transformers loads
    from the export gives the trained model's logits."""
    import optax

    from redco import Deployer, Trainer
    from redco.sharding import named_leaves
    from redco_zoo_models import split_model
    theirs = jiggle_torch(transformers.LlavaForConditionalGeneration(llava_config(**DEFAULTS)))
    model = from_pretrained(LlavaForConditionalGeneration, saved(theirs, tmp_path / "hf"))
    apply_fn, params = split_model(model)
    batch = inputs()
    examples = [{k: v[i % 2] for k, v in batch.items()} for i in range(16)]

    def loss_fn(rng, state, params, b, is_training):
        return state.apply_fn(params, b["input_ids"], b["attention_mask"], b["pixel_values"],
                              labels=b["input_ids"], label_mask=b["attention_mask"])
    trainer = Trainer(Deployer(jax_seed=0, workdir=str(tmp_path / "run"), verbose=False,
                               n_model_shards=2),
                      lambda exs: {k: np.stack([e[k] for e in exs]) for k in exs[0]}, apply_fn,
                      loss_fn, params, optax.adamw(1e-2))
    before = trainer.eval_loss(examples, 2)
    trainer.fit(examples, 2, n_epochs=4)
    assert trainer.eval_loss(examples, 2) < before / 4  # it learned the two rows (seen: /40)
    specs = {p: x.sharding.spec for p, x in named_leaves(trainer.params)}
    fc1 = next(p for p in specs if p.startswith("vision_tower/encoder/layers/0")
               and p.endswith("mlp/fc1/kernel"))  # (the tower stacked by default: layers/0:2)
    assert "mp" in specs[fc1]
    assert "mp" in specs["multi_modal_projector/linear_1/kernel"]
    nnx.update(model, jax.device_get(trainer.params))
    save_pretrained(model, str(tmp_path / "ours"))
    back = load_hf(transformers.LlavaForConditionalGeneration, tmp_path / "ours")
    valid = batch["attention_mask"] > 0
    close(ours_call(model, batch)[valid], torch_logits(back, **batch)[valid])


@pytest.mark.parametrize("layout", ["hub", "in_memory"])
def test_llava_reads_the_hub_and_in_memory_tensor_names(tmp_path, layout):
    """llava-hf's checkpoints name the tower ``vision_tower.vision_model.*``; transformers 5's
    modules are ``model.language_model.*``, ``model.vision_tower.*``, ``lm_head``: the same
    tensors renamed so load with transformers' logits."""
    from safetensors.numpy import load_file, save_file
    theirs = jiggle_torch(transformers.LlavaForConditionalGeneration(llava_config(**DEFAULTS)))
    path = saved(theirs, tmp_path)
    renames = {"hub": [("vision_tower.", "vision_tower.vision_model.")],
               "in_memory": [("language_model.model.", "model.language_model."),
                             ("language_model.lm_head.", "lm_head."),
                             ("vision_tower.", "model.vision_tower."),
                             ("multi_modal_projector.", "model.multi_modal_projector.")]}[layout]

    def renamed(name):
        old, new = next(((o, n) for o, n in renames if name.startswith(o)), ("", ""))
        return new + name[len(old):]
    tensors = load_file(f"{path}/model.safetensors")
    save_file({renamed(k): v for k, v in tensors.items()}, f"{path}/model.safetensors")
    ours = from_pretrained(LlavaForConditionalGeneration, path)
    batch = inputs()
    valid = batch["attention_mask"] > 0
    close(ours_call(ours, batch)[valid], torch_logits(theirs, **batch)[valid])


def test_llava_beam_search_matches_transformers(tmp_path):
    """Beam search (3 beams) with the images copied to each beam: transformers' tokens, with the
    config's EOS and with EOS ids that end rows early (``check_beams``)."""
    theirs = jiggle_torch(transformers.LlavaForConditionalGeneration(llava_config(**DEFAULTS)))
    ours = from_pretrained(LlavaForConditionalGeneration, saved(theirs, tmp_path))
    batch = inputs()
    ids, mask, pixels = batch["input_ids"], batch["attention_mask"], batch["pixel_values"]
    check_beams(zoo_beams(ours, ids, 8, 3, PAD, prompt_mask=jnp.asarray(mask),
                          encoder_inputs={"pixel_values": jnp.asarray(pixels)}),
                lambda eos: hf_beams(theirs, ids, ids.shape[1], 8, 3, eos, PAD,
                                     attention_mask=mask, pixel_values=pixels), EOS)
