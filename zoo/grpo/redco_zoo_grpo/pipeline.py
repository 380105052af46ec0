"""GRPO through the three functions, and ``redco zoo run grpo`` on a file of prompts rewarded by
a Python function.

``collate_fn`` stacks the samples of a round (``rollout.py``), ``loss_fn`` is GRPO's clipped
loss with its KL penalty and its average (``loss.py``), ``pred_fn`` the sampler: G completions
of each prompt with their log-probabilities.

``--train`` rows hold a prompt (``--prompt_column``: a list of ``{"role", "content"}``
messages, or a string, one user message) and whatever columns the reward function reads (the
built-in ``exact_match`` reads ``answer``). Each round samples ``--n_samples`` completions of
``--prompts_per_round`` prompts and trains ``--n_updates`` epochs over them (``rollout.py``);
the greedy reward on ``--eval`` (or the last 5% of ``--train``) is logged before the first round,
every ``--eval_every_n_rounds`` and after the last. A step checkpoint is written every
``--save_every_n_steps`` updates (at the end of the round that reaches it), on SIGTERM (which
then exits 143) and at the end; a rerun of the same command resumes at the round after the newest.
``--max_steps`` caps the rounds (a multiple of a round's updates). ``--environment NAME``
makes each completion a multi-turn episode with that environment, which rewards it
(``multiturn.py``, ``environments.py``), of ``--max_turns`` model turns at most. Prompts whose
messages hold image parts run on an image + text model (LLaVA, Gemma 3, Qwen2.5-VL, Qwen3-VL,
Qwen3.5), each prompt with its images (``image_prompts.py``).
``--rollout_devices N`` samples on the last N devices (with P processes the last N / P of
each), ahead of the updates (``async_rollouts.py``); ``auto`` plans N from the compiled
rollout and update before the model is loaded (``auto_split.py``, ``rollout_split.py``; with
several processes once they joined, N a multiple of them).
"""
from __future__ import annotations

import argparse
import dataclasses
from functools import partial

import jax
import numpy as np
import optax

from redco import Deployer, Trainer
from redco.protocols import UsageError
from redco_zoo_grpo import auto_split, image_prompts
from redco_zoo_grpo.async_rollouts import (
    AsyncConfig,
    check_async,
    joins_processes,
    rollout_devices,
    training_devices,
)
from redco_zoo_grpo.environments import load_environment
from redco_zoo_grpo.loss import LOSS_TYPES, average, token_logps_and_experts, token_losses
from redco_zoo_grpo.multiturn import MultiTurnGRPO, check_max_turns
from redco_zoo_grpo.plugin import DESCRIPTION
from redco_zoo_grpo.rewards import BUILT_IN, load_reward_fn
from redco_zoo_grpo.rollout import GRPO, GRPOConfig, left_pad
from redco_zoo_models import flags, generate, moe_optimizer, runner
from redco_zoo_models.decode_layout import model_shard_degrees
from redco_zoo_models.metrics import with_experts
from redco_zoo_models.settings import Loop, RunConfig, check_config
from redco_zoo_sft.chat import render_prompt, template_kwargs_arg
from redco_zoo_sft.image_chat import load_processor
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
    per_token = token_losses(logps, batch, clip_low, clip_high, beta,
                             sequence=loss_type == "gspo")
    return with_experts(average(per_token, batch["completion_mask"], loss_type), experts)


def pred_fn(rng, params, batch, model, n_samples: int = 1, **sampling):
    """``n_samples`` completions of each prompt and their log-probabilities, (B, G, N) each
    (``sampling``: ``generate``'s keywords); the rng folds in the batch's ``round``, so every
    round draws afresh. Image prompts' ``pixel_values`` (B, K, 3, H, W), K images each, are
    placed in order over the rows' image tokens."""
    images = None if "pixel_values" not in batch else {"pixel_values": batch["pixel_values"].reshape(
        -1, *batch["pixel_values"].shape[2:])}
    tokens, logps = generate(model, params, batch["prompt_ids"], prompt_mask=batch["prompt_mask"],
                             rng=jax.random.fold_in(rng, batch["round"][0]),
                             return_logprobs=True, num_samples=n_samples, encoder_inputs=images,
                             **sampling)
    shape = (batch["prompt_ids"].shape[0], n_samples, -1)
    return {"tokens": tokens.reshape(shape), "logps": logps.reshape(shape)}


