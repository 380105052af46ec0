"""Direct preference optimisation (DPO) through the three functions, and ``redco zoo run dpo``.

An example is a preference pair: a prompt (a chat) and two replies to it, ``chosen`` and
``rejected``, each rendered with the tokenizer's chat template, only the reply's tokens counted
(``redco_zoo_sft.chat``). Both replies go through the model in one forward pass. A reply's
log-probability under the policy less its log-probability under the reference, times ``beta``,
is its implicit reward; the loss is ``-log sigmoid(r_chosen - r_rejected)``, and with label
smoothing ``eps`` the same with the labels flipped weighs ``eps`` (conservative DPO).

The reference is the model before training. With LoRA adapters it is the same params with the
adapters zeroed (no second copy of the weights, and no gradient through it). Without, each
pair's reference log-probabilities are computed once before training by a ``Predictor`` pass
(``add_reference_logps``) and carried in the examples (``ref_logps``).

``pred_fn`` gives each pair's two rewards; ``metric_fn`` the preference accuracy (how often the
chosen reply's reward is the larger), the mean margin and the mean rewards.
"""
from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from redco.lora import trainable_mask, without_adapters
from redco.protocols import UsageError
from redco_zoo_dpo.plugin import DESCRIPTION
from redco_zoo_models import flags, runner, split_model
from redco_zoo_models.settings import RunConfig
from redco_zoo_sft.chat import render_chat, template_kwargs_arg
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


def reply_logps(apply_fn, params, batch) -> jax.Array:
    """(B, 2): the log-probability of each pair's two replies (their counted tokens)."""
    ids = batch["input_ids"].reshape(-1, batch["input_ids"].shape[-1])  # one forward pass
    counted = batch["loss_mask"].reshape(ids.shape)[:, 1:]
    logits = apply_fn(params, ids[:, :-1]).astype(jnp.float32)
    logps = jnp.take_along_axis(jax.nn.log_softmax(logits), ids[:, 1:, None], -1)[..., 0]
    return (logps * counted).sum(-1).reshape(-1, 2)


def rewards(apply_fn, params, batch, beta: float) -> jax.Array:
    """(B, 2): ``beta`` x (policy - reference) log-probability of each pair's two replies."""
    if "ref_logps" in batch:
        reference = batch["ref_logps"]
    else:
        if not any(jax.tree.leaves(trainable_mask(params))):
            raise UsageError("DPO without LoRA adapters needs the reference log-probabilities in "
                             "the examples: call add_reference_logps before training.")
        base = jax.lax.stop_gradient(without_adapters(params))
        reference = reply_logps(apply_fn, base, batch)
    return beta * (reply_logps(apply_fn, params, batch) - reference)


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


def render_pair(tokenizer, row: dict, max_len: int, where: str,
                template_kwargs: dict | None = None) -> dict:
    """A row's ``prompt`` (messages) with its ``chosen`` and ``rejected`` replies rendered
    (``template_kwargs``: the chat template's own variables)."""
    missing = [key for key in ("prompt", "chosen", "rejected") if key not in row]
    if missing:
        raise UsageError(f"{where} has no {' or '.join(missing)} (its keys: {sorted(row)}): each "
                         "row needs 'prompt' (a list of chat messages), 'chosen' and 'rejected' "
                         "(the preferred and the dispreferred reply, as text).")
    chosen, rejected = row["chosen"], row["rejected"]
    if chosen == rejected:
        raise UsageError(f"{where}: chosen and rejected are the same reply, which teaches "
                         "nothing; drop the pair or fix it.")
    prompt = row["prompt"]
    return {name: render_chat(tokenizer, prompt + [{"role": "assistant", "content": reply}],
                              max_len, f"{where} ({name})", learn_from=len(prompt),
                              template_kwargs=template_kwargs)
            for name, reply in (("chosen", chosen), ("rejected", rejected))}


def add_reference_logps(trainer, model, examples: list[list[dict]],
                        per_device_batch_size: int) -> None:
    """Give each example of each list its replies' log-probabilities under the params as they
    are now (before training): ``ref_logps``."""
    predictor = trainer.get_default_predictor(
        lambda rng, params, batch: reply_logps(split_model(model)[0], params, batch))
    for part in examples:
        for example, logps in zip(part, predictor.predict(part, per_device_batch_size,
                                                          trainer.params)):
            example["ref_logps"] = np.asarray(logps, np.float32)


@dataclasses.dataclass(frozen=True)
class DPOSettings:
    """A DPO run's own settings (``RunConfig.task``): tokens per reply (prompt included), the
    loss's ``beta`` and ``label_smoothing``, the chat template's own variables."""
    max_len: int = 512
    beta: float = 0.1
    label_smoothing: float = 0.0
    chat_template_kwargs: dict | None = None


class DPOPipeline:
    description = DESCRIPTION

    def add_arguments(self, parser) -> None:
        flags.add_arguments(parser)
        flags.add_training_levers(parser)
        parser.add_argument("--max_len", type=int, default=DPOSettings.max_len,
                            help="tokens per reply, prompt included")
        parser.add_argument("--beta", type=float, default=DPOSettings.beta)
        parser.add_argument("--label_smoothing", type=float, default=DPOSettings.label_smoothing)
        parser.add_argument("--chat_template_kwargs", type=template_kwargs_arg, default=None,
                            help="a JSON object of the chat template's own variables, e.g. "
                            "'{\"enable_thinking\": false}' (Qwen3: the empty <think> block "
                            "before each reply is the prompt's, not counted)")

    def run(self, args):
        return train_dpo(RunConfig.of_flags(args, DPOSettings))


def train_dpo(config: RunConfig[DPOSettings]):
    """The whole DPO run of ``config``; returns the trainer."""
    dpo, source, batch_size = config.task, config.source, config.loop.per_device_batch_size
    tokenizer = load_chat_tokenizer(source.model)
    model, _ = runner.load_source(source, config.jax_seed)
    train, evaluate = ([render_pair(tokenizer, row, dpo.max_len, f"{what} row {i}",
                                    dpo.chat_template_kwargs)
                        for i, row in enumerate(part)]
                       for part, what in zip(runner.split_eval(config.data), ("--train", "--eval")))
    return runner.train_and_eval(
        config, model, (train, evaluate), partial(collate_fn, max_len=dpo.max_len),
        partial(loss_fn, beta=dpo.beta, label_smoothing=dpo.label_smoothing),
        pred_fn=partial(pred_fn, model=model, beta=dpo.beta), metric_fn=metric_fn,
        best_metric="accuracy", before_fit=None if config.lora.rank else lambda t:
        add_reference_logps(t, model, [train, evaluate], batch_size))
