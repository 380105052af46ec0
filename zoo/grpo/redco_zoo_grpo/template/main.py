"""{{project_name}}: GRPO with verifiable rewards on a chat model, with Redco.

    python main.py --model my-sft-model --train prompts.jsonl --reward exact_match
    python main.py --model my-sft-model --train prompts.jsonl --reward rewards.py:my_reward \
        --loss_type dapo --clip_high 0.28 --lora_rank 16 --beta 0.04

``--model`` is a local HuggingFace LLaMA, Mistral, Qwen2 or GPT-2 directory whose tokenizer has
a chat template (typically an SFT run's ``workdir/model``); ``--train`` a ``.jsonl`` file of
prompts (``prompt``: messages or a string) with the columns the reward function reads. Each
round samples ``--n_samples`` completions of ``--prompts_per_round`` prompts, scores them,
normalises the rewards within each prompt's group and trains ``--n_updates`` epochs over them.
The three functions are yours to change; see ``redco_zoo_grpo/loss.py`` for the loss's
pieces and ``redco_zoo_grpo/rollout.py`` for the rounds."""
import argparse
from functools import partial

import jax
import numpy as np
import optax

from redco import Deployer, Trainer
from redco.protocols import UsageError
from redco_zoo_grpo.loss import average, token_logps_and_experts, token_losses
from redco_zoo_grpo.pipeline import (
    add_grpo_arguments,
    check_context,
    config_of,
    prompt_examples,
    rounds_of,
)
from redco_zoo_grpo.rewards import load_reward_fn
from redco_zoo_grpo.rollout import GRPO
from redco_zoo_models import generate, runner
from redco_zoo_models.metrics import with_experts
from redco_zoo_sft.pipeline import load_chat_tokenizer


def collate_fn(examples: list[dict]) -> dict:
    """Examples (dicts of equally shaped arrays: prompts, or ``rollout.py``'s samples) -> one
    stacked array each."""
    return {key: np.stack([np.asarray(e[key]) for e in examples]) for key in examples[0]}


def loss_fn(rng, state, params, batch, is_training, loss_type: str = "grpo",
            temperature: float = 1.0, clip_low: float = 0.2, clip_high: float = 0.2,
            beta: float = 0.0):
    """Each completion token's clipped policy-ratio loss plus ``beta`` x its KL penalty,
    averaged as ``loss_type`` defines (``loss.py``); an MoE model's balancing losses added
    and its experts' metrics logged (``with_experts``)."""
    logps, experts = token_logps_and_experts(state.apply_fn, params, batch, temperature)
    per_token = token_losses(logps, batch, clip_low, clip_high, beta)
    return with_experts(average(per_token, batch["completion_mask"], loss_type), experts)


def pred_fn(rng, params, batch, model, n_samples: int = 1, **sampling):
    """``n_samples`` completions of each prompt and their log-probabilities, (B, G, N) each
    (``sampling``: ``generate``'s keywords); the rng folds in the batch's ``round``, so every
    round draws afresh."""
    tokens, logps = generate(model, params, batch["prompt_ids"], prompt_mask=batch["prompt_mask"],
                             rng=jax.random.fold_in(rng, batch["round"][0]),
                             return_logprobs=True, num_samples=n_samples, **sampling)
    shape = (batch["prompt_ids"].shape[0], n_samples, -1)
    return {"tokens": tokens.reshape(shape), "logps": logps.reshape(shape)}
def train(args) -> list[float]:
    """The whole run; returns the greedy held-out rewards (before, during and after)."""
    if args.n_model_shards == "auto":
        raise UsageError("--n_model_shards auto: a GRPO run sizes its rounds by the data-parallel "
                         "size before anything trains, so the layout planner cannot pick it yet; "
                         "give a number of devices.")
    tokenizer = load_chat_tokenizer(args.model)
    config, reward_fn = config_of(args), load_reward_fn(args.reward)
    model, _ = runner.load_model(args.model, args.from_scratch, args.jax_seed)
    prompts, held_out = prompt_examples(tokenizer, runner.split_eval(
        args, {"--prompt_column": args.prompt_column}), args.prompt_column, args.max_prompt_len,
        args.chat_template_kwargs)
    check_context(model, len(prompts[0][0]["prompt_ids"]), args.max_new_tokens)
    deployer = Deployer(jax_seed=args.jax_seed, n_model_shards=args.n_model_shards,
                        workdir=args.workdir)
    n_rounds = rounds_of(args, deployer, len(prompts[0]))
    apply_fn, params, trainable = runner.split_for_training(model, args, deployer)
    lr = deployer.get_lr_schedule_fn(n_rounds * args.prompts_per_round * args.n_samples,
                                     args.per_device_batch_size, args.n_updates,
                                     args.learning_rate, warmup_rate=args.warmup_rate)
    trainer = Trainer(deployer, collate_fn, apply_fn, partial(loss_fn, **config.loss_kwargs()),
                      params, optax.adamw(lr), lr_schedule_fn=lr, trainable=trainable)
    grpo = GRPO(trainer, model, tokenizer, pred_fn, reward_fn, config, args.per_device_batch_size,
                args.engine_rows)
    rewards = grpo.train(prompts, held_out, args.prompt_column, n_rounds, args.prompts_per_round,
                         args.eval_every_n_rounds, args.jax_seed,
                         save_every_n_steps=args.save_every_n_steps)
    runner.save_trained(trainer, model, args.model)
    return rewards


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    runner.add_arguments(parser, planner=False)  # --model --train --eval --lora_rank --learning_rate ...
    add_grpo_arguments(parser)  # --reward --n_samples --loss_type --beta --n_updates ...
    return parser.parse_args(argv)


if __name__ == "__main__":
    train(parse_args())