def prompt_examples(tokenizer, parts: tuple[list, list], column: str, max_len: int,
                    template_kwargs: dict | None = None) -> tuple[tuple[list, list], ...]:
    """``(prompts, rows)`` of each part: its prompts rendered (``render_prompt``, with
    ``template_kwargs``), all left-padded to the longest."""
    rendered = [[render_prompt(tokenizer, row[column], max_len, f"{what} row {i}", template_kwargs)
                 for i, row in enumerate(rows)]
                for rows, what in zip(parts, ("--train", "--eval (or the last 5% of --train)"))]
    width = max(len(ids) for part in rendered for ids in part)
    return tuple((left_pad(ids, width, tokenizer.pad_token_id or 0), rows)
                 for ids, rows in zip(rendered, parts))


@dataclasses.dataclass(frozen=True)
class GRPORun:
    """A GRPO run's own settings (``RunConfig.task``): the prompts (``prompt_column``, rendered
    to at most ``max_prompt_len`` tokens with the chat template's ``chat_template_kwargs``), the
    ``reward`` function, what is sampled and how the loss weighs it (``algorithm``), and the
    rounds: ``prompts_per_round`` prompts each, ``n_rounds`` of them (None: ``n_epochs``
    passes over the prompts), an evaluation every ``eval_every_n_rounds``; rollouts on the
    engine with ``engine_rows`` sequences at once (0: ``pred_fn``'s fixed-batch sampler), decoding
    on ``decode_model_shards``' layout (a tensor-parallel degree, ``"auto"``, or None: the
    training layout; ``redco_zoo_models.decode_layout``); with ``asynchronous.rollout_devices``
    on devices of their own, ahead of the updates (``async_rollouts.py``)."""
    prompt_column: str = "prompt"
    reward: str = "exact_match"
    max_prompt_len: int = 256
    chat_template_kwargs: dict | None = None
    algorithm: GRPOConfig = GRPOConfig()
    prompts_per_round: int = 16
    engine_rows: int = 32
    decode_model_shards: int | str | None = "auto"
    n_rounds: int | None = None
    eval_every_n_rounds: int = 10
    environment: str | None = None
    max_turns: int = 3
    asynchronous: AsyncConfig = AsyncConfig()


def add_switch(add, name: str, help: str) -> None:
    """``--name`` and ``--no_name`` setting ``name`` to True or False (None when neither is
    given: the loss's default)."""
    add(f"--{name}", dest=name, action="store_const", const=True, default=None, help=help)
    add(f"--no_{name}", dest=name, action="store_const", const=False, help=f"turn --{name} off")


