"""What every zoo pipeline's run shares: local data through ``datasets``, local tokenizers, and
the run (``Deployer`` + ``Trainer`` + ``Predictor``, then the trained model saved as a
HuggingFace directory). It takes the typed settings (``settings.RunConfig``, or the group a
function needs), never argparse's namespace: the flags are ``flags.py``'s."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from redco import Deployer, Trainer
from redco.checkpointing import host_tree
from redco.lora import n_params, trainable_mask
from redco.protocols import UsageError
from redco.tree_paths import path_str
from redco_zoo_models import expert_parallel, quantized_linear
from redco_zoo_models.balancing import moe_optimizer
from redco_zoo_models.decoder_config import DecoderConfig
from redco_zoo_models.hf import (
    auto_class,
    class_of,
    from_pretrained,
    save_pretrained,
    with_changes,
)
from redco_zoo_models.llama import LLAMA_PRESETS, LlamaConfig
from redco_zoo_models.lora import add_lora, has_lora, save_peft_adapters
from redco_zoo_models.nnx_utils import split_model
from redco_zoo_models.presets import PRESETS, preset
from redco_zoo_models.settings import (
    Data,
    Loop,
    LoRA,
    ModelSource,
    Optimizer,
    RunConfig,
    check_config,
)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "preprocessor_config.json",
                   "processor_config.json",
                   "generation_config.json")  # (the source's sampling defaults and stop ids)
DATA_KINDS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".txt": "text"}


def optimizer_of(optimizer: Optimizer, lr) -> optax.GradientTransformation:
    """AdamW with ``weight_decay`` after clipping to ``max_grad_norm`` (where given)."""
    adamw = optax.adamw(lr, weight_decay=optimizer.weight_decay)
    if optimizer.max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(optimizer.max_grad_norm), adamw)


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


def load_source(source: ModelSource, seed: int, **fields) -> tuple[nnx.Module, dict]:
    """``load_model`` of a run's ``ModelSource`` (what every pipeline loads its model by)."""
    return load_model(source.model, source.from_scratch, seed, source.scan_layers,
                      source.quantize_base, **fields)


def decoding(source: ModelSource) -> ModelSource:
    """``source`` for a pipeline that decodes most of its time (GRPO's rollouts): the layers
    unrolled unless ``scan_layers`` is asked for. A scanned decode step copies every layer's
    key/value cache into and out of its stack (0.53x the unrolled decode rate, BENCHMARKS 45)."""
    return source if source.scan_layers is not None else \
        dataclasses.replace(source, scan_layers=False)


def load_model(model: str, from_scratch: bool = False, seed: int = 0,
               scan_layers: bool | None = None, quantize: str | None = None,
               **fields) -> tuple[nnx.Module, dict]:
    """The zoo model saved in the directory ``model`` and its ``config.json`` (token ids live
    there). ``from_scratch``: untrained, its weights drawn from ``seed``, of ``model``'s
    ``config.json`` or of the preset named ``model``: a published decoder's ``config.json``
    (``redco_zoo_models.presets.PRESETS``: ``qwen3-8b``, ``llama-3.1-8b``, ...) or a LLaMA shape
    (``LLAMA_PRESETS``: ``llama-1b``, ...); ``fields`` replace the preset's values (e.g.
    ``vocab_size``). ``scan_layers``: a decoder's layers stored stacked and scanned
    (``redco_zoo_models.layer_scan``; None: wherever the model can, ``DecoderConfig``); True
    for another model is refused. ``quantize``: the attention
    and MLP projections quantised (``nf4``, ``int8``, ``fp8``; ``from_pretrained``), frozen."""
    if quantize == "auto":
        raise UsageError("--quantize_base auto is chosen by the layout planner before the model "
                         "is loaded, which only the lm and sft pipelines do: name a format (nf4, "
                         "int8, fp8) and give --n_model_shards a number.")
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
        model_class = scannable(auto_class(model), scan_layers, model)
        changes = {} if scan_layers is None else {"scan_layers": scan_layers}
        return from_pretrained(model_class, model, quantize=quantize, **changes), config
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
    model_class = scannable(class_of(config, model), scan_layers, model)
    cfg = model_class.config_class.from_hf(config)
    cfg = cfg if scan_layers is None else with_changes(cfg, {"scan_layers": scan_layers})
    built = model_class(cfg, rngs=nnx.Rngs(seed))
    if quantize:
        quantized_linear.quantize_linears(built, quantize)
    return built, config


