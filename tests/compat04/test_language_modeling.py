"""Redco 0.4.x script, run unchanged: ``examples/language_modeling/main.py`` of tanyuqian/redco
(the 0.4.17+ version: pre-tokenized documents packed into context-length blocks, init checkpoint
dir, ``load_last_ckpt``, ``get_accumulate_grad_batches``, ``compute_dtype``, no checkpoint saved)
together with its ``save_init_ckpt.py``. That version no longer imports
``language_modeling_pipeline.py`` (its collate/loss functions live in main.py). The hub pieces
are replaced by local ones: a tiny random-init GPT-2 (``FlaxAutoModelForCausalLM`` from a
config saved to a local "model dir") and pre-tokenized documents made here whose next token is
predictable.

Redco calls reproduced (keywords as in the example):

save_init_ckpt.py
  Deployer(workdir=None, jax_seed=0)
  deployer.log_info(ckpt_dir, title='Init CKPT Dir to Save')
  deployer.save_ckpt(ckpt_dir=ckpt_dir, params=model.params)   (a jitted random init here)
main.py
  Deployer(workdir=, jax_seed=, n_model_shards=, n_processes=, host0_address=, host0_port=,
           process_id=, n_local_devices=)
  deployer.get_accumulate_grad_batches(global_batch_size=, per_device_batch_size=)
  deployer.log_info(accumulate_grad_batches, title='accumulate_grad_batches')
  deployer.get_lr_schedule_fn(train_size=, per_device_batch_size=, n_epochs=, learning_rate=,
                              schedule_type=, warmup_ratio=)
  ckpt, info = deployer.load_last_ckpt(optimizer=, float_dtype=jnp.float32)
  (ckpt is None) ckpt, info = deployer.load_ckpt(ckpt_dir=init_ckpt_dir, update_rng=False,
                                                 float_dtype=jnp.float32)
  deployer.get_sharding_rules(params_shape_or_params=ckpt['params'])
  deployer.log_info(info='\\n'.join(str(rule) ...), title='Sharding rules')
  Trainer(deployer=, collate_fn=, apply_fn=model, loss_fn=, params=ckpt.pop('params'),
          opt_state=ckpt.pop('opt_state'), last_ckpt_info=info, optimizer=, compute_dtype=,
          lr_schedule_fn=, accumulate_grad_batches=, params_sharding_rules=)
  trainer.fit(train_examples=, eval_examples=, n_epochs=, per_device_batch_size=,
              save_every_ckpt=False, save_last_ckpt=False, save_opt_states=False)
User callback keeps the 0.4.x signature: loss_fn(train_rng, state, params, batch, is_training).
Note: this (newest stored) version of the example still uses 0.4.17-era names that 0.4.23 itself
rejects: ``fit(save_every_ckpt=)`` (0.4.23: ``save_ckpt_every_k_epochs``) and a ``train_rng``
loss_fn argument (0.4.23 passes ``rng=`` by keyword). With those renamed, this file passes on
redco 0.4.23 itself.

Checked afterwards: the eval loss (``trainer.eval_loss``, and the per-epoch
``workdir/eval_results_epoch{i}.json`` 0.4.x writes) falls far below a random model's
``log(vocab_size)``, and no checkpoint is written (every save_* is off).
"""
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _lm_utils import read_json, token_documents, write_json
from transformers import AutoConfig, FlaxAutoModelForCausalLM, GPT2Config

from redco import Deployer, Trainer

VOCAB_SIZE = 64
N_EPOCHS = 5
PER_DEVICE_BATCH_SIZE = 4          # x 4 data-parallel groups (8 devices / 2 model shards) = 16
GLOBAL_BATCH_SIZE = 32             # -> accumulate_grad_batches = 2
LOSS_BAR = 1.5                     # log(64) = 4.16 at random init; 0.77 measured on 0.4.23


# ---------------------------------------------------------------- the example's functions

def get_dataset(dataset_path, eos_token_id, context_length):
    """Concatenate the documents (first token dropped, eos appended) and cut the stream into
    ``context_length`` blocks; 90% train, 10% validation."""
    blocks, buffer = [], []
    for doc in read_json(dataset_path):  # stands in for datasets.load_dataset(dataset_name)
        buffer += doc["input_ids"][1:] + [eos_token_id]
        while len(buffer) >= context_length:
            blocks.append({"token_ids": buffer[:context_length]})
            buffer = buffer[context_length:]
    cut = int(0.9 * len(blocks))
    return {"train": blocks[:cut], "validation": blocks[cut:]}


def collate_fn(examples):
    token_ids = np.array([ex["token_ids"] for ex in examples])
    return {"input_ids": token_ids[:, :-1], "labels": token_ids[:, 1:]}


def loss_fn(train_rng, state, params, batch, is_training):
    labels = batch.pop("labels")
    logits = state.apply_fn(**batch, params=params, dropout_rng=train_rng, train=is_training)[0]
    return optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=labels).mean()


# ---------------------------------------------------------------- save_init_ckpt.py

def save_init_ckpt(model_name_or_path):
    deployer = Deployer(workdir=None, jax_seed=0)
    ckpt_dir = "./" + model_name_or_path.rstrip("/").split("/")[-1]
    deployer.log_info(ckpt_dir, title="Init CKPT Dir to Save")
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        # stands in for from_pretrained(model_name_or_path, from_pt=True) and its model.params:
        # a random init (jitted: eager init of a Flax model is slow on CPU), no hub
        model = FlaxAutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(model_name_or_path), _do_init=False)
        params = jax.jit(model.init_weights, static_argnums=1)(jax.random.PRNGKey(0), (1, 1))
        deployer.save_ckpt(ckpt_dir=ckpt_dir, params=params)
    return ckpt_dir


