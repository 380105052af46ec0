"""What every zoo pipeline's command line shares: the usual flags, local data through
``datasets``, local tokenizers, and the run (``Deployer`` + ``Trainer`` + ``Predictor``, then
the trained model saved as a HuggingFace directory)."""
from __future__ import annotations

import argparse
import os
import shutil
from typing import Any, Callable

import jax
import optax
from flax import nnx

from redco import Deployer, Trainer
from redco_zoo_models.hf import from_pretrained, save_pretrained
from redco_zoo_models.nnx_utils import split_model

DATA_KINDS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".txt": "text"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every pipeline takes."""
    parser.add_argument("--model", required=True, help="a local HuggingFace model directory "
                        "(config.json, model.safetensors, tokenizer.json)")
    parser.add_argument("--train", required=True, help="training data: a .json, .jsonl, .csv or "
                        ".txt file, or a folder of images with metadata.jsonl")
    parser.add_argument("--eval", help="evaluation data (default: 5%% of --train)")
    parser.add_argument("--workdir", default="./workdir")
    parser.add_argument("--n_model_shards", type=int, default=1)
    parser.add_argument("--per_device_batch_size", type=int, default=8)
    parser.add_argument("--n_epochs", type=int, default=2)
    parser.add_argument("--learning_rate", type=float, default=1e-4)
    parser.add_argument("--warmup_rate", type=float, default=0.05)
    parser.add_argument("--save_every_n_steps", type=int)
    parser.add_argument("--jax_seed", type=int, default=42)


def load_examples(path: str) -> list[dict]:
    """Rows of a local data file (or image folder) as dicts, read by ``datasets``."""
    from datasets import load_dataset
    if os.path.isdir(path):
        return list(load_dataset("imagefolder", data_dir=path, split="train"))
    kind = DATA_KINDS.get(os.path.splitext(path)[1])
    if kind is None:
        raise ValueError(f"{path}: use one of {sorted(DATA_KINDS)} or a folder of images.")
    return list(load_dataset(kind, data_files=path, split="train"))


def load_tokenizer(model_dir: str):
    """The ``tokenizers`` tokenizer saved in ``model_dir/tokenizer.json``."""
    from tokenizers import Tokenizer
    path = os.path.join(model_dir, "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} not found: save the tokenizer with the model "
                                "(tokenizer.save_pretrained(dir) writes it).")
    return Tokenizer.from_file(path)


def train_and_eval(args, model_class: type, examples: tuple[list, list], collate_fn: Callable,
                   loss_fn: Callable, pred_fn: Callable | None = None,
                   output_fn: Callable | None = None, metric_fn: Callable | None = None,
                   best_metric: str | None = None) -> Any:
    """Train ``args.model`` on ``examples = (train, eval)`` with the three functions; evaluate
    after each epoch; save the model as ``workdir/model`` (HuggingFace format). Returns the
    trainer."""
    train, evaluate = examples
    deployer = Deployer(jax_seed=args.jax_seed, n_model_shards=args.n_model_shards,
                        workdir=args.workdir)
    model = from_pretrained(model_class, args.model)
    apply_fn, params = split_model(model)
    lr = deployer.get_lr_schedule_fn(len(train), args.per_device_batch_size, args.n_epochs,
                                     args.learning_rate, warmup_rate=args.warmup_rate)
    trainer = Trainer(deployer, collate_fn, apply_fn, loss_fn, params, optax.adamw(lr),
                      lr_schedule_fn=lr)
    predictor = pred_fn and trainer.get_default_predictor(pred_fn, output_fn)
    trainer.fit(train, args.per_device_batch_size, args.n_epochs, eval_examples=evaluate,
                eval_predictor=predictor, eval_metric_fn=metric_fn,
                save_every_n_steps=args.save_every_n_steps,
                save_argmax_ckpt_by_metrics=[best_metric] if best_metric else None)
    nnx.update(model, jax.device_get(trainer.params))
    out = os.path.join(args.workdir, "model")
    save_pretrained(model, out)
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        if os.path.isfile(os.path.join(args.model, name)):
            shutil.copy(os.path.join(args.model, name), out)
    deployer.log_info(f"saved the trained model to {out}")
    return trainer


def split_eval(args, rows: list) -> tuple[list, list]:
    """``(train, eval)``: ``--eval`` if given, else the last 5% of ``rows``."""
    if args.eval:
        return rows, load_examples(args.eval)
    n = max(1, len(rows) // 20)
    return rows[:-n], rows[-n:]