def scannable(model_class: type, scan_layers: bool | None, model: str) -> type:
    """``model_class``, refused with ``scan_layers=True`` unless it is a decoder or an image-text
    model over one (its tower's blocks stack with its layers: ``ImageTextModel.stack_tower``)."""
    text = getattr(model_class.config_class, "__dataclass_fields__", {}).get("text")
    over_decoder = text is not None and text.type in (DecoderConfig, "DecoderConfig")
    if scan_layers and not issubclass(model_class.config_class, DecoderConfig) and not over_decoder:
        raise UsageError(f"--scan_layers with --model {model}: a {model_class.__name__} does not "
                         "stack its layers (only the decoders do, LLaMA, Qwen3, Gemma 3, ..., "
                         "and the image-text models over them); drop --scan_layers.")
    return model_class


def n_epochs_and_schedule(loop: Loop, optimizer: Optimizer, deployer: Deployer,
                          n_train: int) -> tuple[int | None, Any]:
    """``(n_epochs, lr schedule)``: ``loop.n_epochs`` of ``n_train`` examples, or, with
    ``loop.max_steps``, no epoch count and a schedule over that many updates."""
    schedule = deployer.get_lr_schedule_fn(
        n_train, loop.per_device_batch_size, loop.n_epochs, optimizer.learning_rate,
        schedule_type=optimizer.schedule, warmup_rate=optimizer.warmup_rate,
        accumulate_grad_batches=loop.accumulate_grad_batches, max_steps=loop.max_steps or None)
    return (None if loop.max_steps else loop.n_epochs), schedule


def deployer_of(config: RunConfig, n_local_devices: int | None = None,
                devices: Callable[[list], Sequence] | None = None) -> Deployer:
    """The run's ``Deployer``: its seed, workdir and layout, on the first ``n_local_devices``
    devices (None: all), or on those ``devices(jax.devices())`` picks (``Deployer``'s)."""
    layout = config.layout
    return Deployer(jax_seed=config.jax_seed, n_model_shards=layout.n_model_shards,
                    workdir=config.workdir, n_context_shards=layout.n_context_shards,
                    context_strategy=layout.context_strategy,
                    device_memory=layout.device_memory, sharding_rules=layout.sharding_rules,
                    n_local_devices=n_local_devices, devices=devices)


def train_and_eval(config: RunConfig, model: nnx.Module, examples: tuple[list, list],
                   collate_fn: Callable,
                   loss_fn: Callable, pred_fn: Callable | None = None,
                   output_fn: Callable | None = None, metric_fn: Callable | None = None,
                   best_metric: str | None = None, tokenizer: str | None = None,
                   before_fit: Callable[[Trainer], Any] | None = None,
                   frozen: str | None = None) -> Any:
    """Train ``model`` on ``examples = (train, eval)`` with the three functions and the levers
    of ``config`` (its layout, optimizer, loop and LoRA); evaluate after each epoch; save the
    trained model as ``workdir/model`` (HuggingFace format, with the tokenizer files of the
    model's directory, or the ``tokenizer.json`` file ``tokenizer``). ``before_fit(trainer)``
    runs once the trainer is made (e.g. a pass over the examples with the untrained params).
    ``frozen``: a prefix of param paths kept as they are (``split_for_training``). Returns the
    trainer."""
    check_config(config, "train_and_eval")
    if config.layout.n_model_shards == "auto" and quantized_linear.quantized_layers(model):
        raise UsageError("--quantize_base with --n_model_shards auto is planned before the model "
                         "is loaded, which only the lm and sft pipelines do: give "
                         "--n_model_shards a number here.")
    train, evaluate = examples
    deployer, layout, loop = deployer_of(config), config.layout, config.loop
    apply_fn, params, trainable = split_for_training(model, config.lora, config.jax_seed,
                                                     deployer, frozen)
    n_epochs, lr = n_epochs_and_schedule(loop, config.optimizer, deployer, len(train))
    rules = params_rules(model, params, deployer, layout.expert_parallel)
    optimizer = moe_optimizer(optimizer_of(config.optimizer, lr), model)  # (a router's bias)
    trainer = Trainer(deployer, collate_fn, apply_fn, loss_fn, params, optimizer,
                      params_sharding_rules=rules,
                      lr_schedule_fn=lr, trainable=trainable, remat=layout.remat,
                      compute_dtype=None if layout.compute_dtype == "float32" else jnp.bfloat16,
                      accumulate_grad_batches=loop.accumulate_grad_batches)
    predictor = pred_fn and trainer.get_default_predictor(pred_fn, output_fn)
    if before_fit is not None:
        before_fit(trainer)
    trainer.fit(train, loop.per_device_batch_size, n_epochs, max_steps=loop.max_steps,
                eval_examples=evaluate,
                eval_predictor=predictor, eval_metric_fn=metric_fn,
                save_every_n_steps=loop.save_every_n_steps, max_eval_batches=eval_batches(loop),
                eval_every_n_steps=loop.eval_every_n_steps,
                save_argmax_ckpt_by_metrics=[best_metric] if best_metric else None)
    save_trained(trainer, model, config.source.model, tokenizer)
    return trainer


