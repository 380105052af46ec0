"""Redco 0.4.x script, run unchanged: ``examples/text_to_text/main.py`` of tanyuqian/redco (the
0.4.17+ version: init checkpoint dir, ``load_last_ckpt`` resume, ``get_accumulate_grad_batches``,
``compute_dtype``, a ``Predictor`` scored by ROUGE, best-by-rougeL checkpoint) together with its
``save_init_ckpt.py``. The hub pieces are replaced by local ones: a tiny random-init T5 whose
config and word-level tokenizer are saved to a local "model dir", json files of a toy
summarization task (a few stop words and one noun -> "KIND NOUN"), and a token-level ROUGE
(``evaluate.load('rouge')`` needs the network).

Redco calls reproduced (keywords as in the example):

save_init_ckpt.py
  Deployer(workdir=None, jax_seed=42)
  deployer.log_info(ckpt_dir, title='Init CKPT Dir to Save')
  deployer.save_ckpt(ckpt_dir=ckpt_dir, params=model.params)   (a jitted random init here)
main.py
  Deployer(workdir=, jax_seed=, n_model_shards=, n_processes=, host0_address=, host0_port=,
           process_id=, n_local_devices=)
  deployer.get_accumulate_grad_batches(global_batch_size=, per_device_batch_size=)
  deployer.log_info(accumulate_grad_batches, title='accumulate_grad_batches')
  deployer.get_lr_schedule_fn(train_size=, per_device_batch_size=, n_epochs=, learning_rate=,
                              schedule_type=, warmup_rate=)
  ckpt, info = deployer.load_last_ckpt(optimizer=, float_dtype=jnp.float32)
  (ckpt is None) ckpt, info = deployer.load_ckpt(ckpt_dir=init_ckpt_dir, update_rng=False,
                                                 float_dtype=jnp.float32)
  deployer.get_sharding_rules(params_shape_or_params=ckpt['params'])
  deployer.log_info(info='\\n'.join(str(rule) ...), title='Sharding rules')
  Trainer(deployer=, collate_fn=, apply_fn=model, loss_fn=, params=ckpt.pop('params'),
          opt_state=ckpt.pop('opt_state'), last_ckpt_info=info, optimizer=, compute_dtype=,
          lr_schedule_fn=, accumulate_grad_batches=, params_sharding_rules=)
  Predictor(deployer=, collate_fn=, pred_fn=, output_fn=, params_sharding_rules=)
  trainer.fit(train_examples=, per_device_batch_size=, n_epochs=, eval_examples=,
              eval_predictor=, eval_metric_fn=, save_last_ckpt=False,
              save_argmax_ckpt_by_metrics=['rougeL'])
User callbacks keep the 0.4.x signatures: loss_fn(train_rng, state, params, batch, is_training),
pred_fn(pred_rng, params, batch, model), output_fn(batch_preds, tokenizer),
eval_metric_fn(examples, preds, tgt_key).
Note: this (newest stored) version of the example still uses 0.4.17-era names that 0.4.23 itself
rejects: ``get_lr_schedule_fn(warmup_rate=)`` (0.4.23: ``warmup_ratio``) and callbacks whose rng
argument is ``train_rng``/``pred_rng`` (0.4.23 passes ``rng=`` by keyword). With those three
renamed, this file passes on redco 0.4.23 itself.

Checked: rougeL after training well above a random model's (0.0) and rising over the epochs.
Then the same command runs again in the same workdir, as after an interruption: load_last_ckpt
must return the best-rougeL checkpoint with its epoch (last_ckpt_info), so only the epochs after
it are trained; when that was the last epoch nothing is trained and the restored params give
exactly the first run's final eval loss (``trainer.eval_loss``).
"""
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _lm_utils import (
    T5_SPECIALS,
    patch_flax_t5_clip,
    read_json,
    rouge_scores,
    summarization_examples,
    summary_vocab,
    word_tokenizer,
    write_json,
)
from transformers import AutoConfig, AutoTokenizer, FlaxAutoModelForSeq2SeqLM, T5Config

from redco import Deployer, Predictor, Trainer

patch_flax_t5_clip()  # transformers' Flax T5 vs jax 0.10 (environment, not Redco)

N_EPOCHS = 5
PER_DEVICE_BATCH_SIZE = 4          # x 4 data-parallel groups (8 devices / 2 model shards) = 16
GLOBAL_BATCH_SIZE = 32             # -> accumulate_grad_batches = 2
ROUGE_L_BAR = 0.6                  # redco 0.4.23: 0.12 after epoch 1, 0.96 after 5


# ---------------------------------------------------------------- the example's functions