def add_grpo_arguments(parser) -> None:
    """GRPO's own flags (``GRPORun``'s, its ``GRPOConfig``'s among them)."""
    add, run, algo = parser.add_argument, GRPORun, GRPOConfig
    add("--prompt_column", default=run.prompt_column)
    add("--reward", default=run.reward, help="the reward function: a built-in ("
        + ", ".join(BUILT_IN) + "), module:function or path/to/file.py:function")
    add("--max_prompt_len", type=int, default=run.max_prompt_len, help="tokens of a rendered prompt, at most")
    add("--chat_template_kwargs", type=template_kwargs_arg, default=None, help="a JSON object of "
        "the chat template's own variables, e.g. '{\"enable_thinking\": false}' (Qwen3: prompts "
        "end with an empty <think> block, so the model answers without reasoning)")
    add("--n_samples", type=int, default=algo.n_samples, help="completions per prompt (G)")
    add("--max_new_tokens", type=int, default=algo.max_new_tokens)
    add("--temperature", type=float, default=algo.temperature)
    add("--top_k", type=int, default=algo.top_k)
    add("--top_p", type=float, default=algo.top_p)
    add("--loss_type", "--loss", choices=LOSS_TYPES, default=algo.loss_type, help="the loss "
        "(loss.py; one flag, two names): dapo also turns on dynamic sampling and overlong "
        "filtering, gspo clips its sequence ratio to 1 +- 3e-4/4e-4 (config.py's table)")
    add("--clip_low", type=float, default=algo.clip_low, help="default: the --loss's")
    add("--clip_high", type=float, default=algo.clip_high, help="default: the --loss's (DAPO's "
        "clip-higher 0.28)")
    add_switch(add, "dynamic_sampling", "DAPO's: drop groups whose rewards are all equal, draw "
               "more prompts (default: on under dapo)")
    add("--max_sampling_draws", type=int, default=algo.max_sampling_draws, help="dynamic "
        "sampling's draws of --prompts_per_round prompts a round, at most")
    add_switch(add, "overlong_filter", "DAPO's: completions cut at --max_new_tokens count for "
               "nothing (default: on under dapo)")
    add("--overlong_buffer", type=int, default=algo.overlong_buffer, help="DAPO's soft overlong "
        "punishment over the last this many tokens: down to -1 at --max_new_tokens (0: off)")
    add("--beta", type=float, default=algo.beta, help="weight of the KL penalty to the "
        "reference")
    add("--n_updates", type=int, default=algo.n_updates, help="epochs over each round's "
        "samples (mu)")
    add("--prompts_per_round", type=int, default=run.prompts_per_round)
    add("--engine_rows", type=int, default=run.engine_rows, help="rollouts on the "
        "continuous-batching engine with this many sequences at once (redco_zoo_models.engine); "
        "0: pred_fn's fixed-batch sampler")
    add("--decode_model_shards", type=decode_degree, default=run.decode_model_shards,
        help="the engine's decode layout: a tensor-parallel degree (the other devices "
        "replicas), auto (the smallest whose compiled decode step fits a device; 1 where "
        "devices report no memory), or train (the training layout: under FSDP each decode step "
        "gathers the weights again)")
    add("--n_rounds", type=int, help="default: --n_epochs passes over the prompts")
    add("--eval_every_n_rounds", type=int, default=run.eval_every_n_rounds)
    add("--environment", default=None, help="multi-turn rollouts with this environment (a "
        "registered plugin; built-in: calculator), rewarded by it (--reward unused): "
        "multiturn.py; sampled by pred_fn's sampler, not the engine")
    add("--max_turns", type=int, default=run.max_turns, help="--environment: the model's turns "
        "in an episode, at most (--max_new_tokens bounds all its tokens, the environment's too)")
    add("--rollout_devices", type=rollout_count, default=0, help="the last N devices sample "
        "the rollouts (the engine, on a decode layout of their own) while the others train; the "
        "params reach them device to device after each update (0: rollouts on the training "
        "devices): async_rollouts.py. auto: N and the decode layout with the least estimated "
        "round time whose compiled rollout and update fit (rollout_split.py; needs "
        "redco-planner, and --device_memory where devices report none)")
    add("--device_memory", help="one device's memory for --rollout_devices auto, e.g. 80GB "
        "(read from the device on GPUs and TPUs)")
    add("--max_off_policy_steps", type=int, default=0, help="with --rollout_devices: rollouts "
        "run this many rounds ahead of the updates, on params this many updates old (0: "
        "on-policy)")
    add("--is_cap", type=float, default=AsyncConfig.is_cap, help="with --rollout_devices: "
        "the truncated importance-sampling weights' cap (TIS, Yao et al. 2025)")


def rollout_count(text: str) -> int | str:
    """``--rollout_devices``: ``auto`` or a number of devices (0 or more)."""
    if text == "auto":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: give auto or a number of devices (0: "
                                         "rollouts on the training devices)")
    return int(text)


def decode_degree(text: str) -> int | str | None:
    """``--decode_model_shards``: ``auto``, ``train`` (None: the training layout) or a
    positive integer."""
    if text in ("auto", "train"):
        return None if text == "train" else text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give auto, train or a positive integer "
                                         "(a tensor-parallel degree dividing the devices)")
    return int(text)


