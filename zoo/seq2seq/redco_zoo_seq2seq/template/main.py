"""{{project_name}}: text-to-text (translation, summarisation, question answering) with Redco.

    python main.py --model flan-t5-small --train train.jsonl --eval dev.jsonl

``--model`` is a local HuggingFace T5 / flan-T5 directory (config.json, model.safetensors,
tokenizer.json); each row of ``--train`` has a ``src`` and a ``tgt`` string. The three
functions are yours to change. ``Deployer`` and ``Trainer`` take care of devices, sharding
(``--n_model_shards``), checkpoints (rerun to resume) and logs in ``--workdir``."""
import argparse
from functools import partial

import jax.numpy as jnp
import numpy as np
import optax

from redco import Deployer, Trainer
from redco_zoo_models import generate, runner, split_model
from redco_zoo_models.metrics import text_scores, token_cross_entropy


def collate_fn(examples: list[dict], tokenizer, max_src_len: int, max_tgt_len: int, pad_id: int,
               eos_id: int) -> dict:
    """``src`` and ``tgt`` strings -> encoder ids, decoder inputs (the pad id starts them, as in
    T5) and labels (the target then EOS), right-padded with masks."""
    def ids(text):  # add_special_tokens=False: T5's own tokenizer.json would add EOS too
        return tokenizer.encode(text, add_special_tokens=False).ids + [eos_id]
    src, tgt = [ids(e["src"]) for e in examples], [ids(e["tgt"]) for e in examples]
    input_ids, attention_mask = runner.pad_ids(src, max_src_len, pad_id)
    labels, label_mask = runner.pad_ids(tgt, max_tgt_len, pad_id)
    decoder_input_ids = np.concatenate([np.full((len(tgt), 1), pad_id, np.int32),
                                        labels[:, :-1]], 1)
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "decoder_input_ids": decoder_input_ids, "labels": labels, "label_mask": label_mask}


def loss_fn(rng, state, params, batch, is_training):
    """Cross-entropy of the target tokens (padding excluded)."""
    logits = state.apply_fn(params, batch["input_ids"], batch["attention_mask"],
                            batch["decoder_input_ids"])
    return token_cross_entropy(logits, batch["labels"], batch["label_mask"])


def pred_fn(rng, params, batch, model, max_new_tokens: int, num_beams: int, pad_id: int,
            eos_id: int):
    """Beam-search output ids (B, max_new_tokens) for each source."""
    start = jnp.full((batch["input_ids"].shape[0], 1), pad_id, jnp.int32)
    return generate(model, params, start, max_new_tokens, num_beams=num_beams,
                    eos_token_id=eos_id, pad_token_id=pad_id, encoder_inputs={
                        "input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]})


def metric_fn(examples: list[dict], preds: list[str]) -> dict:
    """ROUGE-1/2/L and exact match of the predicted texts against ``tgt``."""
    return text_scores(preds, [e["tgt"] for e in examples])


def main(args):
    tokenizer = runner.load_tokenizer(args.model)
    model, config = runner.load_model(args.model, args.from_scratch, args.jax_seed)
    ids = {"pad_id": config["pad_token_id"], "eos_id": config["eos_token_id"]}
    train, evaluate = runner.split_eval(args)  # --eval, or the last 5% of --train

    deployer = Deployer(jax_seed=args.jax_seed, n_model_shards=args.n_model_shards,
                        workdir=args.workdir, device_memory=args.device_memory)  # for auto
    apply_fn, params = split_model(model)
    n_epochs, lr = runner.n_epochs_and_schedule(args, deployer, len(train))  # or --max_steps
    trainer = Trainer(deployer, partial(collate_fn, tokenizer=tokenizer, max_src_len=args.max_src_len,
                                        max_tgt_len=args.max_tgt_len, **ids),
                      apply_fn, loss_fn, params, optax.adamw(lr), lr_schedule_fn=lr)
    predictor = trainer.get_default_predictor(
        partial(pred_fn, model=model, max_new_tokens=args.max_tgt_len, num_beams=args.num_beams,
                **ids),
        output_fn=partial(runner.detokenize, tokenizer=tokenizer, eos_id=ids["eos_id"]))
    trainer.fit(train, args.per_device_batch_size, n_epochs, max_steps=args.max_steps,
                eval_examples=evaluate,
                eval_predictor=predictor, eval_metric_fn=metric_fn,
                save_every_n_steps=args.save_every_n_steps, save_argmax_ckpt_by_metrics=["rougeL"])
    runner.save_trained(trainer, model, args.model)  # workdir/model, a HuggingFace directory
    return trainer


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    runner.add_arguments(parser)  # --model --train --eval --workdir --n_model_shards --n_epochs ...
    parser.add_argument("--max_src_len", type=int, default=128)
    parser.add_argument("--max_tgt_len", type=int, default=64)
    parser.add_argument("--num_beams", type=int, default=4)
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
