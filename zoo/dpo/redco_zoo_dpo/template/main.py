"""{{project_name}}: direct preference optimisation (DPO) on chats with Redco.

    python main.py --model my-llama --train pairs.jsonl --lora_rank 8   # reference: adapters off
    python main.py --model my-llama --train pairs.jsonl                 # full: reference precomputed

``--model`` is a local HuggingFace LLaMA, Mistral, Qwen2 or GPT-2 directory whose tokenizer has a
chat template; ``--train`` is a ``.jsonl`` file of preference pairs: ``prompt`` (a list of
``{"role", "content"}`` messages), ``chosen`` and ``rejected`` (two replies to it). Both replies
go through the model in one forward pass; the reference is the model before training (with
``--lora_rank``, the same weights with the adapters off; without, log-probabilities computed
once before training). The three functions are yours to change; see
``redco_zoo_dpo/pipeline.py`` for the loss."""
import argparse
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax

from redco import Deployer, Trainer
from redco_zoo_dpo.pipeline import add_reference_logps, render_pair, rewards
from redco_zoo_models import moe_optimizer, runner, split_model
from redco_zoo_sft.pipeline import load_chat_tokenizer


def collate_fn(examples: list[dict], max_len: int) -> dict:
    """Pairs -> ``input_ids`` and ``loss_mask`` (B, 2, max_len): each pair's chosen then rejected
    reply, right-padded; ``ref_logps`` (B, 2) where the examples carry them."""
    batch = {"input_ids": np.zeros((len(examples), 2, max_len), np.int32),
             "loss_mask": np.zeros((len(examples), 2, max_len), bool)}
    for i, example in enumerate(examples):
        for j, reply in enumerate((example["chosen"], example["rejected"])):
            n = len(reply["token_ids"])
            batch["input_ids"][i, j, :n] = reply["token_ids"]
            batch["loss_mask"][i, j, :n] = reply["loss_mask"]
    if "ref_logps" in examples[0]:
        batch["ref_logps"] = np.array([e["ref_logps"] for e in examples], np.float32)
    return batch


def loss_fn(rng, state, params, batch, is_training, beta: float = 0.1,
            label_smoothing: float = 0.0):
    """DPO's loss (module docstring), the mean over the batch's pairs."""
    r = rewards(state.apply_fn, params, batch, beta)
    margin = r[:, 0] - r[:, 1]
    return jnp.mean(-(1 - label_smoothing) * jax.nn.log_sigmoid(margin)
                    - label_smoothing * jax.nn.log_sigmoid(-margin))


def pred_fn(rng, params, batch, model, beta: float = 0.1):
    """(B, 2): each pair's chosen and rejected reward; ``model`` gives the structure."""
    return rewards(split_model(model)[0], params, batch, beta)


def metric_fn(examples: list[dict], preds: list) -> dict:
    """Preference accuracy, mean margin and mean rewards of the pairs' predicted rewards."""
    r = np.asarray(preds, np.float64)
    return {"accuracy": float(np.mean(r[:, 0] > r[:, 1])),
            "margin": float(np.mean(r[:, 0] - r[:, 1])),
            "chosen_reward": float(np.mean(r[:, 0])), "rejected_reward": float(np.mean(r[:, 1]))}


def main(args):
    tokenizer = load_chat_tokenizer(args.model)  # with its chat template
    model, _ = runner.load_model(args.model, args.from_scratch, args.jax_seed)
    train, evaluate = ([render_pair(tokenizer, row, args.max_len, f"{what} row {i}")
                        for i, row in enumerate(rows)]  # only the replies' tokens counted
                       for rows, what in zip(runner.split_eval(args), ("--train", "--eval")))

    deployer = Deployer(jax_seed=args.jax_seed, n_model_shards=args.n_model_shards,
                        workdir=args.workdir, device_memory=args.device_memory)  # for auto
    apply_fn, params, trainable = runner.split_for_training(model, args, deployer)  # --lora_rank
    n_epochs, lr = runner.n_epochs_and_schedule(args, deployer, len(train))  # or --max_steps
    optimizer = moe_optimizer(optax.adamw(lr), model)  # (an MoE bias: balancing.py)
    trainer = Trainer(deployer, partial(collate_fn, max_len=args.max_len), apply_fn,
                      partial(loss_fn, beta=args.beta, label_smoothing=args.label_smoothing),
                      params, optimizer, lr_schedule_fn=lr, trainable=trainable)
    if trainable is None:  # full fine-tuning: the reference's log-probabilities, once
        add_reference_logps(trainer, model, [train, evaluate], args.per_device_batch_size)
    predictor = trainer.get_default_predictor(partial(pred_fn, model=model, beta=args.beta))
    trainer.fit(train, args.per_device_batch_size, n_epochs, max_steps=args.max_steps,
                eval_examples=evaluate, eval_predictor=predictor, eval_metric_fn=metric_fn,
                save_every_n_steps=args.save_every_n_steps,
                save_argmax_ckpt_by_metrics=["accuracy"])
    metrics = metric_fn(evaluate, predictor.predict(evaluate, args.per_device_batch_size,
                                                    trainer.params))
    deployer.log_info(f"held-out preference accuracy {metrics['accuracy']:.3f}, margin "
                      f"{metrics['margin']:.3f}")
    runner.save_trained(trainer, model, args.model)  # workdir/model, with the tokenizer
    return metrics


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    runner.add_arguments(parser)  # --model --train --eval --max_steps --lora_rank ...
    parser.add_argument("--max_len", type=int, default=512, help="tokens per reply, prompt "
                        "included")
    parser.add_argument("--beta", type=float, default=0.1)
    parser.add_argument("--label_smoothing", type=float, default=0.0)
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
