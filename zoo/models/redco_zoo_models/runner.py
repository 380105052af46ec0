"""What every zoo pipeline's command line shares: the usual flags, local data through
``datasets``, local tokenizers, and the run (``Deployer`` + ``Trainer`` + ``Predictor``, then
the trained model saved as a HuggingFace directory)."""
from __future__ import annotations

import argparse
import json
import os
import shutil
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from redco import Deployer, Trainer
from redco.checkpointing import host_tree
from redco.lora import DEFAULT_TARGETS, n_params, trainable_mask
from redco.protocols import UsageError
from redco_zoo_models import expert_parallel
from redco_zoo_models.balancing import moe_optimizer
from redco_zoo_models.hf import auto_class, class_of, from_pretrained, save_pretrained
from redco_zoo_models.llama import LLAMA_PRESETS, LlamaConfig
from redco_zoo_models.lora import add_lora, has_lora, save_peft_adapters
from redco_zoo_models.nnx_utils import split_model
from redco_zoo_models.presets import PRESETS, preset

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "preprocessor_config.json",
                   "generation_config.json")  # (the source's sampling defaults and stop ids)
DATA_KINDS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".txt": "text"}


def add_arguments(parser: argparse.ArgumentParser, planner: bool = True) -> None:
    """The flags every pipeline takes (``planner``: one that lets the layout planner pick
    ``--n_model_shards``, and takes ``--device_memory`` for it)."""
    parser.add_argument("--model", required=True, help="a local HuggingFace model directory "
                        "(config.json, model.safetensors, tokenizer.json); with --from_scratch "
                        "its config.json alone, or a preset by name: a published decoder ("
                        + ", ".join(PRESETS) + ") or a LLaMA shape ("
                        + ", ".join(LLAMA_PRESETS) + ")")
    parser.add_argument("--from_scratch", action="store_true", help="start from random weights "
                        "(of --model's config.json or preset) instead of trained ones")
    parser.add_argument("--train", required=True, help="training data: a .json, .jsonl, .csv or "
                        ".txt file, or a folder of images with metadata.jsonl")
    parser.add_argument("--eval", help="evaluation data (default: 5%% of --train)")
    parser.add_argument("--eval_steps", type=int, default=100, help="evaluate on at most this "
                        "many batches, the first of the evaluation data (a cut is said in the "
                        "log; 0: all of it)")
    parser.add_argument("--workdir", default="./workdir")
    auto = ", or auto: the layout planner picks it (and FSDP, remat) by compiling the step " \
        "(redco-planner)" if planner else ""
    parser.add_argument("--n_model_shards", type=model_shards, default=1, help="devices each "
                        "model is split over (tensor parallelism)" + auto)
    if planner:
        parser.add_argument("--device_memory", help="memory of one device for --n_model_shards "
                            "auto, e.g. 16GB (read from the device on GPUs and TPUs)")
    parser.add_argument("--per_device_batch_size", type=int, default=8)
    parser.add_argument("--n_epochs", type=int, default=2)
    parser.add_argument("--max_steps", type=int, help="train this many updates, across epochs "
                        "(instead of --n_epochs)")
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument("--warmup_rate", type=float, default=0.05)
    parser.add_argument("--save_every_n_steps", type=int)
    parser.add_argument("--jax_seed", type=int, default=42)
    parser.add_argument("--lora_rank", type=int, default=0, help="train LoRA adapters of this "
                        "rank on a frozen model (0: train the whole model)")
    parser.add_argument("--lora_alpha", type=float, default=16.0,
                        help="LoRA scale numerator: the adapters add (alpha / rank) * A @ B")
    parser.add_argument("--lora_targets", default=DEFAULT_TARGETS, help="regex selecting the "
                        "kernels to adapt (default: attention and MLP projections)")


