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


def cmd_launch(args) -> None:
    """Start a command as the processes of one run: an sbatch job (slurm), one command line per
    host (ip), or an XManager work unit (xmanager)."""
    from redco import launch
    command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    try:
        if args.launcher == "slurm":
            job = launch.SlurmJob(
                command=command, nodes=args.nodes, ntasks_per_node=args.ntasks_per_node,
                job_name=args.job_name, directory=args.workdir, partition=args.partition,
                time=args.time, cpus_per_task=args.cpus_per_task,
                gpus_per_node=args.gpus_per_node, extra=tuple(args.sbatch))
            code = launch.launch_slurm(job, dry_run=args.dry_run, wait=args.wait)
        elif args.launcher == "ip":
            if not args.hosts:
                raise launch.LaunchError("--launcher ip needs --hosts a,b,... (one entry per "
                                         "process; repeat a host to run several on it)")
            hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
            code = launch.launch_ip(command, hosts, args.port, run=args.run_here,
                                    host0_address=args.host0_address)
        else:  # xmanager
            from redco import xmanager_launch
            code = xmanager_launch.launch(command, args.n_processes, args.port, args.job_name)
    except launch.LaunchError as e:
        print(f"redco launch: {e}", file=sys.stderr)
        sys.exit(2)
    sys.exit(code)


def cmd_doctor(args) -> None:
    """Print the devices, the process index and count, the launcher this process detects and
    why, and the mesh a Deployer(n_model_shards=1) builds."""
    from redco.launch import doctor
    doctor(launcher=args.launcher, n_local_devices=args.n_local_devices)


def cmd_zoo(args) -> None:
    """List the installed zoo pipelines, or run one: redco zoo run NAME --help."""
    from redco.plugins import lookup, registry
    if args.action == "list":
        for name, pipeline in registry("zoo_pipelines").items():
            print(f"{name:<14} {pipeline.description}")
        return
    if not args.name:
        sys.exit("redco zoo run: name a pipeline (redco zoo list shows them).")
    pipeline = lookup("zoo_pipelines", args.name)
    parser = argparse.ArgumentParser(prog=f"redco zoo run {args.name}",
                                     description=pipeline.description)
    pipeline.add_arguments(parser)
    pipeline.run(parser.parse_args(args.rest))


def cmd_new(args) -> None:
    """Write a new project from a template: redco new --template NAME DEST (--list shows them)."""
    from redco.plugins import lookup, registry
    if args.list or not args.dest:
        for name, directory in registry("templates").items():
            print(f"{name:<14} {directory}")
        return
    from redco.scaffold import write_project
    dest = write_project(lookup("templates", args.template), args.dest)
    print(f"wrote {dest}: cd {args.dest} && pip install -e . && pytest")


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

    launch = commands.add_parser(
        "launch", help=cmd_launch.__doc__,
        usage="redco launch --launcher {slurm,ip,xmanager} [options] -- command ...")
    launch.add_argument("--launcher", required=True, choices=["slurm", "ip", "xmanager"])
    slurm = launch.add_argument_group("slurm: write an sbatch script running the command under "
                                      "srun, and submit it")
    slurm.add_argument("--nodes", type=int, default=1)
    slurm.add_argument("--ntasks-per-node", type=int, default=1,
                       help="processes per node (one per GPU, or one per node with all of them)")
    slurm.add_argument("--partition")
    slurm.add_argument("--time", help="time limit, e.g. 1:00:00")
    slurm.add_argument("--cpus-per-task", type=int)
    slurm.add_argument("--gpus-per-node", type=int)
    slurm.add_argument("--job-name", default="redco")
    slurm.add_argument("--sbatch", action="append", default=[], metavar="OPTION",
                       help="another #SBATCH option, e.g. --sbatch=--account=abc (repeatable)")
    slurm.add_argument("--workdir", default=".",
                       help="where the script and the job's output file go (default: here)")
    slurm.add_argument("--dry-run", action="store_true", help="print the script, submit nothing")
    slurm.add_argument("--wait", action="store_true", help="poll squeue until the job ends, "
                       "print its output, exit with its exit code")
    ip = launch.add_argument_group("ip: one command line per host, with the REDCO_* variables "
                                   "the ip launcher reads")
    ip.add_argument("--hosts", help="comma-separated, one entry per process; host 0 first")
    ip.add_argument("--host0-address", help="host 0's address as the others reach it "
                    "(default: the first host)")
    ip.add_argument("--port", type=int, default=12355, help="host 0's coordinator port")
    ip.add_argument("--run", dest="run_here", action="store_true",
                    help="run the processes here (every host must be this machine) and wait")
    xm = launch.add_argument_group("xmanager: one XManager work unit, processes joined by ip")
    xm.add_argument("--n-processes", type=int, default=2)
    launch.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")
    launch.set_defaults(run=cmd_launch)

    doctor = commands.add_parser("doctor", help=cmd_doctor.__doc__)
    doctor.add_argument("--launcher", help="use this launcher instead of detecting one")
    doctor.add_argument("--n_local_devices", type=int, help="use only this many local devices")
    doctor.set_defaults(run=cmd_doctor)
    new = commands.add_parser("new", help=cmd_new.__doc__)
    new.add_argument("dest", nargs="?", help="the project's directory (must not exist)")
    new.add_argument("--template", default="minimal")
    new.add_argument("--list", action="store_true", help="list the templates")
    new.set_defaults(run=cmd_new)

    zoo = commands.add_parser("zoo", help=cmd_zoo.__doc__)
    zoo.add_argument("action", choices=["list", "run"])
    zoo.add_argument("name", nargs="?", help="the pipeline to run")
    zoo.add_argument("rest", nargs=argparse.REMAINDER, help="its flags (see --help)")
    zoo.set_defaults(run=cmd_zoo)
    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
