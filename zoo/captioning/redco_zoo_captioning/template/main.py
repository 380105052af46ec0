"""{{project_name}}: image captioning with Redco.

    python main.py --model vit-gpt2 --train images/ --eval dev_images/

``--model`` is a local HuggingFace vision-encoder-decoder directory with a ViT encoder and a
GPT-2 decoder (config.json, model.safetensors, tokenizer.json); ``--train`` is a folder of
images with a ``metadata.jsonl`` naming each ``file_name`` and its ``caption``. The three
functions come from ``redco_zoo_captioning/pipeline.py``, the code ``redco zoo run captioning``
runs: to change one, copy it from there into this file in place of its import. ``Deployer`` and
``Trainer`` take care of devices, sharding (``--n_model_shards``), checkpoints (rerun to resume)
and logs in ``--workdir``."""
import argparse
from functools import partial

import optax

from redco import Deployer, Trainer
from redco_zoo_captioning.pipeline import collate_fn, loss_fn, metric_fn, pred_fn
from redco_zoo_models import runner, split_model


def main(args):
    tokenizer = runner.load_tokenizer(args.model)
    model, config = runner.load_model(args.model, args.from_scratch, args.jax_seed)
    decoder = config["decoder"]
    ids = {"bos_id": decoder["bos_token_id"], "eos_id": decoder["eos_token_id"],
           "pad_id": config.get("pad_token_id") or decoder["eos_token_id"]}
    train, evaluate = runner.split_eval(args)  # --eval, or the last 5% of --train

    deployer = Deployer(jax_seed=args.jax_seed, n_model_shards=args.n_model_shards,
                        workdir=args.workdir, device_memory=args.device_memory)  # for auto
    apply_fn, params = split_model(model)
    n_epochs, lr = runner.n_epochs_and_schedule(args, deployer, len(train))  # or --max_steps
    trainer = Trainer(deployer, partial(collate_fn, tokenizer=tokenizer, max_len=args.max_len,
                                        image_size=config["encoder"]["image_size"], **ids),
                      apply_fn, loss_fn, params, optax.adamw(lr), lr_schedule_fn=lr)
    predictor = trainer.get_default_predictor(
        partial(pred_fn, model=model, max_new_tokens=args.max_len, num_beams=args.num_beams,
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
    parser.add_argument("--max_len", type=int, default=32, help="caption tokens")
    parser.add_argument("--num_beams", type=int, default=4)
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
