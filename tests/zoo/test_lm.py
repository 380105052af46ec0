"""The LM pipeline learns a Markov chain to its entropy rate (and no lower: the model does not
see the tokens it predicts) on 8 devices with 2 model shards, and ``redco zoo run lm`` trains a
local HuggingFace model directory on a local text file."""
import os
import pydoc_data.topics

import jax
import numpy as np
import optax
from flax import nnx

from redco import Deployer, Trainer
from redco.cli import main
from redco_zoo_lm import collate_fn, loss_fn
from redco_zoo_models import LlamaConfig, LlamaForCausalLM, from_pretrained, split_model
from redco_zoo_models.toy import save_model_dir, tiny_llama


def markov_chain(n_states=16, seed=0):
    """Transition matrix (rows ~ Dirichlet(0.3)), stationary distribution, entropy rate."""
    rng = np.random.default_rng(seed)
    transitions = rng.dirichlet([0.3] * n_states, size=n_states)
    values, vectors = np.linalg.eig(transitions.T)
    stationary = np.real(vectors[:, np.argmin(np.abs(values - 1))])
    stationary /= stationary.sum()
    entropy_rate = -np.sum(stationary[:, None] * transitions * np.log(transitions + 1e-30))
    return transitions, stationary, entropy_rate


def sample_chains(transitions, stationary, n, length, seed):
    rng = np.random.default_rng(seed)
    states = [rng.choice(len(stationary), size=n, p=stationary)]
    for _ in range(length - 1):
        cumulative = transitions[states[-1]].cumsum(1)
        states.append((rng.random((n, 1)) < cumulative).argmax(1))
    return [{"token_ids": row} for row in np.stack(states, 1)]


def test_lm_learns_a_markov_chain_to_its_entropy_rate(workdir):
    transitions, stationary, entropy_rate = markov_chain()
    # 1024 chains, 4 epochs (128 steps of 32): 1.017 to 1.019x the rate over three draws of the
    # data and model (4096 chains gave 1.007x at 4x the steps)
    train = sample_chains(transitions, stationary, 1024, 33, seed=1)
    test = sample_chains(transitions, stationary, 512, 33, seed=2)
    apply_fn, params = split_model(tiny_llama(16))
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=workdir, verbose=False)
    lr = deployer.get_lr_schedule_fn(len(train), 8, 4, 3e-3, warmup_rate=0.05)
    trainer = Trainer(deployer, collate_fn, apply_fn, loss_fn, params, optax.adamw(lr),
                      lr_schedule_fn=lr)
    trainer.fit(train, 8, n_epochs=4)
    cross_entropy = trainer.eval_loss(test, 8)
    # No model beats the chain itself in expectation, so on test chains it never saw the
    # cross-entropy is at least the entropy rate less the test set's own sampling noise: 5
    # standard errors (of a per-token NLL with the chain's standard deviation, 0.94 nats, over
    # 512 x 32 tokens: 0.0074 nats, 0.4% of the rate), so 0.981x. A model that sees the tokens it
    # predicts scores far below; one that learnt the chain badly scores above 1.05x.
    n_tokens = len(test) * (len(test[0]["token_ids"]) - 1)
    floor = entropy_rate - 5 * nll_std(transitions, stationary, entropy_rate) / np.sqrt(n_tokens)
    print(f"test cross-entropy {cross_entropy:.4f} = {cross_entropy / entropy_rate:.4f} x the "
          f"entropy rate {entropy_rate:.4f} (floor {floor / entropy_rate:.4f} x)")
    assert floor <= cross_entropy <= 1.05 * entropy_rate, (cross_entropy, entropy_rate, floor)


def nll_std(transitions, stationary, entropy_rate) -> float:
    """The standard deviation of one token's negative log-likelihood under the chain."""
    log_p = np.log(transitions + 1e-30)
    return float(np.sqrt(np.sum(stationary[:, None] * transitions * log_p ** 2) - entropy_rate ** 2))


def test_lm_logits_do_not_see_later_tokens():
    """The zoo's LLaMA (as the LM test trains it, and as generation calls it with a mask):
    changing the token at position k leaves every logit before k bit for bit the same, and does
    change those at k (so the change reaches the model). Attention without its causal mask fails."""
    apply_fn, params = split_model(tiny_llama(16, seed=3))
    ids = np.random.default_rng(0).integers(0, 16, (4, 32)).astype(np.int32)
    for name, run in (("training", jax.jit(apply_fn)),
                      ("masked", jax.jit(lambda p, x: apply_fn(p, x, attention_mask=x >= 0)))):
        base = np.asarray(run(params, ids))
        for k in (1, 16, 31):
            changed = ids.copy()
            changed[:, k] = (changed[:, k] + 1) % 16
            logits = np.asarray(run(params, changed))
            np.testing.assert_array_equal(logits[:, :k], base[:, :k], err_msg=f"{name} k={k}")
            assert (np.abs(logits[:, k] - base[:, k]).max(-1) > 0).all(), (name, k)


def test_redco_zoo_run_lm_trains_a_local_model_on_a_text_file(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    text = pydoc_data.topics.topics["assert"] + pydoc_data.topics.topics["if"]
    (tmp_path / "train.txt").write_text(text * 4)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    tokenizer.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300))
    model_dir = tmp_path / "model"
    cfg = LlamaConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=32,
                      intermediate_size=64, num_hidden_layers=2)
    save_model_dir(LlamaForCausalLM(cfg, nnx.Rngs(0)), tokenizer, str(model_dir))

    workdir = tmp_path / "workdir"
    main(["zoo", "run", "lm", "--model", str(model_dir), "--train", str(tmp_path / "train.txt"),
          "--workdir", str(workdir), "--n_model_shards", "2", "--per_device_batch_size", "2",
          "--n_epochs", "6", "--learning_rate", "3e-3", "--block_size", "16"])
    log = open(workdir / "log.txt").read()
    perplexity = float(log.split("eval perplexity ")[1].split()[0])
    assert perplexity < cfg.vocab_size / 3  # an untrained model is near the vocabulary size
    trained = from_pretrained(LlamaForCausalLM, str(workdir / "model"))
    ids = np.array([tokenizer.encode("assert x").ids])
    assert np.isfinite(np.asarray(trained(ids))).all()
    assert sorted(os.listdir(workdir / "model")) == ["config.json", "model.safetensors",
                                                    "tokenizer.json"]
    assert jax.device_count() == 8