# ---------------------------------------------------------------- main.py

def main(dataset_path, model_name_or_path, init_ckpt_dir, n_model_shards=2, n_epochs=N_EPOCHS,
         global_batch_size=GLOBAL_BATCH_SIZE, per_device_batch_size=PER_DEVICE_BATCH_SIZE,
         learning_rate=1e-2, lr_schedule_type="linear", warmup_ratio=0.1, grad_norm_clip=1.,
         weight_decay=0.01, workdir="./workdir", jax_seed=42, n_processes=None,
         host0_address=None, host0_port=None, process_id=None, n_local_devices=None):
    deployer = Deployer(
        workdir=workdir,
        jax_seed=jax_seed,
        n_model_shards=n_model_shards,
        n_processes=n_processes,
        host0_address=host0_address,
        host0_port=host0_port,
        process_id=process_id,
        n_local_devices=n_local_devices)

    compute_dtype = jnp.bfloat16
    model = FlaxAutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(model_name_or_path), dtype=compute_dtype, _do_init=False)
    dataset = get_dataset(
        dataset_path=dataset_path,
        eos_token_id=model.config.eos_token_id,
        context_length=model.config.n_positions)  # llama's config calls it max_sequence_length

    accumulate_grad_batches = deployer.get_accumulate_grad_batches(
        global_batch_size=global_batch_size, per_device_batch_size=per_device_batch_size)
    deployer.log_info(accumulate_grad_batches, title="accumulate_grad_batches")
    lr_schedule_fn = deployer.get_lr_schedule_fn(
        train_size=len(dataset["train"]),
        per_device_batch_size=per_device_batch_size,
        n_epochs=n_epochs,
        learning_rate=learning_rate,
        schedule_type=lr_schedule_type,
        warmup_ratio=warmup_ratio)
    optimizer = optax.MultiSteps(optax.chain(
        optax.clip_by_global_norm(grad_norm_clip),
        optax.adamw(learning_rate=lr_schedule_fn, weight_decay=weight_decay),
    ), every_k_schedule=accumulate_grad_batches)

    ckpt, info = deployer.load_last_ckpt(optimizer=optimizer, float_dtype=jnp.float32)
    if ckpt is None:
        ckpt, info = deployer.load_ckpt(
            ckpt_dir=init_ckpt_dir, update_rng=False, float_dtype=jnp.float32)

    params_sharding_rules = deployer.get_sharding_rules(params_shape_or_params=ckpt["params"])
    if params_sharding_rules is not None:
        deployer.log_info(info="\n".join([str(t) for t in params_sharding_rules]),
                          title="Sharding rules")

    trainer = Trainer(
        deployer=deployer,
        collate_fn=collate_fn,
        apply_fn=model,
        loss_fn=loss_fn,
        params=ckpt.pop("params"),
        opt_state=ckpt.pop("opt_state"),
        last_ckpt_info=info,
        optimizer=optimizer,
        compute_dtype=compute_dtype,
        lr_schedule_fn=lr_schedule_fn,
        accumulate_grad_batches=accumulate_grad_batches,
        params_sharding_rules=params_sharding_rules)

    trainer.fit(
        train_examples=dataset["train"],
        eval_examples=dataset["validation"],
        n_epochs=n_epochs,
        per_device_batch_size=per_device_batch_size,
        save_every_ckpt=False,
        save_last_ckpt=False,
        save_opt_states=False)
    return trainer, dataset  # (the example returns nothing; the test inspects these)


# ---------------------------------------------------------------- the test

def test_language_modeling(tmp_path):
    model_dir = tmp_path / "hub" / "tiny-gpt2"  # a local stand-in for a hub model id
    GPT2Config(vocab_size=VOCAB_SIZE, n_positions=16, n_embd=32, n_layer=2, n_head=4,
               bos_token_id=0, eos_token_id=1).save_pretrained(model_dir)
    dataset_path = tmp_path / "tokenized_docs.json"
    write_json(dataset_path, token_documents(n_docs=420, seed=0, vocab_size=VOCAB_SIZE))

    init_ckpt_dir = save_init_ckpt(model_name_or_path=str(model_dir))
    trainer, dataset = main(dataset_path=str(dataset_path), model_name_or_path=str(model_dir),
                            init_ckpt_dir=init_ckpt_dir)

    loss = trainer.eval_loss(examples=dataset["validation"],
                             per_device_batch_size=PER_DEVICE_BATCH_SIZE)
    assert math.isfinite(loss) and loss < LOSS_BAR, (
        f"eval loss {loss:.3f} after {N_EPOCHS} epochs (random: log({VOCAB_SIZE}) = "
        f"{math.log(VOCAB_SIZE):.2f}; bar {LOSS_BAR})")

    per_epoch = [read_json(f"workdir/eval_results_epoch{i}.json")["loss"] for i in range(N_EPOCHS)]
    assert per_epoch[-1] < per_epoch[0] < math.log(VOCAB_SIZE), per_epoch
    assert abs(per_epoch[-1] - loss) < 1e-3 * max(1.0, loss), (per_epoch, loss)

    assert not os.path.exists("workdir/ckpts") or not os.listdir("workdir/ckpts"), (
        "save_every_ckpt/save_last_ckpt/save_opt_states are all off: no checkpoint expected")
