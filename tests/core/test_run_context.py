"""``trainer.run()``: a loop that is not ``fit`` (here a user's own rounds, each trained on its
own examples, as an RL loop's rollouts) gets fit's guarantees: SIGTERM saves and exits 143, the
rerun resumes the trainer's state and the loop's own state from the checkpoint and ends where an
uninterrupted run ends, bitwise; checkpoints come at the cadence asked."""
import os
import signal

import jax
import numpy as np
import optax
import pytest
from helpers import mlp_apply, mlp_collate, mlp_examples, mlp_init, mlp_loss

from redco import Deployer, Trainer, checkpointing
from redco.preemption import Preempted

N_ROUNDS, PER_DEVICE = 5, 2  # 8 devices: 16 examples per update, 2 updates per round


class Rounds:
    """The loop's own state: which round comes next."""

    def __init__(self):
        self.round = 0

    def state_dict(self) -> dict:
        return {"round": self.round}

    def load_state_dict(self, state: dict) -> None:
        self.round = state["round"]


def own_loop(workdir, sigterm_after_round=None, **run_options):
    """Rounds of two updates on that round's examples; SIGTERM to itself after a round."""
    deployer = Deployer(jax_seed=0, workdir=str(workdir), verbose=False)
    trainer = Trainer(deployer, mlp_collate, mlp_apply, mlp_loss, mlp_init(n_layers=3),
                      optax.adam(1e-2))
    trainer.prepare(mlp_examples(16), PER_DEVICE)  # the layout, before the run
    loop = Rounds()
    with trainer.run(loop=loop, **run_options) as run:
        resumed_at = loop.round
        while loop.round < N_ROUNDS:
            trainer.train_epoch(mlp_examples(32, seed=loop.round), PER_DEVICE, epoch=loop.round)
            loop.round += 1
            if loop.round == sigterm_after_round:
                os.kill(os.getpid(), signal.SIGTERM)
            run.step_done()
    return jax.device_get(trainer.params), run.resumed_from, resumed_at


def test_a_sigterm_saves_and_the_rerun_resumes_the_loop_to_the_same_bits(tmp_path):
    whole, resumed_from, _ = own_loop(tmp_path / "whole")
    assert resumed_from is None
    with pytest.raises(Preempted) as stopped:
        own_loop(tmp_path / "cut", sigterm_after_round=2)
    assert stopped.value.code == 143
    assert "Stopped by SIGTERM after step 4" in stopped.value.reason
    assert [os.path.basename(p) for p in checkpointing.step_ckpts(tmp_path / "cut" / "ckpts")] \
        == ["step_4"]
    cut, resumed_from, resumed_at = own_loop(tmp_path / "cut")
    assert os.path.basename(resumed_from) == "step_4" and resumed_at == 2
    jax.tree.map(np.testing.assert_array_equal, cut, whole)


def test_checkpoints_come_every_n_steps_and_at_the_end(tmp_path):
    own_loop(tmp_path, save_every_n_steps=4, keep_last_ckpts=10)
    assert [os.path.basename(p) for p in checkpointing.step_ckpts(tmp_path / "ckpts")] == \
        ["step_4", "step_8", "step_10"]
    _, resumed_from, resumed_at = own_loop(tmp_path)  # all done: resumes at the end, trains none
    assert os.path.basename(resumed_from) == "step_10" and resumed_at == N_ROUNDS


def test_a_run_before_the_layout_is_decided_is_refused(tmp_path):
    deployer = Deployer(jax_seed=0, workdir=str(tmp_path), verbose=False)
    trainer = Trainer(deployer, mlp_collate, mlp_apply, mlp_loss, mlp_init(), optax.adam(1e-2))
    with pytest.raises(RuntimeError, match=r"call trainer.prepare"):
        trainer.run(loop=Rounds())


def test_the_docs_own_loop_block_runs_as_written_and_resumes(tmp_path):
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from readme_blocks import block

    def names():
        deployer = Deployer(jax_seed=0, workdir=str(tmp_path), verbose=False)
        return {"trainer": Trainer(deployer, mlp_collate, mlp_apply, mlp_loss,
                                   mlp_init(n_layers=3), optax.adam(1e-2)),
                "examples": mlp_examples(16),
                "make_examples": lambda i: mlp_examples(32, seed=i)}
    first = names()
    exec(block("own-loop", "docs/guides/checkpoints.md"), first)  # noqa: S102 - the docs' own code
    assert first["loop"].done == 5 and first["trainer"].step == 10
    assert [os.path.basename(p) for p in checkpointing.step_ckpts(tmp_path / "ckpts")] == \
        ["step_10"]
    again = names()
    exec(block("own-loop", "docs/guides/checkpoints.md"), again)  # noqa: S102 - a rerun: resumes at the end, trains nothing
    assert again["loop"].done == 5 and again["trainer"].step == 10
    assert os.path.basename(again["run"].resumed_from) == "step_10"
