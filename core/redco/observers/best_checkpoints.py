"""The best checkpoints by metric: ``fit(save_argmin_ckpt_by_metrics=[...],
save_argmax_ckpt_by_metrics=[...])`` keeps, for each metric named, the params of the evaluation
where it was lowest (highest) so far, as ``ckpts/best_<metric>`` (its meta holds the step, the
epoch and the value). The best values so far are saved in every step checkpoint and restored
with it, so a resumed run only replaces a best checkpoint with a better one."""
from __future__ import annotations

import numpy as np

from redco.plugins import hookimpl


class BestCheckpoints:
    def __init__(self, trainer):
        self.rules: list[tuple[str, np.ufunc]] = []
        self.best: dict[str, float] = {}
        self.resumed = False  # this fit resumed with the best values of an earlier run

    @hookimpl
    def on_resume(self, trainer, state):
        self.best, self.resumed = dict(state.get("best", {})), True

    @hookimpl
    def on_fit_start(self, trainer, fit_options):
        if not self.resumed:
            self.best = {}
        self.rules = [(name, better) for key, better in (("save_argmin_ckpt_by_metrics", np.less),
                                                         ("save_argmax_ckpt_by_metrics", np.greater))
                      for name in fit_options.get(key) or ()]

    @hookimpl
    def on_eval_end(self, trainer, epoch, metrics):
        for name, better in self.rules:
            if name not in metrics:
                raise KeyError(f"save_arg*_ckpt_by_metrics names {name!r} but the eval "
                               f"metrics are {sorted(metrics)}.")
            if name in self.best and not better(metrics[name], self.best[name]):
                continue
            self.best[name] = metrics[name]
            path = trainer.deployer.save_ckpt(
                f"best_{name}", {"params": trainer.state.params},
                {"step": trainer.step, "epoch": epoch, name: metrics[name]})
            trainer.deployer.log_info(f"Saved {path} ({name} = {metrics[name]:.5g}).")
            trainer.hooks.on_checkpoint_saved(trainer=trainer, path=path, step=trainer.step)

    @hookimpl
    def state_to_save(self):
        return {"best": self.best}

    @hookimpl
    def on_fit_end(self):
        self.rules, self.resumed = [], False
