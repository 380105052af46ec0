"""{{project_name}}: causal language modelling (pre-training or fine-tuning) with Redco.

    python main.py --model tinyllama --train corpus.txt --prompt "Once upon a time"
    python main.py --model tinyllama --train corpus.txt --lora_rank 8   # LoRA: adapters only
    redco tokenize corpus.txt --tokenizer tokenizer.json --out corpus.bin   # a token file
    python main.py --model llama-1b --from_scratch --train corpus.bin --max_steps 1000

``--model`` is a local HuggingFace LLaMA, Mistral, Qwen2 or GPT-2 directory (config.json,
model.safetensors, tokenizer.json), or with ``--from_scratch`` a directory with config.json
alone or a preset (``llama-1b``, ...): an untrained model. ``--train`` is a ``.txt`` file (one
document per line) or a ``.jsonl``/``.json``/``.csv`` file with a ``text`` column, cut into
blocks; or token files, read from disk as training goes, their documents packed into rows: a
``.bin`` file, a folder of them, or a mixture (``web.bin=0.7,books/=0.3``). ``--max_steps``
trains that many updates instead of ``--n_epochs``. The three functions come from
``redco_zoo_lm/pipeline.py``, the code ``redco zoo run lm`` runs: to change one, copy it from
there into this file in place of its import. ``Deployer`` and ``Trainer`` take care of devices,
sharding (``--n_model_shards``), checkpoints (rerun to resume) and logs in ``--workdir``. With
``--lora_rank`` only low-rank adapters on the attention and MLP projections train;
``--workdir``/model is then the merged model and ``--workdir``/adapter the adapters alone
(PEFT's layout)."""
import argparse
import math
from functools import partial

import numpy as np
import optax

from redco import Deployer, Trainer
from redco_zoo_lm.pipeline import add_lm_arguments, collate_fn, lm_examples, load_lm, loss_fn, pred_fn
from redco_zoo_lm.settings import LMData
from redco_zoo_models import moe_optimizer, runner
from redco_zoo_models.settings import RunConfig


def main(args):
    config = RunConfig.of_flags(args, LMData, strict=False)  # typed; --prompt ... are ours
    loop, model_dir, tokenizer_file = config.loop, config.source.model, config.task.tokenizer
    model, model_config = load_lm(config)  # --model, or --from_scratch
    train, evaluate = lm_examples(config, model_config)  # text blocks, or token files' rows

    deployer = Deployer(jax_seed=config.jax_seed, n_model_shards=config.layout.n_model_shards,
                        workdir=config.workdir, device_memory=config.layout.device_memory)
    apply_fn, params, trainable = runner.split_for_training(
        model, config.lora, config.jax_seed, deployer)  # --lora_rank
    n_epochs, lr = runner.n_epochs_and_schedule(
        loop, config.optimizer, deployer, len(train))  # or --max_steps
    optimizer = moe_optimizer(optax.adamw(lr), model)  # (an MoE bias: balancing.py)
    trainer = Trainer(deployer, collate_fn, apply_fn, loss_fn, params, optimizer,
                      lr_schedule_fn=lr, trainable=trainable)
    trainer.fit(train, loop.per_device_batch_size, n_epochs, max_steps=loop.max_steps,
                eval_examples=evaluate, save_every_n_steps=loop.save_every_n_steps,
                save_argmin_ckpt_by_metrics=["loss"])
    perplexity = math.exp(trainer.eval_loss(evaluate, loop.per_device_batch_size))
    deployer.log_info(f"eval perplexity {perplexity:.3f}")
    runner.save_trained(trainer, model, model_dir, tokenizer_file)  # workdir/model (HF)
    if not args.prompt:
        return perplexity, {}

    tokenizer = runner.load_tokenizer(tokenizer_file or model_dir)
    predictor = trainer.get_default_predictor(
        partial(pred_fn, model=model, max_new_tokens=args.max_new_tokens,
                temperature=args.temperature),
        output_fn=lambda ids: tokenizer.decode_batch(np.asarray(ids).tolist()))
    samples = {}
    for prompt in args.prompt or ():  # one at a time: prompts differ in length
        [samples[prompt]] = predictor.predict([{"token_ids": tokenizer.encode(prompt).ids}], 1,
                                              trainer.params)
        deployer.log_info(f"{prompt!r} -> {samples[prompt]!r}")
    return perplexity, samples


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_lm_arguments(parser)  # --model --train --eval --max_steps --lora_rank --block_size ...
    parser.add_argument("--prompt", action="append", help="after training, continue this text "
                        "(repeat the flag for more prompts)")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8)
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