def check_decode_degree(degree: int | str | None) -> None:
    """Refuse a decode degree that does not divide the devices, before anything loads."""
    if isinstance(degree, int) and jax.device_count() % degree:
        raise UsageError(f"--decode_model_shards {degree} does not divide the "
                         f"{jax.device_count()} devices: use one of "
                         f"{model_shard_degrees(jax.device_count())}, auto or train.")


def check_context(model, prompt_width: int, max_new_tokens: int) -> None:
    """Refuse prompts plus completions longer than a model with learned positions has."""
    limit = getattr(getattr(model, "cfg", None), "n_positions", None)
    if limit is not None and prompt_width + max_new_tokens > limit:
        raise UsageError(f"The longest prompt ({prompt_width} tokens) plus --max_new_tokens "
                         f"{max_new_tokens} exceeds the model's {limit} positions (n_positions): "
                         "lower --max_new_tokens or --max_prompt_len.")


def rounds_of(run: GRPORun, loop: Loop, deployer: Deployer, n_prompts: int) -> int:
    """How many rounds to run; refused early where a round's samples fill no minibatch."""
    n_rounds = run.n_rounds or loop.n_epochs * n_prompts // run.prompts_per_round
    n_samples = run.prompts_per_round * run.algorithm.n_samples
    minibatch = deployer.get_global_batch_size(loop.per_device_batch_size)
    if n_samples % minibatch or n_rounds < 1:
        raise UsageError(
            f"A round's {run.prompts_per_round} prompts x {run.algorithm.n_samples} samples must "
            f"split into minibatches of {minibatch} "
            f"(--per_device_batch_size x {deployer.dp_size} data-parallel devices), and there "
            f"must be a round (got {n_rounds}): change --prompts_per_round or "
            "--per_device_batch_size, or give --n_rounds.")
    if loop.max_steps is not None:  # whole rounds of the same number of updates each
        per_round = n_samples // minibatch * run.algorithm.n_updates
        if loop.max_steps % per_round:
            raise UsageError(f"--max_steps {loop.max_steps}: GRPO trains whole rounds of "
                             f"{per_round} updates each; give a multiple of {per_round}, or "
                             "--n_rounds.")
        n_rounds = min(n_rounds, loop.max_steps // per_round)
    return n_rounds


def load_prompts(config: RunConfig[GRPORun]) -> tuple:
    """``(tokenizer, prompts, held_out, images)``: ``prompt_examples``' of the run's data
    (``image_prompts.prompt_examples``' where a prompt holds an image: ``images`` True)."""
    run, model = config.task, config.source.model
    parts = runner.split_eval(config.data, {"--prompt_column": run.prompt_column})
    if not image_prompts.hold_images(parts, run.prompt_column):
        tokenizer = load_chat_tokenizer(model)
        return (tokenizer, *prompt_examples(tokenizer, parts, run.prompt_column,
                                            run.max_prompt_len, run.chat_template_kwargs), False)
    image_prompts.check_run(run)
    processor = load_processor(model)
    return (processor.tokenizer, *image_prompts.prompt_examples(
        processor, parts, run.prompt_column, run.max_prompt_len, run.chat_template_kwargs), True)


def deployer_of(config: RunConfig[GRPORun], join: auto_split.AfterJoin | None) -> tuple:
    """The trainer's ``Deployer`` (on the devices the rollouts leave) and ``config``, with
    ``join``'s split where it plans once the processes joined (logged)."""
    n = config.task.asynchronous.rollout_devices
    deployer = runner.deployer_of(config, devices=join or (training_devices(n) if n else None))
    if join is None:
        return deployer, config
    if join.said:  # (process 0's: it planned)
        deployer.log_info("\n".join(join.said))
    return deployer, join.config


def refuse_early(config: RunConfig[GRPORun]) -> None:
    """What a GRPO run cannot do, refused before anything loads."""
    check_config(config, "train")
    run = config.task
    if config.layout.n_model_shards == "auto":
        raise UsageError("--n_model_shards auto: a GRPO run sizes its rounds by the data-parallel "
                         "size before anything trains, so the layout planner cannot pick it yet; "
                         "give a number of devices.")
    check_async(run.asynchronous, run.engine_rows, run.environment, run.decode_model_shards)
    n_rollout = run.asynchronous.rollout_devices
    if not joins_processes():  # (with several, devices are unknown until they join: checked
        check_decode_degree(run.decode_model_shards)  # by the meshes then)
        if n_rollout not in (0, "auto"):
            rollout_devices(n_rollout)
    check_max_turns(run.max_turns)


def make_grpo(config: RunConfig[GRPORun], model, tokenizer, deployer: Deployer, n_rounds: int,
              make_env, reward_fn):
    """The trainer (LoRA or full, the model's own rules) and its GRPO loop, single- or
    multi-turn."""
    run, loop, seed, algorithm = config.task, config.loop, config.jax_seed, config.task.algorithm
    apply_fn, params, trainable = runner.split_for_training(model, config.lora, seed, deployer)
    lr = deployer.get_lr_schedule_fn(n_rounds * run.prompts_per_round * algorithm.n_samples,
                                     loop.per_device_batch_size, algorithm.n_updates,
                                     config.optimizer.learning_rate,
                                     warmup_rate=config.optimizer.warmup_rate)
    optimizer = moe_optimizer(optax.adamw(lr), model)  # (an MoE bias: balancing.py)
    trainer = Trainer(deployer, collate_fn, apply_fn, partial(loss_fn, **algorithm.loss_kwargs()),
                      params, optimizer, lr_schedule_fn=lr, trainable=trainable,
                      params_sharding_rules=runner.params_rules(model, params, deployer))
    if make_env:
        return MultiTurnGRPO(trainer, model, tokenizer, pred_fn, reward_fn, algorithm,
                             loop.per_device_batch_size, make_env=make_env,
                             max_turns=run.max_turns)
    return GRPO(trainer, model, tokenizer, pred_fn, reward_fn, algorithm,
                loop.per_device_batch_size, run.engine_rows, run.decode_model_shards,
                run.asynchronous)


def train(config: RunConfig[GRPORun]) -> list[float]:
    """The whole run; returns the greedy held-out rewards (before, during and after)."""
    refuse_early(config)
    source, seed = config.source, config.jax_seed
    make_env = config.task.environment and load_environment(config.task.environment)
    reward_fn = load_reward_fn(config.task.reward)
    tokenizer, prompts, held_out, images = load_prompts(config)
    prompt_width = len(prompts[0][0]["prompt_ids"])
    # auto: planned here, or with several processes once they joined (auto_split.AfterJoin)
    join = auto_split.AfterJoin(config, prompt_width, loss_fn) \
        if config.task.asynchronous.rollout_devices == "auto" and joins_processes() else None
    config = config if join else auto_split.planned(config, prompt_width, loss_fn)
    run, algorithm = config.task, config.task.algorithm
    model, _ = runner.load_source(runner.decoding(source), seed)
    if images:
        image_prompts.check_model(model, source.model, prompts[0], run.engine_rows)
        image_prompts.fit_to_model(model, [prompts[0], held_out[0]])
    turns_context = algorithm.max_new_tokens if make_env else 0  # a turn's context: the trajectory
    check_context(model, prompt_width + turns_context, algorithm.max_new_tokens)
    deployer, config = deployer_of(config, join)
    run = config.task
    n_rounds = rounds_of(run, config.loop, deployer, len(prompts[0]))
    grpo = make_grpo(config, model, tokenizer, deployer, n_rounds, make_env, reward_fn)
    rewards = grpo.train(prompts, held_out, run.prompt_column, n_rounds, run.prompts_per_round,
                         run.eval_every_n_rounds, seed,
                         save_every_n_steps=config.loop.save_every_n_steps)
    runner.save_trained(grpo.trainer, model, source.model)
    return rewards


class GRPOPipeline:
    description = DESCRIPTION

    def add_arguments(self, parser) -> None:
        flags.add_arguments(parser, planner=False)
        add_grpo_arguments(parser)

    def run(self, args) -> float:
        return train(RunConfig.of_flags(args, GRPORun))[-1]
