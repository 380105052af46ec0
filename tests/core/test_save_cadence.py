"""When step checkpoints are written, against the rules written out here from the docs:

* ``trainer.run(save_every_n_steps=N)`` (``redco/run_context.py``): after a unit of the loop
  whose step count crossed a multiple of N since the last save (a round of several updates
  counts them all), and at the end unless that step was just saved;
* ``trainer.run(save_every_minutes=M)``: after a unit that ends M minutes or more after the
  last save, never sooner;
* ``fit(save_every_n_steps=N)`` (``redco/epoch_loop.py``): at every multiple of N and at every
  epoch's end (an epoch's last update is saved once, by the epoch's end).

Each run records the steps announced through ``on_checkpoint_saved``."""
import time

import optax
from helpers import mlp_apply, mlp_collate, mlp_examples, mlp_init, mlp_loss

import redco
from redco import Deployer, Trainer

PER_DEVICE = 2  # 8 devices: 16 examples per update


class Saves:
    """Each step checkpoint: its step when announced, and when its save began (``state_to_save``
    is asked on the training thread as a save starts)."""

    def __init__(self):
        self.steps, self.began = [], []

    @redco.hookimpl
    def on_checkpoint_saved(self, trainer, path, step):
        self.steps.append(step)

    @redco.hookimpl
    def state_to_save(self, trainer, step):
        self.began.append(time.monotonic())


def trainer_of(workdir, saves: Saves) -> Trainer:
    deployer = Deployer(jax_seed=0, workdir=str(workdir), verbose=False)
    return Trainer(deployer, mlp_collate, mlp_apply, mlp_loss, mlp_init(n_layers=3),
                   optax.sgd(1e-2), callbacks=[saves])


def crossing_rule(round_ends: list[int], every: int) -> list[int]:
    """The steps saved by the docstring's rule, written out: a save after the round whose step
    count went past a multiple of ``every`` since the last save, and one at the end unless the
    last round's step was just saved."""
    saved, last = [], 0
    for step in round_ends:
        if step // every > last // every:
            saved.append(step)
            last = step
    return saved if saved and saved[-1] == round_ends[-1] else saved + [round_ends[-1]]


def test_a_run_saves_after_the_round_that_crosses_a_multiple_of_n_and_at_the_end(tmp_path):
    """Rounds of 2 updates end at steps 2, 4, ..., 14; every 3 steps: 3 is crossed by the round
    ending at 4, 6 by 6, 9 by 10, 12 by 12, and the end (14) is saved too."""
    saves = Saves()
    trainer = trainer_of(tmp_path, saves)
    trainer.prepare(mlp_examples(16), PER_DEVICE)
    with trainer.run(save_every_n_steps=3, keep_last_ckpts=20) as run:
        for round_ in range(7):
            trainer.train_epoch(mlp_examples(32, seed=round_), PER_DEVICE, epoch=round_)
            run.step_done()
    assert saves.steps == crossing_rule(list(range(2, 15, 2)), 3) == [4, 6, 10, 12, 14]


def test_fit_saves_at_each_multiple_of_n_and_at_each_epochs_end(tmp_path):
    """Epochs of 5 updates (80 examples, 16 an update), 3 of them, every 3 steps: 3, the end of
    the first epoch (5), 6, 9, the second's end (10), 12, and 15, both a multiple and the last
    epoch's end, once."""
    saves = Saves()
    trainer_of(tmp_path, saves).fit(mlp_examples(80), PER_DEVICE, n_epochs=3,
                                    save_every_n_steps=3, keep_last_ckpts=20)
    assert saves.steps == [3, 5, 6, 9, 10, 12, 15]


def run_by_minutes(workdir, minutes: float, n_rounds: int | None = None, until=None):
    """Rounds of 2 updates under ``save_every_minutes=minutes``, for ``n_rounds`` or until
    ``until(rounds)`` (a deadline of 60 s). Returns the saves, the times just before and just
    inside the run's entry, and per round ``(before step_done, after it, whether it saved)``."""
    saves, rounds = Saves(), []
    trainer = trainer_of(workdir, saves)
    trainer.prepare(mlp_examples(16), PER_DEVICE)
    deadline = time.monotonic() + 60
    entering = time.monotonic()
    with trainer.run(save_every_minutes=minutes, keep_last_ckpts=1000) as run:
        entered = time.monotonic()
        while len(rounds) != n_rounds and not (until and until(rounds)):
            assert time.monotonic() < deadline, \
                f"after 60 s: {len(rounds)} rounds, {len(saves.steps)} saves: {saves.steps[:8]}..."
            trainer.train_epoch(mlp_examples(32, seed=len(rounds)), PER_DEVICE, epoch=len(rounds))
            n_began, before = len(saves.began), time.monotonic()
            run.step_done()
            rounds.append((before, time.monotonic(), len(saves.began) > n_began))
    return saves, (entering, entered), rounds


def test_a_tiny_interval_saves_every_round_and_a_huge_one_only_at_the_end(tmp_path):
    saves, _, _ = run_by_minutes(tmp_path / "tiny", 1e-9, n_rounds=4)
    assert saves.steps == [2, 4, 6, 8]  # each round ends later than 60 ns after the last save
    saves, _, _ = run_by_minutes(tmp_path / "huge", 1e6, n_rounds=4)
    assert saves.steps == [8]  # none by time: the end's only


def test_a_save_by_minutes_comes_once_the_interval_has_passed_and_not_before(tmp_path):
    """With 0.25 s between saves and rounds of a few ms: a round saves iff it ended 0.25 s or
    more after the last save. Bounds that hold however loaded the machine: a round that saved
    ended (at the latest when its ``step_done`` returned) at least 0.25 s after the previous
    save began (or the run was entered); a round that did not ended (at the earliest when its
    ``step_done`` was called) less than 0.25 s after the previous save's ``step_done``
    returned (or the run's entry did)."""
    interval = 0.25

    def until(rounds) -> bool:  # 3 saves, and 3 rounds without one after the first save
        saved = [s for *_, s in rounds]
        return sum(saved) >= 3 and True in saved and saved[saved.index(True):].count(False) >= 3
    saves, (entering, entered), rounds = run_by_minutes(tmp_path, interval / 60, until=until)
    began = iter(saves.began)
    last_began, last_returned = entering, entered
    for i, (before, after, saved) in enumerate(rounds):
        if saved:
            assert after - last_began >= interval, (i, after - last_began)
            last_began, last_returned = next(began), after
        else:
            assert before - last_returned < interval, (i, before - last_returned)
    assert saves.steps[:3] == [2 * (i + 1) for i, r in enumerate(rounds) if r[2]][:3]
