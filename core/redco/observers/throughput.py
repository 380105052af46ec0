"""Throughput and MFU of every update, logged with its metrics (``perf/...``):

* ``step_time_s``: the wall time of one update in steady state: collating its batch plus
  dispatching it and waiting for the previous update's metrics (the loop reads them one update
  behind, so the device is never idle for the host). Compiling, checkpoints and evaluations are
  not counted.
* ``examples_per_s`` and ``tokens_per_s``: the update's examples and tokens (``Trainer``'s
  ``count_tokens``, counted inside the step) over ``step_time_s``.
* ``mfu``: model FLOPs utilisation, the FLOPs of one update (``Trainer.step_flops()``: the
  matrix products of the traced step, fused attention included, the whole batch, every device;
  with remat, the recomputation is counted too; ``redco/step_flops.py`` says why not XLA's
  cost analysis) over ``step_time_s`` times the devices' peak FLOP/s.
  The peak is the dense bf16 figure of the device kind (``PEAK_TFLOPS``), or
  ``$REDCO_PEAK_TFLOPS`` (per device) where set. A CPU, or a device kind not in the table,
  logs no MFU; for the latter one note says how to set the peak.
"""
from __future__ import annotations

import os
import re

import jax

from redco.plugins import hookimpl

# device_kind pattern -> dense bf16 peak TFLOP/s per device (vendor datasheets), first match wins
PEAK_TFLOPS = (
    (r"H100 PCIe", 756.0), (r"H100 NVL", 835.0), (r"H100", 989.0), (r"H200", 989.0),
    (r"A100", 312.0), (r"\bL4\b", 121.0),
    (r"TPU v4", 275.0), (r"TPU v5 ?(lite|e)", 197.0), (r"TPU v5p?$", 459.0),
    (r"TPU v6 ?(lite|e)", 918.0),
)
OVERRIDE = "REDCO_PEAK_TFLOPS"


def peak_tflops(device: jax.Device) -> float | None:
    """The peak dense bf16 TFLOP/s of ``device`` (``$REDCO_PEAK_TFLOPS`` first), None if
    unknown."""
    if os.environ.get(OVERRIDE):
        try:
            return float(os.environ[OVERRIDE])
        except ValueError:
            raise ValueError(f"{OVERRIDE}={os.environ[OVERRIDE]!r} is not a number: give the "
                             "peak TFLOP/s of one device, e.g. 989 for an H100 SXM.") from None
    for pattern, tflops in PEAK_TFLOPS:
        if re.search(pattern, device.device_kind):
            return tflops
    return None


def no_mfu_note(device: jax.Device, tflops: float | None) -> str | None:
    """What to say when an accelerator's MFU cannot be logged (a CPU's is never logged)."""
    if tflops is not None or device.platform == "cpu":
        return None
    return (f"MFU is not logged: the peak FLOP/s of a {device.device_kind!r} is not known to "
            f"redco. Set {OVERRIDE}=<peak TFLOP/s of one device> to log it.")


class Throughput:
    def __init__(self, trainer):
        self.seconds = 0.0  # of the update being timed, since the last report
        self.examples_per_step = 0
        self.peak_flops: float | None = None  # all devices, per second
        self.flops: float | None = None  # of one update

    @hookimpl
    def on_fit_start(self, trainer):
        device = trainer.deployer.devices[0]
        tflops = peak_tflops(device)
        self.peak_flops = None if tflops is None else tflops * 1e12 * len(trainer.deployer.devices)
        note = no_mfu_note(device, tflops)
        if note:
            trainer.deployer.log_info(note)

    @hookimpl
    def on_epoch_start(self, trainer, examples_per_step):
        self.examples_per_step = examples_per_step

    @hookimpl
    def on_time_spent(self, trainer, phase, seconds):
        if phase == "compile":
            self.seconds, self.flops = 0.0, None  # a new step: its FLOPs are read again
        elif phase in ("data", "step"):
            self.seconds += seconds

    @hookimpl
    def collect_step_metrics(self, trainer, metrics):
        seconds, self.seconds = self.seconds, 0.0
        if seconds <= 0:
            return None
        out = {"perf/step_time_s": seconds,
               "perf/examples_per_s": self.examples_per_step / seconds}
        if "tokens" in metrics:
            out["perf/tokens_per_s"] = metrics["tokens"] / seconds
        if self.peak_flops is not None:
            if self.flops is None:
                self.flops = trainer.step_flops()
            if self.flops:
                out["perf/mfu"] = self.flops / seconds / self.peak_flops
        return out