def add_training_levers(parser: argparse.ArgumentParser) -> None:
    """The flags of what ``train_and_eval`` builds (a pipeline that trains through it)."""
    from redco.remat import POLICIES
    from redco.sequence_split import STRATEGIES
    parser.add_argument("--n_context_shards", type=int, default=1, help="split each sequence "
                        "over this many devices (context parallelism, for long rows)")
    parser.add_argument("--context_strategy", choices=STRATEGIES, default=STRATEGIES[0])
    parser.add_argument("--expert_parallel", action="store_true", help="split each MoE block's "
                        "experts over the data-parallel devices (expert parallelism): tokens "
                        "go to their experts' devices and back")
    parser.add_argument("--remat", choices=list(POLICIES), default="none", help="recompute "
                        "activations in the backward pass instead of keeping them (full: least "
                        "memory)")
    parser.add_argument("--compute_dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the dtype of the forward and backward pass (params stay float32)")
    parser.add_argument("--accumulate_grad_batches", type=int, default=1, help="micro-batches "
                        "summed into each update")
    parser.add_argument("--weight_decay", type=float, default=1e-4, help="AdamW's")
    parser.add_argument("--max_grad_norm", type=float, help="clip the gradient to this global "
                        "norm (default: no clipping)")
    parser.add_argument("--schedule", choices=["linear", "cosine"], default="linear",
                        help="the learning rate's decay after warmup")
    parser.add_argument("--eval_every_n_steps", type=int, help="also evaluate every N updates")


def model_shards(value: str) -> int | str:
    """``--n_model_shards``: a number of devices, or ``auto``."""
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: give a number of devices, or auto") from None


def optimizer_of(args, lr) -> optax.GradientTransformation:
    """AdamW with ``--weight_decay`` after clipping to ``--max_grad_norm`` (where given)."""
    adamw = optax.adamw(lr, weight_decay=getattr(args, "weight_decay", 1e-4))
    if getattr(args, "max_grad_norm", None) is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(args.max_grad_norm), adamw)


def load_examples(path: str) -> list[dict]:
    """Rows of a local data file (or image folder) as dicts, read by ``datasets``."""
    import datasets
    from datasets import load_dataset
    datasets.disable_progress_bars()  # a small local file: no "Generating train split" bars
    if not os.path.exists(path):
        raise UsageError(f"{path}: no such file or folder. Give a local data file "
                         f"({', '.join(sorted(DATA_KINDS))}) or a folder of images.")
    if os.path.isdir(path):
        return list(load_dataset("imagefolder", data_dir=path, split="train"))
    kind = DATA_KINDS.get(os.path.splitext(path)[1])
    if kind is None:
        raise UsageError(f"{path}: use one of {sorted(DATA_KINDS)} or a folder of images.")
    return list(load_dataset(kind, data_files=path, split="train"))


def load_tokenizer(model_dir: str):
    """The ``tokenizers`` tokenizer saved in ``model_dir/tokenizer.json`` (or the file
    ``model_dir`` itself)."""
    from tokenizers import Tokenizer
    path = model_dir if os.path.isfile(model_dir) else os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        raise UsageError(f"{path} not found: save the tokenizer with the model "
                                "(tokenizer.save_pretrained(dir) writes it).")
    return Tokenizer.from_file(path)


