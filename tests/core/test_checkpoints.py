"""Checkpoint directories, with orbax (the built-in format): bad checkpoints fail clearly, resume
guards, recovery after a kill between renames, third-party formats plug in through entry points.
What must hold for every format (bit-equal restores onto any mesh, resume, forged files refused,
reading without redco) is tests/formats, run over orbax and the format plugins."""
import dataclasses
import os
import re
import threading
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from ckpt_helpers import REPO, assert_bit_equal, biggest_file, copy_ckpt, host, lm_trainer, placed
from flax import nnx
from helpers import (
    LM_CONFIG,
    lm_collate,
    lm_examples,
    lm_loss,
    lm_model,
    mlp_apply,
    mlp_collate,
    mlp_examples,
    mlp_init,
    mlp_loss,
)

import redco
from redco import Deployer, Trainer, checkpointing, layer_stacks, plugins
from redco.protocols import CheckpointFormat
from redco.sharding import named_leaves
from redco_zoo_models import LlamaConfig, LlamaForCausalLM, split_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A trained LM's orbax step checkpoint, written on dp4 x mp2: ``(path, {name: array})``."""
    trainer = lm_trainer(str(tmp_path_factory.mktemp("orbax")), 2, "orbax")
    trainer.fit(lm_examples(32), 2, n_epochs=1)
    return trainer.save_step_ckpt(0), host(trainer.ckpt_tree())


# ---- clear errors ----------------------------------------------------------------------------
def test_a_checkpoint_of_another_model_names_the_first_mismatch(saved, tmp_path):
    """The first array of another shape is named; a model of other shapes with its layers
    stored the other way is no other layout of the same model: the checkpoint has none of its
    arrays (``relayout`` converts only what matches layer for layer)."""
    path, want = saved
    stacked = any(layer_stacks.layers_of(n) for n in want)  # (the saved layout)
    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, scan_layers=stacked)
    trainer = placed(lm_trainer(str(tmp_path), model=split_model(LlamaForCausalLM(cfg, nnx.Rngs(0)))))
    name, shape = next((n, np.shape(x)) for n, x in named_leaves(trainer.ckpt_tree())
                       if np.shape(x) != want[n].shape)
    assert "mlp" in name
    message = f"{name} has shape {want[name].shape} in the checkpoint but {shape} here"
    with pytest.raises(ValueError, match=re.escape(message)):
        trainer.deployer.load_ckpt(path, trainer.ckpt_tree())
    flipped = dataclasses.replace(cfg, scan_layers=not stacked)  # other shapes, other layout
    _, shapes = split_model(nnx.eval_shape(lambda: LlamaForCausalLM(flipped, nnx.Rngs(0))))
    with pytest.raises(ValueError, match="does not match this model: it has no array "
                                         "params/model/layers/"):
        checkpointing.load(path, {"params": shapes})


# ---- layer layouts: a checkpoint of the layers one by one, resumed stacked, and back ------------
def lm_in_layout(stacked: bool):
    """``lm_model``'s LLaMA and params with its 2 layers stored ``stacked`` (``scan_layers``:
    ``model/layers/0:2/...``) or one by one, whichever ``LM_CONFIG`` stores: ``(apply_fn,
    params)``."""
    cfg = dataclasses.replace(LM_CONFIG, scan_layers=stacked)
    apply_fn, shapes = split_model(nnx.eval_shape(lambda: LlamaForCausalLM(cfg, nnx.Rngs(0))))
    named = layer_stacks.unstack(dict(named_leaves(lm_model()[1])))
    paths = [p for p, _ in named_leaves(shapes)]
    named = layer_stacks.stack(named, [p for p in paths if layer_stacks.layers_of(p)], jnp.stack)
    return apply_fn, jax.tree.unflatten(jax.tree.structure(shapes), [named[p] for p in paths])


class Resumed:
    """The state a fit resumed (layer by layer: ``layer_stacks.unstack``) and its losses."""

    def __init__(self):
        self.state, self.losses = None, []

    @redco.hookimpl
    def on_resume(self, trainer, step, state):
        self.state = layer_stacks.unstack(host(trainer.ckpt_tree()))

    @redco.hookimpl
    def on_step_end(self, trainer, step, metrics):
        self.losses.append(metrics["loss"])


