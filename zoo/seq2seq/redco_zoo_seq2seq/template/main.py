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
from redco_zoo_models import flags, runner, split_model
from redco_zoo_models.settings import RunConfig
from redco_zoo_seq2seq.pipeline import TextPairs, collate_fn, loss_fn, metric_fn, pred_fn


def main(config: RunConfig[TextPairs]):
    pairs, loop, source = config.task, config.loop, config.source
    tokenizer = runner.load_tokenizer(source.model)
    model, hf = runner.load_source(source, config.jax_seed)
    ids = {"pad_id": hf["pad_token_id"], "eos_id": hf["eos_token_id"]}
    train, evaluate = runner.split_eval(config.data)  # --eval, or the last 5% of --train

    deployer = Deployer(jax_seed=config.jax_seed, n_model_shards=config.layout.n_model_shards,
                        workdir=config.workdir, device_memory=config.layout.device_memory)
    apply_fn, params = split_model(model)
    n_epochs, lr = runner.n_epochs_and_schedule(
        loop, config.optimizer, deployer, len(train))  # or --max_steps
    trainer = Trainer(deployer, partial(collate_fn, tokenizer=tokenizer, max_src_len=pairs.max_src_len,
                                        max_tgt_len=pairs.max_tgt_len, **ids),
                      apply_fn, loss_fn, params, optax.adamw(lr), lr_schedule_fn=lr)
    predictor = trainer.get_default_predictor(
        partial(pred_fn, model=model, max_new_tokens=pairs.max_tgt_len, num_beams=pairs.num_beams,
                **ids),
        output_fn=partial(runner.detokenize, tokenizer=tokenizer, eos_id=ids["eos_id"]))
    trainer.fit(train, loop.per_device_batch_size, n_epochs, max_steps=loop.max_steps,
                eval_examples=evaluate,
                eval_predictor=predictor, eval_metric_fn=metric_fn,
                save_every_n_steps=loop.save_every_n_steps, save_argmax_ckpt_by_metrics=["rougeL"])
    runner.save_trained(trainer, model, source.model)  # workdir/model, a HuggingFace directory
    return trainer


def parse_args(argv=None) -> RunConfig[TextPairs]:
    """The command line as the run's typed settings (argparse stops here)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    flags.add_arguments(parser)  # --model --train --eval --workdir --n_model_shards --n_epochs ...
    parser.add_argument("--max_src_len", type=int, default=TextPairs.max_src_len)
    parser.add_argument("--max_tgt_len", type=int, default=TextPairs.max_tgt_len)
    parser.add_argument("--num_beams", type=int, default=TextPairs.num_beams)
    return RunConfig.of_flags(parser.parse_args(argv), TextPairs)


if __name__ == "__main__":
    main(parse_args())
