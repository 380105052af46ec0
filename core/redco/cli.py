"""The ``redco`` command."""
from __future__ import annotations

import argparse
import json
import os
import re
import sys


def cmd_plugins(args) -> None:
    """List loaded plugins, where each comes from, and the hooks it implements."""
    from redco.plugins import list_plugins
    rows = list_plugins()
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    for row in rows:
        print(f"{row['name']:<16} {row['source']:<28} {', '.join(row['hooks'])}")


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


def cmd_rules(args) -> None:
    """Print the sharding plan of a model: each param's spec and bytes per device."""
    simulate_devices(args.devices)
    import tempfile

    import jax

    from redco import Deployer
    from redco.inspection import draw_png, format_table, load_model, plan_table
    model = load_model(args.model)
    with tempfile.TemporaryDirectory() as workdir:
        deployer = Deployer(jax_seed=0, n_model_shards=args.n_model_shards, workdir=workdir,
                            sharding_rules=args.rules, loggers=(), verbose=False,
                            n_local_devices=args.devices)
        rules = deployer.get_sharding_rules(model.params, trace_fn=model.trace_fn)
        rows = plan_table(deployer, model.params, rules)
        mesh_shape = dict(deployer.mesh.shape)
        deployer.close()
    if args.json:
        print(json.dumps([dict(r, spec=str(r["spec"])) for r in rows], indent=2))
    else:
        print(f"{args.model}: sharding_rules={args.rules!r}, n_model_shards={args.n_model_shards}, "
              f"{'dataflow' if model.trace_fn else 'names'}, {jax.devices()[0].platform}")
        print(format_table(rows, mesh_shape))
    if args.png:
        try:
            draw_png(rows, args.png, title=f"{args.model} {args.rules} {mesh_shape}")
        except ImportError as e:
            sys.exit(f"redco: {e}")
        print(f"wrote {args.png}")


def cmd_plan(args) -> None:
    """Pick the smallest model-parallel layout whose train step fits the device memory."""
    simulate_devices(args.devices)
    from redco.inspection import load_model, parse_bytes
    from redco.planner import PlanError, plan
    model = load_model(args.model, seq_len=args.seq_len)
    memory = parse_bytes(args.device_memory)
    if model.loss_fn is not None:
        loss, batch = model.loss_fn, model.batch(args.batch)
    else:
        print("(no loss_fn: the mean of the model's outputs on its own example input stands "
              "for the loss; --seq-len and --batch are not used)")
        loss, batch = model.trace_fn, None
    print(f"{args.model}: {args.devices} devices x {args.device_memory}, per-device batch "
          f"{args.batch} x seq {args.seq_len}, AdamW, fp32; per-device peak of the compiled "
          "train step:")
    try:
        result = plan(model.params, loss, batch, n_devices=args.devices,
                      device_memory_bytes=memory, rule_sets=args.rules.split(","),
                      try_all=args.all, log=lambda line: print("  " + line, flush=True))
    except PlanError as e:
        sys.exit(f"redco: {e}")
    print(f"pick: n_model_shards={result.n_model_shards}, sharding_rules="
          f"{result.sharding_rules!r} (peak {result.peak_bytes / memory:.0%} of device memory)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="redco", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    plugins = commands.add_parser("plugins", help=cmd_plugins.__doc__)
    plugins.add_argument("--json", action="store_true", help="print JSON")
    plugins.set_defaults(run=cmd_plugins)

    model_help = ("llama-tiny, llama-7b, llama-13b, llama-30b, llama-65b, or module:function "
                  "returning params, (params, trace_fn) or (params, trace_fn, loss_fn)")
    rules = commands.add_parser("rules", help=cmd_rules.__doc__)
    rules.add_argument("model", help=model_help)
    rules.add_argument("--n_model_shards", type=int, default=2)
    rules.add_argument("--devices", type=int, default=8, help="simulated CPU devices")
    rules.add_argument("--rules", default="auto", help="rule set: auto, fsdp, auto+fsdp, ...")
    rules.add_argument("--png", help="also draw the plan to this PNG (needs matplotlib)")
    rules.add_argument("--json", action="store_true", help="print JSON")
    rules.set_defaults(run=cmd_rules)

    plan = commands.add_parser("plan", help=cmd_plan.__doc__)
    plan.add_argument("--model", required=True, help=model_help)
    plan.add_argument("--devices", type=int, required=True, help="simulated CPU devices")
    plan.add_argument("--device-memory", required=True, help="per device, e.g. 40GB (GiB)")
    plan.add_argument("--seq-len", type=int, default=1024)
    plan.add_argument("--batch", type=int, default=1, help="per-device batch size")
    plan.add_argument("--rules", default="auto,auto+fsdp", help="rule sets to try, in order")
    plan.add_argument("--all", action="store_true", help="measure every layout, not just up "
                      "to the first that fits")
    plan.set_defaults(run=cmd_plan)
    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