def resume_one_step(ckpt, workdir, stacked: bool) -> tuple[Resumed, dict]:
    """``ckpt`` resumed by the LM (its layers ``stacked`` or not) on dp4 x mp2 for one update,
    saved as a safetensors step checkpoint: ``(what it resumed, its state after, per layer)``."""
    copy_ckpt(ckpt, workdir / "ckpts")
    resumed = Resumed()
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=str(workdir), verbose=False,
                        checkpoint_format="safetensors")
    apply_fn, params = lm_in_layout(stacked)
    trainer = Trainer(deployer, lm_collate, apply_fn, lm_loss, params, optax.adamw(1e-3),
                      callbacks=[resumed])
    next_step = checkpointing.read_meta(ckpt)["step"] + 1
    trainer.fit(lm_examples(32), 2, n_epochs=2, max_steps=next_step, save_last_ckpt=True)
    return resumed, layer_stacks.unstack(host(trainer.ckpt_tree()))


def test_a_checkpoint_resumes_into_the_model_with_its_layers_stored_the_other_way(saved, tmp_path):
    """The LM's orbax step checkpoint (``saved``: its layers one by one) resumed by the LM with
    its layers stacked (the default flipped under a run), and the stacked safetensors checkpoint
    that run writes resumed one by one (``--no_scan_layers``): params and optimizer state
    restored bit for bit, layer by layer, and the next update's loss that of the resume in the
    checkpoint's own layout. (Saved stacked, the two resumes go the other way round.)"""
    path, want = saved
    flipped = not any(layer_stacks.layers_of(p) for p in want)  # stacked, where saved one by one
    there, after = resume_one_step(path, tmp_path / "there", flipped)
    assert_bit_equal(there.state, layer_stacks.unstack(want))
    same, _ = resume_one_step(path, tmp_path / "same", not flipped)
    assert len(there.losses) == len(same.losses) == 1  # one update each, after the resume
    np.testing.assert_allclose(there.losses, same.losses, rtol=1e-6)
    written = str(tmp_path / "there" / "ckpts" / "step_5")
    arrays = checkpointing.read_meta(written)["arrays"]
    assert any(layer_stacks.layers_of(p) for p in arrays) == flipped, list(arrays)
    back, _ = resume_one_step(written, tmp_path / "back", not flipped)
    assert_bit_equal(back.state, after)
    again, _ = resume_one_step(written, tmp_path / "again", flipped)
    assert len(back.losses) == len(again.losses) == 1
    np.testing.assert_allclose(back.losses, again.losses, rtol=1e-6)


def test_a_missing_or_unfinished_checkpoint_is_named(saved, tmp_path):
    path, _ = saved
    with pytest.raises(FileNotFoundError, match=r"No checkpoint directory .*step_99\. .* holds "
                                                r"\['step_4'\]"):
        checkpointing.load(os.path.join(os.path.dirname(path), "step_99"), {})
    unfinished = tmp_path / "step_3"
    os.makedirs(unfinished / "state")
    with pytest.raises(FileNotFoundError, match="not a complete redco checkpoint"):
        checkpointing.load(str(unfinished), {})