def collate_fn(examples, tokenizer, decoder_start_token_id, max_src_len, max_tgt_len,
               src_key="src", tgt_key="tgt"):
    encoder = tokenizer([ex[src_key] for ex in examples], max_length=max_src_len,
                        padding="max_length", truncation=True, return_tensors="np")
    decoder = tokenizer([ex[tgt_key] for ex in examples], max_length=max_tgt_len,
                        padding="max_length", truncation=True, return_tensors="np")
    labels = decoder["input_ids"]
    shifted = np.full_like(labels, decoder_start_token_id)
    shifted[:, 1:] = labels[:, :-1]
    return {"input_ids": encoder["input_ids"], "attention_mask": encoder["attention_mask"],
            "labels": labels, "decoder_input_ids": shifted,
            "decoder_attention_mask": np.asarray(decoder["attention_mask"])}


def loss_fn(train_rng, state, params, batch, is_training):
    labels = batch.pop("labels")
    weights = batch["decoder_attention_mask"]
    logits = state.apply_fn(**batch, params=params, dropout_rng=train_rng, train=is_training)[0]
    token_loss = optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=labels)
    return jnp.sum(token_loss * weights) / jnp.sum(weights)


def pred_fn(pred_rng, params, batch, model):
    return model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                          params=params, prng_key=pred_rng).sequences


def output_fn(batch_preds, tokenizer):
    return tokenizer.batch_decode(batch_preds, skip_special_tokens=True)


def eval_rouge(examples, preds, tgt_key, record):
    scores = rouge_scores(preds, [ex[tgt_key] for ex in examples])
    record.append({"n_examples": len(examples), **scores})
    return scores


# ---------------------------------------------------------------- save_init_ckpt.py

def save_init_ckpt(model_name_or_path):
    deployer = Deployer(workdir=None, jax_seed=42)
    ckpt_dir = "./" + model_name_or_path.rstrip("/").split("/")[-1]
    deployer.log_info(ckpt_dir, title="Init CKPT Dir to Save")
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        # stands in for from_pretrained(model_name_or_path, from_pt=True) and its model.params:
        # a random init (jitted: eager init of a Flax model is slow on CPU), no hub
        model = FlaxAutoModelForSeq2SeqLM.from_config(
            AutoConfig.from_pretrained(model_name_or_path), _do_init=False)
        params = jax.jit(model.init_weights, static_argnums=1)(jax.random.PRNGKey(0), (1, 1))
        deployer.save_ckpt(ckpt_dir=ckpt_dir, params=params)
    return ckpt_dir


# ---------------------------------------------------------------- main.py

