"""{{project_name}}: text-to-text (translation, summarisation, question answering) with Redco.

    python main.py --model flan-t5-small --train train.jsonl --eval dev.jsonl

``--model`` is a local HuggingFace T5 / flan-T5 directory (config.json, model.safetensors,
tokenizer.json); each row of ``--train`` has a ``src`` and a ``tgt`` string. The three functions
come from ``redco_zoo_seq2seq/pipeline.py``, the code ``redco zoo run seq2seq`` runs: to change
one, copy it from there into this file in place of its import. ``Deployer`` and ``Trainer`` take
care of devices, sharding (``--n_model_shards``), checkpoints (rerun to resume) and logs in
``--workdir``."""
import argparse
from functools import partial

import optax

from redco import Deployer, Trainer
from redco_zoo_models import runner, split_model
from redco_zoo_seq2seq.pipeline import collate_fn, loss_fn, metric_fn, pred_fn


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
