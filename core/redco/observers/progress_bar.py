"""A tqdm bar per epoch, showing the last update's loss, grad norm, learning rate, tokens/s and
MFU (where known); on process 0, when the deployer shows progress."""
from __future__ import annotations

import tqdm

from redco.plugins import hookimpl

SHOWN = {"loss": "loss", "grad_norm": "grad_norm", "lr": "lr", "perf/tokens_per_s": "tok/s",
         "perf/mfu": "mfu"}


class ProgressBar:
    def __init__(self, trainer):
        self.bar: tqdm.tqdm | None = None

    @hookimpl
    def on_epoch_start(self, trainer, epoch, start, n_steps, desc):
        self.bar = tqdm.tqdm(initial=start, total=n_steps, desc=desc, dynamic_ncols=True,
                             disable=not trainer.deployer.show_progress, leave=bool(desc))

    @hookimpl
    def on_step_end(self, trainer, step, metrics):
        if self.bar is None:
            return
        self.bar.set_postfix({label: f"{metrics[key]:.4g}" for key, label in SHOWN.items()
                              if key in metrics}, refresh=False)
        self.bar.update(1)

    @hookimpl
    def on_epoch_end(self, trainer, epoch):
        if self.bar is not None:
            self.bar.close()
            self.bar = None
