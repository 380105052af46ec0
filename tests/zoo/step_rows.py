"""A hook the zoo's training tests share: each update's loss and gradient norm, in order."""
import redco


class StepRows:
    """``rows``: ``(loss, grad_norm)`` of every update, as ``on_step_end`` reports them."""

    def __init__(self):
        self.rows = []

    @redco.hookimpl
    def on_step_end(self, trainer, step, metrics):
        self.rows.append((metrics["loss"], metrics["grad_norm"]))