def pad_ids(rows: list[list[int]], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, mask)`` of shape (B, length): token id rows cut to ``length``, right-padded."""
    ids = np.full((len(rows), length), pad_id, np.int32)
    for i, row in enumerate(rows):
        ids[i, :len(row[:length])] = row[:length]
    return ids, np.arange(length) < np.array([[min(len(r), length)] for r in rows])


def detokenize(preds, tokenizer, eos_id: int) -> list[str]:
    """Generated id rows -> text, each cut at its first ``eos_id``."""
    rows = [[int(t) for t in row] for row in preds]
    return [tokenizer.decode(row[:row.index(eos_id)] if eos_id in row else row) for row in rows]


def load_model(model: str, from_scratch: bool = False, seed: int = 0,
               **fields) -> tuple[nnx.Module, dict]:
    """The zoo model saved in the directory ``model`` and its ``config.json`` (token ids live
    there). ``from_scratch``: untrained, its weights drawn from ``seed``, of ``model``'s
    ``config.json`` or of the preset named ``model``: a published decoder's ``config.json``
    (``redco_zoo_models.presets.PRESETS``: ``qwen3-8b``, ``llama-3.1-8b``, ...) or a LLaMA shape
    (``LLAMA_PRESETS``: ``llama-1b``, ...); ``fields`` replace the preset's values (e.g.
    ``vocab_size``)."""
    if not from_scratch:
        if not os.path.isfile(os.path.join(model, "config.json")):
            raise UsageError(
                f"--model {model}: " + ("no such directory" if not os.path.isdir(model) else
                                       "the directory has no config.json") +
                ". Give a local HuggingFace model directory (config.json, model.safetensors, "
                "tokenizer.json; save_pretrained writes one), or add --from_scratch to start "
                f"from a preset ({', '.join([*PRESETS, *LLAMA_PRESETS][:4])}, ...).")
        with open(os.path.join(model, "config.json")) as f:
            config = json.load(f)
        return from_pretrained(auto_class(model), model), config
    if os.path.isfile(os.path.join(model, "config.json")):
        with open(os.path.join(model, "config.json")) as f:
            config = json.load(f)
    elif model in PRESETS:
        config = {**preset(model), **fields}
    elif model in LLAMA_PRESETS:
        config = LlamaConfig(**{**LLAMA_PRESETS[model], **fields}).to_hf()
    else:
        raise UsageError(f"--model {model}: neither a directory with config.json nor a preset "
                         f"({', '.join([*PRESETS, *LLAMA_PRESETS])}).")
    model_class = class_of(config, model)
    return model_class(model_class.config_class.from_hf(config), rngs=nnx.Rngs(seed)), config


def n_epochs_and_schedule(args, deployer: Deployer, n_train: int) -> tuple[int | None, Any]:
    """``(n_epochs, lr schedule)``: ``--n_epochs`` of ``n_train`` examples, or, with
    ``--max_steps``, no epoch count and a schedule over that many updates."""
    schedule = deployer.get_lr_schedule_fn(
        n_train, args.per_device_batch_size, args.n_epochs, args.learning_rate,
        schedule_type=getattr(args, "schedule", "linear"), warmup_rate=args.warmup_rate,
        accumulate_grad_batches=getattr(args, "accumulate_grad_batches", 1),
        max_steps=args.max_steps or None)
    return (None if args.max_steps else args.n_epochs), schedule


def train_and_eval(args, model: nnx.Module, examples: tuple[list, list], collate_fn: Callable,
                   loss_fn: Callable, pred_fn: Callable | None = None,
                   output_fn: Callable | None = None, metric_fn: Callable | None = None,
                   best_metric: str | None = None, tokenizer: str | None = None,
                   before_fit: Callable[[Trainer], Any] | None = None) -> Any:
    """Train ``model`` on ``examples = (train, eval)`` with the three functions and the levers
    of ``add_training_levers`` (which the pipeline's parser must have); evaluate after each
    epoch; save the trained model as ``workdir/model`` (HuggingFace format, with the
    tokenizer files of ``args.model``, or the ``tokenizer.json`` file ``tokenizer``).
    ``before_fit(trainer)`` runs once the trainer is made (e.g. a pass over the examples with
    the untrained params). Returns the trainer."""
    train, evaluate = examples
    deployer = Deployer(jax_seed=args.jax_seed, n_model_shards=args.n_model_shards,
                        workdir=args.workdir, n_context_shards=args.n_context_shards,
                        context_strategy=args.context_strategy,
                        device_memory=getattr(args, "device_memory", None))
    apply_fn, params, trainable = split_for_training(model, args, deployer)
    n_epochs, lr = n_epochs_and_schedule(args, deployer, len(train))
    rules = None
    if getattr(args, "expert_parallel", False):
        rules = expert_parallel.for_trainer(params, deployer)
    optimizer = moe_optimizer(optimizer_of(args, lr), model)  # (a sigmoid router's bias)
    trainer = Trainer(deployer, collate_fn, apply_fn, loss_fn, params, optimizer,
                      params_sharding_rules=rules,
                      lr_schedule_fn=lr, trainable=trainable, remat=args.remat,
                      compute_dtype=None if args.compute_dtype == "float32" else jnp.bfloat16,
                      accumulate_grad_batches=args.accumulate_grad_batches)
    predictor = pred_fn and trainer.get_default_predictor(pred_fn, output_fn)
    if before_fit is not None:
        before_fit(trainer)
    trainer.fit(train, args.per_device_batch_size, n_epochs, max_steps=args.max_steps,
                eval_examples=evaluate,
                eval_predictor=predictor, eval_metric_fn=metric_fn,
                save_every_n_steps=args.save_every_n_steps, max_eval_batches=eval_batches(args),
                eval_every_n_steps=args.eval_every_n_steps,
                save_argmax_ckpt_by_metrics=[best_metric] if best_metric else None)
    save_trained(trainer, model, args.model, tokenizer)
    return trainer


def eval_batches(args) -> int | None:
    """``--eval_steps`` as ``fit``'s ``max_eval_batches`` (0: None, all of them)."""
    if args.eval_steps < 0:
        raise UsageError(f"--eval_steps {args.eval_steps}: give the number of batches to "
                         "evaluate on, or 0 for all of the evaluation data.")
    return args.eval_steps or None


def split_for_training(model: nnx.Module, args, deployer: Deployer) -> tuple[Callable, Any, Any]:
    """``(apply_fn, params, trainable)`` for ``Trainer``: with ``--lora_rank`` the model gets
    LoRA adapters (in place, so a ``pred_fn`` holding it sees them) and only they train."""
    if not getattr(args, "lora_rank", 0):
        return (*split_model(model), None)
    add_lora(model, args.lora_rank, args.lora_alpha, args.lora_targets, seed=args.jax_seed)
    apply_fn, params = split_model(model)
    trainable = trainable_mask(params)
    deployer.log_info(f"LoRA rank {args.lora_rank}, alpha {args.lora_alpha}: training "
                      f"{n_params(params, trainable):,} of {n_params(params):,} params.")
    return apply_fn, params, trainable


def save_trained(trainer: Trainer, model: nnx.Module, model_dir: str,
                 tokenizer: str | None = None) -> str:
    """Save ``trainer``'s params in ``model``'s structure as ``workdir/model``, a HuggingFace
    directory, with the tokenizer files of ``model_dir`` (where the model came from) or the
    ``tokenizer.json`` file ``tokenizer``; a LoRA model is saved merged, and its adapters alone
    as ``workdir/adapter`` (PEFT's layout)."""
    nnx.update(model, host_tree(trainer.params))  # (gathered from every process)
    out = os.path.join(trainer.deployer.workdir, "model")
    if not trainer.deployer.is_main_process:
        return out
    save_pretrained(model, out)
    if has_lora(model):
        adapter = save_peft_adapters(model, os.path.join(trainer.deployer.workdir, "adapter"),
                                     os.path.abspath(model_dir))
        trainer.deployer.log_info(f"saved the LoRA adapters (PEFT layout) to {adapter}")
    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(model_dir, name)):
            shutil.copy(os.path.join(model_dir, name), out)
    if tokenizer and os.path.isfile(tokenizer):
        shutil.copy(tokenizer, os.path.join(out, "tokenizer.json"))
    trainer.deployer.log_info(f"saved the trained model to {out}")
    return out


def split_eval(args, columns: dict[str, str] | None = None) -> tuple[list, list]:
    """``(train, eval)`` rows: ``--train`` and ``--eval``, or the last 5% of ``--train``; each
    has the ``columns`` (``{flag: column}``) or the error lists the columns it has."""
    rows = load_examples(args.train)
    for flag, name in (columns or {}).items():
        if rows and name not in rows[0]:
            raise UsageError(f"{flag} {name!r}: {args.train} has no such column. Its columns: "
                             f"{sorted(rows[0])}.")
    if args.eval:
        return rows, load_examples(args.eval)
    n = max(1, len(rows) // 20)
    return rows[:-n], rows[-n:]
