"""``redco rules`` and ``redco plan``: the two subcommands this plugin adds to the ``redco`` CLI.

Both work on abstract shapes over simulated CPU devices (``--devices``), so any machine can plan
for any cluster. ``--devices`` is the size of the mesh planned for, every process's devices
together; it is not ``Deployer(n_local_devices=)``, which caps how many of its own real devices
one process of a run uses (the commands pass it so because their one process holds the whole
simulated mesh). ``simulate_devices`` must run before jax starts its backends: ``redco`` imports
jax but starts nothing, so each command calls it first thing in ``run``, and imports the rest
(Deployer, the planner, the models) only then. Building the CLI imports this module alone.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

from redco.protocols import Command
from redco.sequence_split import STRATEGIES

MODEL_HELP = ("llama-tiny, llama-1b, llama-7b, llama-13b, llama-30b, llama-65b; a published "
              "decoder (redco_zoo_models.presets): llama-3.2-1b, llama-3.2-3b, llama-3.1-8b, "
              "llama-3.1-70b, qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b, qwen3-14b, qwen3-32b, "
              "gemma-3-1b, gemma-3-4b, gemma-3-12b, gemma-3-27b, phi-4-mini, mixtral-8x7b, "
              "qwen3-30b-a3b, deepseek-v3, gpt-oss-20b, qwen3.5-27b, qwen3.5-35b-a3b, "
              "qwen3-next-80b-a3b, olmo-3-7b, olmo-3-32b, glm-4.5-air, llama-4-scout, "
              "gemma-4-31b, gemma-4-26b-a4b; an image-text model (redco_zoo_models.presets_vlm, "
              "one image a row): qwen2.5-vl-7b, qwen3-vl-8b, gemma-3-12b-vision, "
              "gemma-3-27b-vision, llama-4-scout-vision; or module:function "
              "returning params, (params, trace_fn) or (params, trace_fn, loss_fn)")
COMPUTE_DTYPES = ("float32", "bfloat16")
SCAN_HELP = ("the zoo decoder's layers stored stacked and run under jax.lax.scan "
             "(DecoderConfig.scan_layers; the default): each layout compiles one layer's body, "
             "at full depth")
DEVICES_HELP = ("the devices the plan is for, every process's together (the mesh's size), "
                "simulated on CPU; not Deployer's n_local_devices, which caps the devices one "
                "process of a run uses")


def simulate_devices(n: int) -> None:
    """Make jax see ``n`` CPU devices (plans use abstract shapes only, so any machine will do).

    XLA_FLAGS is read when jax starts its backends, so this works until the first jax operation
    (importing ``redco`` imports jax but starts nothing)."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", os.environ.get("XLA_FLAGS", ""))
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # already started (e.g. called from a running program)
        if jax.device_count() < n:
            sys.exit(f"redco: jax already runs with {jax.device_count()} devices, fewer than "
                     f"--devices {n}; call this before any jax operation.")


class RulesCommand(Command):
    description = "Print the sharding plan of a model: each param's spec and bytes per device."

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("model", help=MODEL_HELP)
        parser.add_argument("--n_model_shards", type=int, default=2)
        parser.add_argument("--devices", type=int, default=8, help=DEVICES_HELP)
        parser.add_argument("--rules", default="auto", help="rule set: auto, fsdp, auto+fsdp, ...")
        scan_flags(parser)
        parser.add_argument("--png", help="also draw the plan to this PNG (needs matplotlib)")
        parser.add_argument("--json", action="store_true", help="print JSON")

    def run(self, args: argparse.Namespace) -> None:
        simulate_devices(args.devices)
        import jax

        from redco_planner.inspection import format_table, load_model
        model = load_model(args.model, scan_layers=args.scan_layers)
        rows, mesh_shape = self.plan_rows(model, args)
        if args.json:
            print(json.dumps([dict(r, spec=str(r["spec"])) for r in rows], indent=2))
        else:
            print(f"{args.model}: sharding_rules={args.rules!r}, n_model_shards="
                  f"{args.n_model_shards}, {'dataflow' if model.trace_fn else 'names'}, "
                  f"{jax.devices()[0].platform}")
            print(format_table(rows, mesh_shape))
        if args.png:
            self.draw(rows, args, mesh_shape)

    @staticmethod
    def plan_rows(model, args: argparse.Namespace) -> tuple[list[dict], dict]:
        """The rows of ``plan_table`` for the rules a ``Deployer`` gives ``model``, and its mesh."""
        import tempfile

        from redco import Deployer
        from redco_planner.inspection import plan_table
        with tempfile.TemporaryDirectory() as workdir:
            deployer = Deployer(jax_seed=0, n_model_shards=args.n_model_shards, workdir=workdir,
                                sharding_rules=args.rules, loggers=(), verbose=False,
                                n_local_devices=args.devices)
            rules = deployer.get_sharding_rules(model.params, trace_fn=model.trace_fn)
            rows = plan_table(deployer, model.params, rules)
            mesh_shape = dict(deployer.mesh.shape)
            deployer.close()
        return rows, mesh_shape

    @staticmethod
    def draw(rows: list[dict], args: argparse.Namespace, mesh_shape: dict) -> None:
        from redco_planner.inspection import draw_png
        try:
            draw_png(rows, args.png, title=f"{args.model} {args.rules} {mesh_shape}")
        except ImportError as e:
            sys.exit(f"redco: {e}")
        print(f"wrote {args.png}")