def params_rules(model: nnx.Module, params: Any, deployer: Deployer,
                 experts_split: bool = False) -> Any:
    """The ``Trainer``'s ``params_sharding_rules``: the deployer's, after the rules that put a
    quantised kernel's or expert weight's scales with its codes (QLoRA) and, with
    ``experts_split``, the experts' (expert parallelism, the scales with them); None (the
    deployer's, decided at the first batch) where neither."""
    split = expert_parallel.sharding_rules() if experts_split else []
    overrides = quantized_linear.sharding_rules(model, deployer, split) + split
    return deployer.get_sharding_rules(params, rules=overrides) if overrides else None


def eval_batches(loop: Loop) -> int | None:
    """``loop.eval_steps`` as ``fit``'s ``max_eval_batches`` (0: None, all of them)."""
    if loop.eval_steps < 0:
        raise UsageError(f"--eval_steps {loop.eval_steps}: give the number of batches to "
                         "evaluate on, or 0 for all of the evaluation data.")
    return loop.eval_steps or None


def split_for_training(model: nnx.Module, lora: LoRA, seed: int, deployer: Deployer,
                       frozen: str | None = None) -> tuple[Callable, Any, Any]:
    """``(apply_fn, params, trainable)`` for ``Trainer``: with ``lora.rank`` the model gets
    LoRA adapters drawn from ``seed`` (in place, so a ``pred_fn`` holding it sees them) and
    only they train. ``frozen``: a prefix of param paths (an image model's ``vision_tower/``)
    that never train: no adapters there, and without LoRA only the rest trains."""
    if not lora.rank:
        apply_fn, params = split_model(model)
        if frozen is None:
            return apply_fn, params, None
        trainable = jax.tree_util.tree_map_with_path(
            lambda p, _: not path_str(p).startswith(frozen), params)
        deployer.log_info(f"{frozen} frozen: training {n_params(params, trainable):,} of "
                          f"{n_params(params):,} params.")
        return apply_fn, params, trainable
    targets = lora.targets if frozen is None else f"^(?!{re.escape(frozen)}).*?(?:{lora.targets})"
    add_lora(model, lora.rank, lora.alpha, targets, seed=seed)
    apply_fn, params = split_model(model)
    trainable = trainable_mask(params)
    deployer.log_info(f"LoRA rank {lora.rank}, alpha {lora.alpha}: training "
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


def split_eval(data: Data, columns: dict[str, str] | None = None) -> tuple[list, list]:
    """``(train, eval)`` rows: ``data.train`` and ``data.eval``, or the last 5% of
    ``data.train``; each has the ``columns`` (``{flag: column}``) or the error lists the
    columns it has."""
    rows = load_examples(data.train)
    for flag, name in (columns or {}).items():
        if rows and name not in rows[0]:
            raise UsageError(f"{flag} {name!r}: {data.train} has no such column. Its columns: "
                             f"{sorted(rows[0])}.")
    if data.eval:
        return rows, load_examples(data.eval)
    n = max(1, len(rows) // 20)
    return rows[:-n], rows[-n:]
