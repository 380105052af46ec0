"""{{project_name}}: direct preference optimisation (DPO) on chats with Redco.

    python main.py --model my-llama --train pairs.jsonl --lora_rank 8   # reference: adapters off
    python main.py --model my-llama --train pairs.jsonl                 # full: reference precomputed

``--model`` is a local HuggingFace LLaMA, Mistral, Qwen2 or GPT-2 directory whose tokenizer has
a chat template; ``--train`` is a ``.jsonl`` file of preference pairs: ``prompt`` (a list of
``{"role", "content"}`` messages), ``chosen`` and ``rejected`` (two replies to it). Both replies
go through the model in one forward pass; the reference is the model before training (with
``--lora_rank``, the same weights with the adapters off; without, log-probabilities computed
once before training). The three functions come from ``redco_zoo_dpo/pipeline.py``, the code
``redco zoo run dpo`` runs: to change one, copy it from there into this file in place of its
import."""
import argparse
from functools import partial

import optax

from redco import Deployer, Trainer
from redco_zoo_dpo.pipeline import (
    DPOSettings,
    add_reference_logps,
    collate_fn,
    loss_fn,
    metric_fn,
    pred_fn,
    render_pair,
)
from redco_zoo_models import flags, moe_optimizer, runner
from redco_zoo_models.settings import RunConfig
from redco_zoo_sft.pipeline import load_chat_tokenizer


def main(config: RunConfig[DPOSettings]):
    dpo, loop, source, seed = config.task, config.loop, config.source, config.jax_seed
    tokenizer = load_chat_tokenizer(source.model)  # with its chat template
    model, _ = runner.load_source(source, seed)
    train, evaluate = ([render_pair(tokenizer, row, dpo.max_len, f"{what} row {i}")
                        for i, row in enumerate(rows)]  # only the replies' tokens counted
                       for rows, what in zip(runner.split_eval(config.data), ("--train", "--eval")))

    deployer = Deployer(jax_seed=seed, n_model_shards=config.layout.n_model_shards,
                        workdir=config.workdir, device_memory=config.layout.device_memory)
    apply_fn, params, trainable = runner.split_for_training(
        model, config.lora, seed, deployer)  # --lora_rank
    n_epochs, lr = runner.n_epochs_and_schedule(
        loop, config.optimizer, deployer, len(train))  # or --max_steps
    optimizer = moe_optimizer(optax.adamw(lr), model)  # (an MoE bias: balancing.py)
    trainer = Trainer(deployer, partial(collate_fn, max_len=dpo.max_len), apply_fn,
                      partial(loss_fn, beta=dpo.beta, label_smoothing=dpo.label_smoothing),
                      params, optimizer, lr_schedule_fn=lr, trainable=trainable)
    if trainable is None:  # full fine-tuning: the reference's log-probabilities, once
        add_reference_logps(trainer, model, [train, evaluate], loop.per_device_batch_size)
    predictor = trainer.get_default_predictor(partial(pred_fn, model=model, beta=dpo.beta))
    trainer.fit(train, loop.per_device_batch_size, n_epochs, max_steps=loop.max_steps,
                eval_examples=evaluate, eval_predictor=predictor, eval_metric_fn=metric_fn,
                save_every_n_steps=loop.save_every_n_steps,
                save_argmax_ckpt_by_metrics=["accuracy"])
    metrics = metric_fn(evaluate, predictor.predict(evaluate, loop.per_device_batch_size,
                                                    trainer.params))
    deployer.log_info(f"held-out preference accuracy {metrics['accuracy']:.3f}, margin "
                      f"{metrics['margin']:.3f}")
    runner.save_trained(trainer, model, source.model)  # workdir/model, with the tokenizer
    return metrics


def parse_args(argv=None) -> RunConfig[DPOSettings]:
    """The command line as the run's typed settings (argparse stops here)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    flags.add_arguments(parser)  # --model --train --eval --max_steps --lora_rank ...
    parser.add_argument("--max_len", type=int, default=DPOSettings.max_len, help="tokens per "
                        "reply, prompt included")
    parser.add_argument("--beta", type=float, default=DPOSettings.beta)
    parser.add_argument("--label_smoothing", type=float, default=DPOSettings.label_smoothing)
    return RunConfig.of_flags(parser.parse_args(argv), DPOSettings)


if __name__ == "__main__":
    main(parse_args())