def context_degrees(value: str) -> list[int] | None:
    """``--n_context_shards``: ``auto`` (None: every degree) or comma-separated degrees."""
    if value == "auto":
        return None
    try:
        return [int(d) for d in value.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: give auto or degrees such as 1,2,4") from None


class PlanCommand(Command):
    description = ("Pick the layout with the fewest devices per example (model parallel x "
                   "context parallel) whose train step fits the device memory.")

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--model", "--preset", required=True, help=MODEL_HELP)
        parser.add_argument("--devices", type=int, required=True, help=DEVICES_HELP)
        parser.add_argument("--device_memory", "--device-memory", required=True,
                            help="per device, e.g. 40GB (GiB)")
        parser.add_argument("--seq_len", "--seq-len", type=int, default=1024)
        parser.add_argument("--per_device_batch_size", "--batch", type=int, default=1)
        parser.add_argument("--rules", default="auto,auto+fsdp", help="rule sets to try, in order")
        parser.add_argument("--all", action="store_true", help="measure every layout, not just "
                            "up to the first that fits")
        parser.add_argument("--remat", action="store_true", help="also try rematerialisation "
                            "(none, dots_saveable, full: least recompute first; scanned layers skip "
                            "dots_saveable, which keeps more than none there) at each layout")
        parser.add_argument("--lora_rank", "--lora-rank", type=int, help="if no full fine-tuning "
                            "layout fits, try LoRA adapters of this rank (base frozen) the same way")
        parser.add_argument("--quantize_base", "--quantize-base",
                            choices=("auto", "nf4", "int8", "fp8"), help="if LoRA fits nowhere "
                            "either, try LoRA over the base's projections quantised (QLoRA; "
                            "needs --lora_rank): auto tries int8, then nf4")
        parser.add_argument("--n_context_shards", "--context-shards", type=context_degrees,
                            help="context-parallel degrees to consider (devices splitting each "
                            "sequence): auto (every degree, the default) or e.g. 1 or 1,2,4")
        parser.add_argument("--context_strategy", "--context-strategy", default=STRATEGIES[0],
                            choices=STRATEGIES)
        parser.add_argument("--compute_dtype", "--compute-dtype", default="float32",
                            choices=COMPUTE_DTYPES,
                            help="the step computes in this dtype, the params cast to it as "
                            "Trainer(compute_dtype=...) does; params and AdamW state stay fp32")
        scan_flags(parser)
        from redco_planner import rollout_plan
        rollout_plan.add_arguments(parser)

    def run(self, args: argparse.Namespace) -> None:
        simulate_devices(args.devices)
        if args.rollout_devices:
            from redco_planner import rollout_plan
            return rollout_plan.run(args)
        import jax.numpy as jnp

        from redco_planner.inspection import load_model, parse_bytes
        from redco_planner.layouts import expert_shards, training
        from redco_planner.planner import REMAT_POLICIES, PlanError, plan
        check_quantize_base(args)
        model = load_model(args.model, seq_len=args.seq_len, scan_layers=args.scan_layers)
        compute = None if args.compute_dtype == "float32" else jnp.dtype(args.compute_dtype)
        memory = parse_bytes(args.device_memory)
        if model.loss_fn is not None:
            loss, batch = model.loss_fn, model.batch(args.per_device_batch_size)
        else:
            print("(no loss_fn: the mean of the model's outputs on its own example input stands "
                  "for the loss; --seq_len and --per_device_batch_size are not used)")
            loss, batch = model.trace_fn, None
        dtypes = "fp32" if compute is None else f"fp32 params, {args.compute_dtype} compute"
        scanned = " (layers stacked and scanned)" if model.scanned else ""
        print(f"{args.model}{scanned}: {args.devices} devices x {args.device_memory}, per-device batch "
              f"{args.per_device_batch_size} x seq {args.seq_len}, AdamW, {dtypes}; per-device peak of the "
              "compiled train step (and its FLOPs per device):")
        try:
            result = plan(model.params, loss, batch, n_devices=args.devices,
                          device_memory_bytes=memory, rule_sets=args.rules.split(","),
                          try_all=args.all, log=lambda line: print("  " + line, flush=True),
                          remat_policies=REMAT_POLICIES if args.remat else ("none",),
                          lora_rank=args.lora_rank, lora=model.lora,
                          context_degrees=args.n_context_shards, context_strategy=args.context_strategy,
                          compute_dtype=compute, quantize_base=args.quantize_base,
                          quantized=model.quantized)
        except PlanError as e:
            sys.exit(f"redco: {e}")
        remat = f", remat={result.remat!r}" if args.remat else ""
        remat += "" if result.lora_rank is None else f", {training(result)}"
        print(f"pick: n_model_shards={result.n_model_shards}, n_context_shards="
              f"{result.n_context_shards}, {expert_shards(result)}sharding_rules="
              f"{result.sharding_rules!r}{remat} (peak {result.peak_bytes / memory:.0%} of device "
              f"memory)\nwhy: {result.reason}")


def scan_flags(parser: argparse.ArgumentParser) -> None:
    """``--scan_layers`` (the default for the zoo's decoders) and ``--no_scan_layers``."""
    parser.add_argument("--scan_layers", "--scan-layers", action="store_true", default=None,
                        help=SCAN_HELP)
    parser.add_argument("--no_scan_layers", "--no-scan-layers", dest="scan_layers",
                        action="store_false", default=None, help="the zoo decoder's layers "
                        "unrolled: each layout compiles every layer")


def check_quantize_base(args: argparse.Namespace) -> None:
    """Refuse ``--quantize_base`` without ``--lora_rank`` (a quantised base trains only
    through adapters) before any model is built."""
    from redco.protocols import UsageError
    if args.quantize_base and args.lora_rank is None:
        raise UsageError(f"--quantize_base {args.quantize_base} without --lora_rank: a "
                         "quantised base is frozen and trains only through LoRA adapters; add "
                         "--lora_rank (e.g. 16), or drop --quantize_base.")
