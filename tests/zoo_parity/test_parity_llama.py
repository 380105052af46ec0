"""The zoo's LLaMA against transformers' PyTorch LLaMA (grouped-query attention, untied and
tied heads), Mistral and Qwen2 (biases on q, k, v): checkpoints both ways give the same logits,
left-padded batches included, and greedy and beam search the same tokens."""
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
    left_padded,
    load_hf,
    saved,
    torch_logits,
    transformers,
    zoo_beams,
)

from redco_zoo_models import LlamaConfig, LlamaForCausalLM, from_pretrained, generate, save_pretrained

VOCAB, EOS, PAD = 64, 63, 0
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             eos_token_id=EOS, pad_token_id=PAD)
KINDS = {"llama": ("LlamaForCausalLM", "LlamaConfig", {}),
         "llama-tied": ("LlamaForCausalLM", "LlamaConfig", {"tie_word_embeddings": True}),
         "mistral": ("MistralForCausalLM", "MistralConfig", {"sliding_window": None}),
         "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {"use_sliding_window": False})}
IDS = np.random.RandomState(0).randint(1, EOS, (3, 9))
MASK = np.array([[0, 0, 0, 1, 1, 1, 1, 1, 1], [1] * 9, [0] + [1] * 8])


def hf_model(kind):
    model_class, config_class, extra = KINDS[kind]
    config = getattr(transformers, config_class)(**SHAPE, **extra)
    return jiggle_torch(getattr(transformers, model_class)(config))


def positions(mask):  # as transformers' generate makes them for left padding
    return np.maximum(np.cumsum(mask, -1) - 1, 0)


@pytest.mark.parametrize("kind", KINDS)
def test_transformers_checkpoint_loads_with_the_same_logits(kind, tmp_path):
    theirs = hf_model(kind)
    ours = from_pretrained(LlamaForCausalLM, saved(theirs, tmp_path))
    assert ours.cfg.attention_bias == (kind == "qwen2")
    close(ours(jnp.asarray(IDS)), torch_logits(theirs, input_ids=IDS))
    padded = ours(jnp.asarray(IDS), attention_mask=jnp.asarray(MASK))
    want = torch_logits(theirs, input_ids=IDS, attention_mask=MASK, position_ids=positions(MASK))
    close(padded * MASK[..., None], want * MASK[..., None])  # padding rows are don't-cares


@pytest.mark.parametrize("tied", [False, True])
def test_our_checkpoint_loads_in_transformers_with_the_same_logits(tied, tmp_path):
    cfg = LlamaConfig(**{k: v for k, v in SHAPE.items() if k not in ("eos_token_id",
                                                                     "pad_token_id")},
                      tie_word_embeddings=tied)
    ours = jiggle_ours(LlamaForCausalLM(cfg, nnx.Rngs(0)))
    save_pretrained(ours, str(tmp_path))
    theirs = load_hf(transformers.LlamaForCausalLM, str(tmp_path))
    close(ours(jnp.asarray(IDS)), torch_logits(theirs, input_ids=IDS))


def test_greedy_generation_matches_transformers(tmp_path):
    theirs = hf_model("llama")
    ours = from_pretrained(LlamaForCausalLM, saved(theirs, tmp_path))
    prompts, mask = np.where(MASK > 0, IDS, PAD)[:, :6], MASK[:, :6]
    got = generate(ours, nnx.state(ours, nnx.Param), jnp.asarray(prompts), 8,
                   prompt_mask=jnp.asarray(mask), eos_token_id=EOS, pad_token_id=PAD)
    np.testing.assert_array_equal(np.asarray(got),
                                  hf_greedy(theirs, prompts, 6, 8, EOS, PAD, attention_mask=mask))


@pytest.mark.parametrize("num_beams", [3, 4])
def test_beam_search_matches_transformers(tmp_path, num_beams):
    """Beam search on 8 prompts behind 0 to 3 pads gives transformers' tokens, with the
    config's EOS and with EOS ids that end rows early (``check_beams``; pad 0, so transformers
    fills ended rows with EOS)."""
    theirs = hf_model("llama")
    ours = from_pretrained(LlamaForCausalLM, saved(theirs, tmp_path))
    prompts, mask = left_padded(8, 6, EOS, PAD, seed=2)
    check_beams(zoo_beams(ours, prompts, 8, num_beams, PAD, prompt_mask=jnp.asarray(mask)),
                lambda eos: hf_beams(theirs, prompts, 6, 8, num_beams, eos, PAD,
                                     attention_mask=mask), EOS)


def test_a_model_trained_here_loads_in_transformers_with_the_same_logits(tmp_path):
    import optax

    from redco import Deployer, Trainer
    from redco_zoo_lm import collate_fn, loss_fn
    from redco_zoo_models import split_model
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg, nnx.Rngs(0))
    apply_fn, params = split_model(model)
    trainer = Trainer(Deployer(jax_seed=0, workdir=str(tmp_path / "run"), verbose=False),
                      collate_fn, apply_fn, loss_fn, params, optax.adamw(1e-2))
    rng = np.random.default_rng(0)
    examples = [{"token_ids": (np.arange(17) * rng.integers(1, 4) + rng.integers(64)) % 64}
                for _ in range(64)]
    # 64 updates (2.37 to 2.44 over four draws): 24 (3 epochs) left the loss at 3.46 from
    # transformers' draw (std 0.02), above the bar, and cleared it by 0.05 only from flax's
    trainer.fit(examples, 8, n_epochs=8)
    nnx.update(model, trainer.params)
    save_pretrained(model, str(tmp_path / "model"))
    theirs = load_hf(transformers.LlamaForCausalLM, str(tmp_path / "model"))
    ours = model(jnp.asarray(IDS))
    assert trainer.eval_loss(examples, 8) < np.log(VOCAB) - 1  # it learned something
    close(ours, torch_logits(theirs, input_ids=IDS))