def main(data_dir, model_name_or_path, init_ckpt_dir, record, src_key="document",
         tgt_key="summary", n_model_shards=2, max_src_len=8, max_tgt_len=4, num_beams=1,
         n_epochs=N_EPOCHS, global_batch_size=GLOBAL_BATCH_SIZE,
         per_device_batch_size=PER_DEVICE_BATCH_SIZE, learning_rate=1e-2,
         lr_schedule_type="linear", warmup_rate=0.1, grad_norm_clip=1., weight_decay=0.01,
         workdir="./workdir", jax_seed=42, n_processes=None, host0_address=None,
         host0_port=None, process_id=None, n_local_devices=None):
    deployer = Deployer(
        workdir=workdir,
        jax_seed=jax_seed,
        n_model_shards=n_model_shards,
        n_processes=n_processes,
        host0_address=host0_address,
        host0_port=host0_port,
        process_id=process_id,
        n_local_devices=n_local_devices)

    # stands in for datasets.load_dataset(dataset_name, split=split)
    dataset = {split: read_json(f"{data_dir}/{split}.json") for split in ["train", "validation"]}

    tokenizer = AutoTokenizer.from_pretrained(model_name_or_path)
    compute_dtype = jnp.bfloat16
    model = FlaxAutoModelForSeq2SeqLM.from_config(
        AutoConfig.from_pretrained(model_name_or_path), dtype=compute_dtype, _do_init=False)
    model.generation_config.update(
        decoder_start_token_id=model.config.decoder_start_token_id,
        max_length=max_tgt_len,
        pad_token_id=tokenizer.pad_token_id,
        num_beams=num_beams)

    accumulate_grad_batches = deployer.get_accumulate_grad_batches(
        global_batch_size=global_batch_size, per_device_batch_size=per_device_batch_size)
    deployer.log_info(accumulate_grad_batches, title="accumulate_grad_batches")
    lr_schedule_fn = deployer.get_lr_schedule_fn(
        train_size=len(dataset["train"]),
        per_device_batch_size=per_device_batch_size,
        n_epochs=n_epochs,
        learning_rate=learning_rate,
        schedule_type=lr_schedule_type,
        warmup_rate=warmup_rate)
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

    collate_fn_kwargs = {
        "tokenizer": tokenizer,
        "decoder_start_token_id": model.config.decoder_start_token_id,
        "max_src_len": max_src_len,
        "max_tgt_len": max_tgt_len,
        "src_key": src_key,
        "tgt_key": tgt_key,
    }
    trainer = Trainer(
        deployer=deployer,
        collate_fn=partial(collate_fn, **collate_fn_kwargs),
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

    predictor = Predictor(
        deployer=deployer,
        collate_fn=partial(collate_fn, **collate_fn_kwargs),
        pred_fn=partial(pred_fn, model=model),
        output_fn=partial(output_fn, tokenizer=tokenizer),
        params_sharding_rules=params_sharding_rules)

    trainer.fit(
        train_examples=dataset["train"],
        per_device_batch_size=per_device_batch_size,
        n_epochs=n_epochs,
        eval_examples=dataset["validation"],
        eval_predictor=predictor,
        eval_metric_fn=partial(eval_rouge, tgt_key=tgt_key, record=record),
        save_last_ckpt=False,
        save_argmax_ckpt_by_metrics=["rougeL"])
    return trainer, dataset  # (the example returns nothing; the test inspects these)


# ---------------------------------------------------------------- the test

def _setup(tmp_path):
    """A local 'hub' dir (config.json + tokenizer files) and the json dataset."""
    model_dir, data_dir = tmp_path / "hub" / "tiny-t5", tmp_path / "data"
    model_dir.mkdir(parents=True)
    data_dir.mkdir()
    tokenizer = word_tokenizer(summary_vocab(), T5_SPECIALS)
    tokenizer.save_pretrained(model_dir)
    T5Config(vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=1,
             num_decoder_layers=1, num_heads=4, relative_attention_num_buckets=8,
             relative_attention_max_distance=16, feed_forward_proj="relu", dropout_rate=0.1,
             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
             decoder_start_token_id=tokenizer.pad_token_id).save_pretrained(model_dir)
    write_json(data_dir / "train.json", summarization_examples(384, seed=0))
    write_json(data_dir / "validation.json", summarization_examples(48, seed=1))
    return str(model_dir), str(data_dir)


def _full_evals(record, n_validation=48):
    """The per-epoch evaluations (the sanity check, if any, scores only a first batch)."""
    return [r for r in record if r["n_examples"] == n_validation]


def test_text_to_text(tmp_path):
    model_dir, data_dir = _setup(tmp_path)
    init_ckpt_dir = save_init_ckpt(model_name_or_path=model_dir)
    run = partial(main, data_dir=data_dir, model_name_or_path=model_dir,
                  init_ckpt_dir=init_ckpt_dir)

    first = []
    trainer, dataset = run(record=first)
    evals = _full_evals(first)
    assert len(evals) == N_EPOCHS, f"expected one evaluation per epoch, got {first}"
    rouge_l = [e["rougeL"] for e in evals]
    assert rouge_l[-1] >= ROUGE_L_BAR, f"rougeL per epoch {rouge_l}: the model did not learn"
    assert rouge_l[-1] > rouge_l[0], f"rougeL per epoch {rouge_l}: no progress over epochs"
    best_epoch = max(range(N_EPOCHS), key=lambda i: (rouge_l[i], -i))  # first maximum
    final_loss = trainer.eval_loss(examples=dataset["validation"],
                                   per_device_batch_size=PER_DEVICE_BATCH_SIZE)

    # The same command again: resumes from the best-rougeL checkpoint (load_last_ckpt).
    second = []
    trainer, dataset = run(record=second)
    resumed = _full_evals(second)
    assert len(resumed) == N_EPOCHS - 1 - best_epoch, (
        f"the best rougeL was at epoch {best_epoch} of {N_EPOCHS}, so the rerun should train "
        f"{N_EPOCHS - 1 - best_epoch} epoch(s); it evaluated {len(resumed)} time(s): {second}")
    if resumed:
        assert resumed[-1]["rougeL"] >= ROUGE_L_BAR, (resumed, "did not start from the ckpt?")
    else:
        loss = trainer.eval_loss(examples=dataset["validation"],
                                 per_device_batch_size=PER_DEVICE_BATCH_SIZE)
        assert abs(loss - final_loss) <= 1e-5 * max(1.0, final_loss), (
            f"restored params give eval loss {loss}, the first run ended at {final_loss}")