def test_a_truncated_or_corrupted_file_is_refused(saved, tmp_path):
    path, want = saved
    target = {"params": jax.tree.map(np.asarray, lm_model()[1])}
    truncated = copy_ckpt(path, tmp_path / "t")
    big = biggest_file(truncated)
    with open(big, "r+b") as f:
        f.truncate(os.path.getsize(big) // 2)
    with pytest.raises(ValueError, match=f"{re.escape(big)} is truncated or damaged"):
        checkpointing.load(truncated, target)
    corrupted = copy_ckpt(path, tmp_path / "c")
    big = biggest_file(corrupted)
    with open(big, "r+b") as f:
        f.seek(os.path.getsize(big) // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ValueError, match=f"{re.escape(big)} is corrupted"):
        checkpointing.load(corrupted, target)


def test_no_pickle_or_eval_in_redco():
    unsafe = re.compile(r"import pickle|pickle\.|\beval\(|\bexec\(|allow_pickle=True")
    source = os.path.join(REPO, "core", "redco")
    for directory, _, files in os.walk(source):
        for name in files:
            if name.endswith(".py"):
                text = open(os.path.join(directory, name)).read()
                assert not unsafe.search(text), name


# ---- resume guards -------------------------------------------------------------------------
def test_resuming_with_other_data_is_refused_before_training(tmp_path):
    trainer = lm_trainer(str(tmp_path))
    trainer.fit(lm_examples(32), 2, n_epochs=1, save_every_n_steps=2)
    again = lm_trainer(str(tmp_path))
    with pytest.raises(ValueError, match=r"Cannot resume from .*step_4: n_examples was 32, now 40"):
        again.fit(lm_examples(40), 2, n_epochs=1)
    assert again.step == 0


def test_nan_stops_training_and_keeps_the_last_good_checkpoint(workdir):
    def loss_fn(rng, state, params, batch, is_training):  # blows up at the 6th update
        loss = mlp_loss(rng, state, params, batch, is_training)
        return jax.lax.cond(state.step >= 5, lambda: loss * np.nan, lambda: loss)

    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=workdir, verbose=False)
    trainer = Trainer(deployer, mlp_collate, mlp_apply, loss_fn, mlp_init(), optax.sgd(0.1))
    with pytest.raises(FloatingPointError, match=r"Training stopped at step 6: loss is nan, "
                                                 r"grad_norm is nan; the last good checkpoint, "
                                                 r".*step_4, is kept"):
        trainer.fit(mlp_examples(128), 2, n_epochs=2, save_every_n_steps=2, keep_last_ckpts=5)
    assert checkpointing.step_ckpts(trainer.deployer.ckpt_dir)[-1].endswith("step_4")
    tree, _ = deployer.load_ckpt(os.path.join(deployer.ckpt_dir, "step_4"),
                                 {"params": trainer.params})
    assert all(np.isfinite(x).all() for x in host(tree).values())


def test_a_kill_between_renames_is_recovered_and_resume_false_keeps_old_runs_apart(tmp_path):
    trainer = lm_trainer(str(tmp_path))
    trainer.fit(lm_examples(32), 2, n_epochs=1, save_every_n_steps=2)  # step_4 kept
    ckpts = tmp_path / "ckpts"
    os.rename(ckpts / "step_4", ckpts / "step_4.old")  # killed after the first rename ...
    os.makedirs(ckpts / "step_6.tmp" / "state")        # ... and a write that never finished
    again = lm_trainer(str(tmp_path))
    again.fit(lm_examples(32), 2, n_epochs=1, save_every_n_steps=2)
    assert again.step == 4 and sorted(os.listdir(ckpts)) == ["step_4"]
    fresh = lm_trainer(str(tmp_path))
    with pytest.raises(ValueError, match="holds step checkpoints of an earlier run; with "
                                         "resume=False"):
        fresh.fit(lm_examples(32), 2, n_epochs=1, save_every_n_steps=2, resume=False)
    assert sorted(os.listdir(ckpts)) == ["step_4"]


# ---- third-party formats -------------------------------------------------------------------
PLUGIN = '''
import os
import numpy as np
import jax
import redco
from redco.checkpointing import host_arrays, place
from redco.protocols import CheckpointFormat


class NpzFormat(CheckpointFormat):
    def save(self, path, tree):
        arrays = host_arrays(tree)
        if jax.process_index() == 0:
            os.makedirs(path)
            np.savez(os.path.join(path, "arrays.npz"), **{k.replace("/", "|"): v for k, v in arrays.items()})

    def load(self, path, target):
        data = np.load(os.path.join(path, "arrays.npz"), allow_pickle=False)
        return place(target, lambda name, index: data[name.replace("/", "|")][index])


@redco.hookimpl
def register_checkpoint_formats(register):
    register("npz", NpzFormat())
'''


def test_a_third_party_format_registers_through_entry_points(tmp_path, monkeypatch):
    (tmp_path / "npz_format.py").write_text(PLUGIN)
    dist_info = tmp_path / "npz_format-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: npz-format\nVersion: 0.1\n")
    (dist_info / "entry_points.txt").write_text("[redco]\nnpz = npz_format\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("REDCO_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.delenv("REDCO_PLUGINS", raising=False)
    try:
        trainer = lm_trainer(str(tmp_path / "workdir"), fmt="npz")
        assert plugins.plugin_sources["npz"] == "npz-format 0.1"
        trainer.fit(lm_examples(32), 2, n_epochs=1, save_last_ckpt=True)
        path = os.path.join(trainer.deployer.ckpt_dir, "step_4")
        assert os.listdir(os.path.join(path, "state")) == ["arrays.npz"]
        other = placed(lm_trainer(str(tmp_path / "other"), n_model_shards=4))
        tree, meta = other.deployer.load_ckpt(path, other.ckpt_tree())
        assert meta["format"] == "npz"
        assert_bit_equal(host(tree), host(trainer.ckpt_tree()))
        # A reader that fails on intact files: the error says so, and nothing is deleted.
        npz_format = type(plugins.lookup("checkpoint_formats", "npz"))
        monkeypatch.setattr(npz_format, "load", lambda self, path, target: {}["no such array"])
        with pytest.raises(ValueError, match=r"as a npz checkpoint \(KeyError.*Its files are "
                                             r"intact.*check the target's dtypes and shardings"):
            other.deployer.load_ckpt(path, other.ckpt_tree())
        assert os.listdir(os.path.join(path, "state")) == ["arrays.npz"]
    finally:
        plugins.pm.unregister(name="npz")


def test_one_checkpoint_is_written_at_a_time_and_both_land(tmp_path):
    """A step checkpoint written in the background and a best-by-metric one saved meanwhile on
    the training thread: orbax loses files when two of its saves run at once, so redco writes
    one checkpoint at a time. While the first save is inside the format, a second is started
    on another thread: it must not enter the format until the first is done (without the lock
    it enters at once: red in every run), and both land complete."""
    real = plugins.lookup("checkpoint_formats", "orbax")
    inside, second_entered, errors = threading.Event(), threading.Event(), []
    tree = {"params": {"w": np.arange(64 * 64, dtype=np.float32).reshape(64, 64)}}

    def save(name):
        try:
            checkpointing.save(str(tmp_path), name, tree, {"step": 0}, "one-at-a-time")
        except Exception as e:  # noqa: BLE001 - collected, then asserted none
            errors.append(f"{name}: {type(e).__name__}: {e}")
    second = threading.Thread(target=save, args=("best_loss",))

    class StartsASecondSave(CheckpointFormat):
        def save(self, path, tree):
            if inside.is_set():  # the second save, in the format
                second_entered.set()
            else:
                inside.set()
                second.start()
                assert not second_entered.wait(timeout=1), "two saves ran at once"
            real.save(path, tree)

        def load(self, path, target):
            return real.load(path, target)

    plugin = types.SimpleNamespace(register_checkpoint_formats=redco.hookimpl(
        lambda register: register("one-at-a-time", StartsASecondSave())))
    plugins.pm.register(plugin, name="one-at-a-time")
    try:
        save("step_2")
        second.join(timeout=120)
        assert not second.is_alive() and errors == [] and second_entered.is_set()
        for name in ("step_2", "best_loss"):
            loaded, meta = checkpointing.load(str(tmp_path / name), tree)
            np.testing.assert_array_equal(np.asarray(loaded["params"]["w"]), tree["params"]["w"])
    finally:
        plugins.pm.unregister(name="one-at-a-time")


class Killed(BaseException):
    """What a SIGKILL leaves on disk, in-process: nothing after the point it is raised runs."""


@pytest.mark.parametrize("killed_at", ["writing", "between the renames"])
def test_a_kill_while_resaving_under_an_existing_name_keeps_the_earlier_one(
        tmp_path, monkeypatch, killed_at):
    """``best_loss`` saved again (a better metric): killed while the new one is written, or
    after the old one was moved aside and before the new one took its name, the next start
    (``recover``) leaves the earlier ``best_loss`` complete, in its place."""
    first = {"w": np.full((8, 8), 1.0, np.float32)}
    checkpointing.save(str(tmp_path), "best_loss", first, {"step": 2}, "orbax")
    if killed_at == "writing":
        fmt = type(plugins.lookup("checkpoint_formats", "orbax"))
        monkeypatch.setattr(fmt, "save", lambda self, path, tree: (_ for _ in ()).throw(Killed()))
    else:
        rename = os.rename

        def second_rename_killed(src, dst):
            if src.endswith(".tmp"):
                raise Killed()
            rename(src, dst)
        monkeypatch.setattr(os, "rename", second_rename_killed)
    with pytest.raises(Killed):
        checkpointing.save(str(tmp_path), "best_loss", {"w": np.zeros((8, 8), np.float32)},
                           {"step": 4}, "orbax")
    monkeypatch.undo()
    left = sorted(os.listdir(tmp_path))
    assert left == (["best_loss", "best_loss.tmp"] if killed_at == "writing"
                    else ["best_loss.old", "best_loss.tmp"])
    checkpointing.recover(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["best_loss"]
    loaded, meta = checkpointing.load(str(tmp_path / "best_loss"), first)
    assert meta["step"] == 2
    np.testing.assert_array_equal(np.asarray(loaded["w"]), first["w"])


def test_a_checkpoint_that_does_not_fit_on_the_disk_says_so_and_keeps_the_earlier_one(tmp_path):
    """The second save of ``best_loss`` runs out of room part way (the process's file-size
    limit, RLIMIT_FSIZE, stops orbax's writes as a full disk does: the kernel refuses them):
    one error naming the checkpoint and what to do, the partial write removed, the earlier
    ``best_loss`` complete."""
    import resource
    rng = np.random.default_rng(0)
    first = {"w": rng.normal(size=(256, 256)).astype(np.float32)}  # 256 KB, incompressible
    checkpointing.save(str(tmp_path), "best_loss", first, {"step": 2}, "orbax")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
    try:
        with pytest.raises(OSError, match=r"No room to write checkpoint .*best_loss: the disk "
                                          r"\(or a quota or file-size limit\) is full .*The "
                                          r"checkpoints already in .* are kept"):
            checkpointing.save(str(tmp_path), "best_loss", {"w": first["w"] + 1}, {"step": 4},
                               "orbax")
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert os.listdir(tmp_path) == ["best_loss"]
    loaded, meta = checkpointing.load(str(tmp_path / "best_loss"), first)
    assert meta["step"] == 2
    np.testing.assert_array_equal(np.asarray(loaded["w"]), first["w"])


def test_train_epoch_outside_fit_returns_with_its_checkpoints_written(workdir):
    """A background write that ``train_epoch`` started is complete, and announced through
    ``on_checkpoint_saved``, when it returns. The write is held until the epoch's last update
    has been reported, so a ``train_epoch`` that does not wait for it returns first."""
    epoch_ended, announced = threading.Event(), []

    class WrittenAfterTheEpoch(CheckpointFormat):
        real = plugins.lookup("checkpoint_formats", "orbax")

        def save(self, path, tree):
            assert epoch_ended.wait(timeout=60), "on_epoch_end was never called"
            self.real.save(path, tree)

        def load(self, path, target):
            return self.real.load(path, target)

    class Observer:
        @redco.hookimpl
        def on_epoch_end(self, trainer, epoch):
            epoch_ended.set()

        @redco.hookimpl
        def on_checkpoint_saved(self, trainer, path, step):
            announced.append(step)

    fmt = WrittenAfterTheEpoch()
    plugin = types.SimpleNamespace(register_checkpoint_formats=redco.hookimpl(
        lambda register: register("written-after-the-epoch", fmt)))
    plugins.pm.register(plugin, name="written-after-the-epoch")
    try:
        deployer = Deployer(jax_seed=0, workdir=workdir, verbose=False,
                            checkpoint_format="written-after-the-epoch")
        trainer = Trainer(deployer, mlp_collate, mlp_apply, mlp_loss, mlp_init(),
                          optax.sgd(0.1), callbacks=[Observer()])
        trainer.train_epoch(mlp_examples(64), 2, epoch=0, save_every_n_steps=2)  # 4 updates
        assert announced == [2]
        assert checkpointing.step_ckpts(deployer.ckpt_dir) == [f"{deployer.ckpt_dir}/step_2"]
    finally:
        plugins.pm.unregister(name="written-after-the-epoch")
