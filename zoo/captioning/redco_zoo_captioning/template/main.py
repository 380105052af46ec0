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
from redco_zoo_captioning.pipeline import Captions, collate_fn, loss_fn, metric_fn, pred_fn
from redco_zoo_models import flags, runner, split_model
from redco_zoo_models.settings import RunConfig


def main(config: RunConfig[Captions]):
    captions, loop, source = config.task, config.loop, config.source
    tokenizer = runner.load_tokenizer(source.model)
    model, hf = runner.load_source(source, config.jax_seed)
    decoder = hf["decoder"]
    ids = {"bos_id": decoder["bos_token_id"], "eos_id": decoder["eos_token_id"],
           "pad_id": hf.get("pad_token_id") or decoder["eos_token_id"]}
    train, evaluate = runner.split_eval(config.data)  # --eval, or the last 5% of --train

    deployer = Deployer(jax_seed=config.jax_seed, n_model_shards=config.layout.n_model_shards,
                        workdir=config.workdir, device_memory=config.layout.device_memory)
    apply_fn, params = split_model(model)
    n_epochs, lr = runner.n_epochs_and_schedule(
        loop, config.optimizer, deployer, len(train))  # or --max_steps
    trainer = Trainer(deployer, partial(collate_fn, tokenizer=tokenizer, max_len=captions.max_len,
                                        image_size=hf["encoder"]["image_size"], **ids),
                      apply_fn, loss_fn, params, optax.adamw(lr), lr_schedule_fn=lr)
    predictor = trainer.get_default_predictor(
        partial(pred_fn, model=model, max_new_tokens=captions.max_len,
                num_beams=captions.num_beams, **ids),
        output_fn=partial(runner.detokenize, tokenizer=tokenizer, eos_id=ids["eos_id"]))
    trainer.fit(train, loop.per_device_batch_size, n_epochs, max_steps=loop.max_steps,
                eval_examples=evaluate,
                eval_predictor=predictor, eval_metric_fn=metric_fn,
                save_every_n_steps=loop.save_every_n_steps, save_argmax_ckpt_by_metrics=["rougeL"])
    runner.save_trained(trainer, model, source.model)  # workdir/model, a HuggingFace directory
    return trainer


def parse_args(argv=None) -> RunConfig[Captions]:
    """The command line as the run's typed settings (argparse stops here)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    flags.add_arguments(parser)  # --model --train --eval --workdir --n_model_shards --n_epochs ...
    parser.add_argument("--max_len", type=int, default=Captions.max_len, help="caption tokens")
    parser.add_argument("--num_beams", type=int, default=Captions.num_beams)
    return RunConfig.of_flags(parser.parse_args(argv), Captions)


if __name__ == "__main__":
    main(parse_args())
