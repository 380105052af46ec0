"""What the host does around each update, in every loop (``epoch_loop.py``,
``scanned_updates.py``, ``run_context.py``): time its phases for the observers, log how the
first step compiled, and read its metrics back (a NaN or inf loss stops training; the hang
watchdog hears of the update; the observers add theirs and get them all)."""
from __future__ import annotations

import contextlib
import time
from typing import Any

import jax
import numpy as np

from redco import checkpointing, compile_cache


@contextlib.contextmanager
def timed(trainer: Any, phase: str, step: int | None = None):
    """Time what runs inside; tell the observers (``on_time_spent``)."""
    start = time.perf_counter()
    yield
    trainer.hooks.on_time_spent(trainer=trainer, phase=phase, seconds=time.perf_counter() - start,
                                step=step)


def run_update(trainer: Any, batch) -> dict:
    """One update (metrics still on the device); the first one after the step is (re)made is
    timed and logged: how long tracing and compiling took, and whether the program came from
    the compile cache."""
    if trainer.steps.first_run:
        trainer.state, metrics = trainer.steps.train(trainer.state, batch)
        return metrics
    trainer.steps.batch_shapes = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), batch)
    start, (hits, misses) = time.perf_counter(), compile_cache.counts()
    trainer.state, metrics = trainer.steps.train(trainer.state, batch)
    seconds, (new_hits, new_misses) = time.perf_counter() - start, compile_cache.counts()
    where = trainer.deployer.compile_cache_dir
    source = ("compile cache off" if where is None else
              f"compiled, and kept in the compile cache {where}" if new_misses > misses else
              f"loaded from the compile cache {where}" if new_hits > hits else
              "already compiled in this process")
    trainer.deployer.log_info(f"First train step traced and compiled in {seconds:.2f} s "
                              f"({source}).")
    trainer.steps.first_run = True
    return metrics


def report(trainer: Any, step: int, metrics: dict) -> None:
    """Update ``step``'s metrics, on the host: stop on a NaN or inf loss, tell the hang
    watchdog, add the observers' metrics (throughput) and hand them all to ``on_step_end``."""
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    if not all(np.isfinite(metrics.get(k, 0.0)) for k in ("loss", "grad_norm")):
        trainer.checkpoints.join()  # a write in flight holds an earlier, good state
        found = checkpointing.step_ckpts(trainer.deployer.ckpt_dir)
        kept = (f"the last good checkpoint, {found[-1]}, is kept" if found
                else "no checkpoint was written")
        raise FloatingPointError(
            f"Training stopped at step {step}: loss is {metrics.get('loss')}, grad_norm is "
            f"{metrics.get('grad_norm')}; {kept}. Lower the learning rate or check the data.")
    if trainer.context is not None:
        trainer.context.progress(step)
    for extra in trainer.hooks.collect_step_metrics(trainer=trainer, step=step, metrics=metrics):
        metrics.update(extra or {})
    trainer.hooks.on_step_end(trainer=trainer, step=step, metrics=metrics)
