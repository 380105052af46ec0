"""{{project_name}}: supervised fine-tuning on chats with Redco.

    python main.py --model my-llama --train chats.jsonl --prompt "x3"
    python main.py --model my-llama --train chats.jsonl --lora_rank 8   # LoRA: adapters only

``--model`` is a local HuggingFace LLaMA, Mistral, Qwen2 or GPT-2 directory whose tokenizer has
a chat template (``tokenizer_config.json``'s ``chat_template``); ``--train`` is a ``.jsonl``
file of chats: a ``messages`` list of ``{"role", "content"}`` per row. Each chat is rendered
with the tokenizer's own template, the assistant's tokens are the only targets, and chats are
packed into rows of ``--max_len`` tokens (``redco_zoo_sft/chat.py``). The three functions come
from ``redco_zoo_sft/pipeline.py``, the code ``redco zoo run sft`` runs: to change one, copy it
from there into this file in place of its import. ``Deployer`` and ``Trainer`` take care of
devices, sharding (``--n_model_shards``), checkpoints (rerun to resume) and logs in
``--workdir``."""
import argparse

import numpy as np
import optax

from redco import Deployer, Trainer
from redco_zoo_models import flags, moe_optimizer, runner
from redco_zoo_models.settings import RunConfig
from redco_zoo_sft.pipeline import SFTData, chat_rows, collate_fn, load_chat_tokenizer, loss_fn, pred_fn


def main(args):
    config = RunConfig.of_flags(args, SFTData, strict=False)  # typed; --prompt ... are ours
    loop, source, seed = config.loop, config.source, config.jax_seed
    tokenizer = load_chat_tokenizer(source.model)  # with its chat template
    model, _ = runner.load_source(source, seed)
    train, evaluate = (chat_rows(rows, tokenizer, config.task, seed, what) for rows, what in zip(
        runner.split_eval(config.data, {"--messages_column": config.task.messages_column}),
        ("--train", "--eval (or the last 5% of --train)")))  # rendered, masked, packed

    deployer = Deployer(jax_seed=seed, n_model_shards=config.layout.n_model_shards,
                        workdir=config.workdir, device_memory=config.layout.device_memory)
    apply_fn, params, trainable = runner.split_for_training(
        model, config.lora, seed, deployer)  # --lora_rank
    n_epochs, lr = runner.n_epochs_and_schedule(
        loop, config.optimizer, deployer, len(train))  # or --max_steps
    optimizer = moe_optimizer(optax.adamw(lr), model)  # (an MoE bias: balancing.py)
    trainer = Trainer(deployer, collate_fn, apply_fn, loss_fn, params, optimizer,
                      lr_schedule_fn=lr, trainable=trainable)
    trainer.fit(train, loop.per_device_batch_size, n_epochs, max_steps=loop.max_steps,
                eval_examples=evaluate, save_every_n_steps=loop.save_every_n_steps,
                save_argmin_ckpt_by_metrics=["loss"])
    loss = trainer.eval_loss(evaluate, loop.per_device_batch_size)
    deployer.log_info(f"eval loss on the assistant's tokens {loss:.4f}")
    runner.save_trained(trainer, model, source.model)  # workdir/model, with the tokenizer

    predictor = trainer.get_default_predictor(
        lambda rng, params, batch: pred_fn(rng, params, batch, model, args.max_new_tokens),
        output_fn=lambda ids: [tokenizer.decode(row, skip_special_tokens=True).strip()
                               for row in np.asarray(ids).tolist()])
    replies = {}
    for prompt in args.prompt or ():  # one at a time: prompts differ in length
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                             add_generation_prompt=True, tokenize=False)
        ids = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], np.int32)
        prompt_row = {"token_ids": ids, "segment_ids": np.ones_like(ids),
                      "loss_mask": np.zeros(len(ids), bool)}  # one chat, nothing to learn
        [replies[prompt]] = predictor.predict([prompt_row], 1, trainer.params)
        deployer.log_info(f"{prompt!r} -> {replies[prompt]!r}")
    return loss, replies


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    flags.add_arguments(parser)  # --model --train --eval --max_steps --lora_rank ...
    parser.add_argument("--messages_column", default=SFTData.messages_column)
    parser.add_argument("--max_len", type=int, default=SFTData.max_len, help="tokens per packed "
                        "row")
    parser.add_argument("--prompt", action="append", help="after training, the assistant's "
                        "reply to this user message (repeat the flag for more)")
    parser.add_argument("--max_new_tokens", type=int, default=16)
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
