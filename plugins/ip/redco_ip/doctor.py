"""``redco doctor``: which launcher this process picks and why, then what the joined run looks like.

Run it the way training runs (``srun -n 2 redco doctor``, or the ``redco launch --launcher ip``
command lines) to check a cluster before a long job. It prints every registered launcher in the
order ``Deployer`` tries them, with its ``explain``, then joins the run through ``Deployer``
exactly as training would, and prints the process index and count, the devices and the mesh of
``Deployer(n_model_shards=1)``.

A ``redco`` command registered by this distribution (``register_commands``): every ``redco``
process that builds a registry imports this module, so jax and the ``Deployer`` are imported only
when the command runs.
"""
from __future__ import annotations

import argparse
import tempfile

from redco import plugins
from redco.protocols import Command


class Doctor(Command):
    description = ("Print which launcher this process picks and why, then join the run and print "
                   "the process index and count, the devices and the mesh of "
                   "Deployer(n_model_shards=1).")

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--launcher", help="use this launcher instead of detecting one")
        parser.add_argument("--n_local_devices", type=int, help="use only this many local devices")

    def run(self, args: argparse.Namespace) -> None:
        launchers = plugins.registry("launchers")
        config = dict(n_processes=None, host0_address=None, host0_port=None, process_id=None,
                      n_local_devices=args.n_local_devices)
        chosen = args.launcher or next(name for name, ln in launchers.items() if ln.detect(config))
        print("launchers (tried in this order):")
        for name, ln in launchers.items():
            verdict = "given by --launcher" if name == args.launcher else (
                "detected" if ln.detect(config) else "not detected")
            print(f" {'->' if name == chosen else '  '} {name:<8} {verdict}: {ln.explain(config)}")
        print(f"launcher: {chosen}", flush=True)

        import jax

        from redco import Deployer
        with tempfile.TemporaryDirectory() as workdir:
            deployer = Deployer(jax_seed=0, n_model_shards=1, workdir=workdir, loggers=(),
                                verbose=False, launcher=args.launcher,
                                n_local_devices=args.n_local_devices)
            devices = deployer.devices
            local = [d for d in devices if d.process_index == jax.process_index()]
            print(f"process: {jax.process_index()} of {jax.process_count()}")
            print(f"devices: {len(devices)} in all, {len(local)} here, platform "
                  f"{devices[0].platform}, kind {', '.join(sorted({d.device_kind for d in devices}))}")
            print(f"local devices: {[d.id for d in local]}")
            ids = [[d.id for d in row] for row in deployer.mesh.devices.reshape(
                deployer.mesh.shape["dp"], -1)]
            shown = ids if len(ids) <= 16 else ids[:8] + ["..."] + ids[-4:]
            print(f"mesh of Deployer(n_model_shards=1): {dict(deployer.mesh.shape)}, device ids by "
                  f"dp row: {shown}", flush=True)
            deployer.close()
