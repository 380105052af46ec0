"""Step checkpoints: everything a resume needs, written when ``fit`` asks and read back when it
starts, so a rerun of the same command continues from the exact step.

``ckpts/step_<N>`` holds the state (params, optimizer state, rng; ``Trainer.ckpt_tree()``), the
step and epoch, the data position (how many examples, the seed, examples per update: what fixes
which examples come next) and every plugin's ``state_to_save``. ``StepCheckpoints`` is the
component ``fit`` calls for them; resuming with other data or settings is refused naming what
changed, since the run would not see the examples the interrupted one would have.
"""
from __future__ import annotations

from typing import Any

from redco import checkpointing


class StepCheckpoints:
    def __init__(self, trainer: Any):
        self.trainer = trainer
        self.data_position: dict = {}  # with the step, fixes which examples come next

    def start(self, resume: bool, saves: bool) -> None:
        """At a trainer's first fit: resume from the newest step checkpoint (``resume``), or
        refuse to write (``saves``) step checkpoints beside an earlier run's."""
        ckpt_dir = self.trainer.deployer.ckpt_dir
        if not resume and saves and checkpointing.step_ckpts(ckpt_dir):
            raise ValueError(
                f"{ckpt_dir} holds step checkpoints of an earlier run; with resume=False this "
                "run's would be mixed with (and pruned against) them. Use a new workdir, or "
                "delete the old checkpoints first.")
        if resume:
            self.resume()

    def resume(self) -> dict | None:
        """Restore the newest step checkpoint onto the trainer's state (with its step, and the
        plugins' state through ``on_resume``); its meta, or None where there is none."""
        trainer, deployer = self.trainer, self.trainer.deployer
        checkpointing.recover(deployer.ckpt_dir)
        found = checkpointing.step_ckpts(deployer.ckpt_dir)
        if not found:
            return None
        saved = checkpointing.read_meta(found[-1]).get("data", {})
        changed = [f"{k} was {saved.get(k)}, now {v}" for k, v in self.data_position.items()
                   if saved.get(k) != v]
        if changed:
            raise ValueError(
                f"Cannot resume from {found[-1]}: {'; '.join(changed)}, so this run would not "
                "see the examples the interrupted one would have. Rerun with the same data and "
                "settings, use a new workdir, or pass fit(resume=False) to start over.")
        tree, meta = deployer.load_ckpt(found[-1], trainer.ckpt_tree())
        trainer.set_train_state(step=meta["step"])
        trainer.state = trainer.state.replace(**tree)
        deployer.forget_metrics_after(meta["step"])
        deployer.log_info(f"Resumed from {found[-1]} (step {meta['step']}).")
        state = meta.get("plugins", {"best": meta.get("best", {})})  # (best: redco <= 0.5.x)
        trainer.hooks.on_resume(trainer=trainer, step=meta["step"], state=state)
        return meta

    def save(self, epoch: int, keep: int) -> str:
        """Write ``ckpts/step_<step>`` and keep the newest ``keep``; its path."""
        trainer = self.trainer
        step = trainer.step
        path = trainer.deployer.save_ckpt(f"step_{step}", trainer.ckpt_tree(), {
            "step": step, "epoch": epoch, "data": self.data_position,
            "plugins": trainer.hooks.saved_state(trainer, step)})
        checkpointing.prune(trainer.deployer.ckpt_dir, keep)
        return path
