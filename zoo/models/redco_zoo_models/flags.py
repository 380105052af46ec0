"""The flags every zoo pipeline's command line shares, each the field of the same name in
``settings.RunConfig`` (a group's prefix prepended: ``--lora_rank`` is ``LoRA.rank``), its
default read from there. The parsed namespace goes no further than the pipeline's ``run``,
which makes the typed settings of it (``RunConfig.of_flags``)."""
from __future__ import annotations

import argparse

from redco.remat import POLICIES
from redco.sequence_split import STRATEGIES
from redco_zoo_models.llama import LLAMA_PRESETS
from redco_zoo_models.presets import PRESETS
from redco_zoo_models.settings import (
    COMPUTE_DTYPES,
    QUANTIZE_CHOICES,
    SCHEDULES,
    Layout,
    Loop,
    LoRA,
    Optimizer,
    RunConfig,
)


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
    parser.add_argument("--scan_layers", action="store_true", default=None, help="a decoder's "
                        "layers stored stacked and run under jax.lax.scan, compile time flat in "
                        "depth (the default wherever the model can be: all but Gemma 4's with "
                        "KV sharing or per-layer inputs; this flag insists)")
    parser.add_argument("--no_scan_layers", dest="scan_layers", action="store_false",
                        default=None, help="the layers unrolled, one trace per layer (debugging)")
    parser.add_argument("--quantize_base", choices=QUANTIZE_CHOICES, help="hold the attention "
                        "and MLP projections quantised and frozen, quantised as they are read "
                        "(QLoRA; needs --lora_rank): nf4 (4-bit NormalFloat, blocks of 64), "
                        "int8 or fp8 (e4m3), per output channel; with --n_model_shards auto "
                        "(lm, sft) the planner uses it only where LoRA over the unquantised base "
                        "fits no layout, auto: int8, else nf4")
    parser.add_argument("--train", required=True, help="training data: a .json, .jsonl, .csv or "
                        ".txt file, or a folder of images with metadata.jsonl")
    parser.add_argument("--eval", help="evaluation data (default: 5%% of --train)")
    parser.add_argument("--eval_steps", type=int, default=Loop.eval_steps, help="evaluate on at most this "
                        "many batches, the first of the evaluation data (a cut is said in the "
                        "log; 0: all of it)")
    parser.add_argument("--workdir", default=RunConfig.workdir)
    auto = ", or auto: the layout planner picks it (and FSDP, remat) by compiling the step " \
        "(redco-planner)" if planner else ""
    parser.add_argument("--n_model_shards", type=model_shards, default=Layout.n_model_shards,
                        help="devices each model is split over (tensor parallelism)" + auto)
    if planner:
        parser.add_argument("--device_memory", help="memory of one device for --n_model_shards "
                            "auto, e.g. 16GB (read from the device on GPUs and TPUs)")
    parser.add_argument("--per_device_batch_size", type=int, default=Loop.per_device_batch_size)
    parser.add_argument("--n_epochs", type=int, default=Loop.n_epochs)
    parser.add_argument("--max_steps", type=int, help="train this many updates, across epochs "
                        "(instead of --n_epochs)")
    parser.add_argument("--learning_rate", type=float, default=Optimizer.learning_rate)
    parser.add_argument("--warmup_rate", type=float, default=Optimizer.warmup_rate)
    parser.add_argument("--save_every_n_steps", type=int)
    parser.add_argument("--jax_seed", type=int, default=RunConfig.jax_seed)
    parser.add_argument("--lora_rank", type=int, default=LoRA.rank, help="train LoRA adapters of this "
                        "rank on a frozen model (0: train the whole model)")
    parser.add_argument("--lora_alpha", type=float, default=LoRA.alpha,
                        help="LoRA scale numerator: the adapters add (alpha / rank) * A @ B")
    parser.add_argument("--lora_targets", default=LoRA.targets, help="regex selecting the "
                        "kernels to adapt (default: attention and MLP projections)")


def add_training_levers(parser: argparse.ArgumentParser) -> None:
    """The flags of what ``train_and_eval`` builds (a pipeline that trains through it)."""
    parser.add_argument("--n_context_shards", type=int, default=Layout.n_context_shards,
                        help="split each sequence over this many devices (context parallelism, "
                        "for long rows)")
    parser.add_argument("--context_strategy", choices=STRATEGIES, default=Layout.context_strategy)
    parser.add_argument("--expert_parallel", action="store_true", help="split each MoE block's "
                        "experts over the data-parallel devices (expert parallelism): tokens "
                        "go to their experts' devices and back")
    parser.add_argument("--remat", choices=list(POLICIES), default=Layout.remat, help="recompute "
                        "activations in the backward pass instead of keeping them (full: least "
                        "memory)")
    parser.add_argument("--compute_dtype", choices=COMPUTE_DTYPES,
                        default=Layout.compute_dtype,
                        help="the dtype of the forward and backward pass (params stay float32)")
    parser.add_argument("--accumulate_grad_batches", type=int,
                        default=Loop.accumulate_grad_batches, help="micro-batches "
                        "summed into each update")
    parser.add_argument("--weight_decay", type=float, default=Optimizer.weight_decay,
                        help="AdamW's")
    parser.add_argument("--max_grad_norm", type=float, help="clip the gradient to this global "
                        "norm (default: no clipping)")
    parser.add_argument("--schedule", choices=SCHEDULES, default=Optimizer.schedule,
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
