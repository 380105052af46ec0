"""Bad input is refused before anything compiles, with a message naming the problem and fix,
and nothing already saved is lost: every test whose run has a ``workdir`` starts with an earlier
run's step checkpoints in it (``ckpts/step_1`` to ``step_4``: every step the refused fit would
reach, save over or prune) and ends with them byte for byte unchanged."""
import contextlib
import hashlib
import os
import re
import shutil
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mlp_apply, mlp_collate, mlp_examples, mlp_init, mlp_loss

from redco import Deployer, Trainer, plugins

COMPILE_EVENTS = ("/jax/core/compile/jaxpr_to_mlir_module_duration",
                  "/jax/core/compile/backend_compile_duration")


def make_trainer(workdir, collate_fn=mlp_collate, loss_fn=mlp_loss, **kwargs):
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=workdir, verbose=False)
    return Trainer(deployer, collate_fn, mlp_apply, loss_fn, mlp_init(), optax.sgd(0.1), **kwargs)


@pytest.fixture(scope="module")
def earlier_ckpts(tmp_path_factory) -> str:
    """The ``ckpts`` an earlier run of the fit these tests make (32 examples, 4 steps) left: a
    step checkpoint at every step a rerun reaches, the directories its saves would overwrite,
    its pruning delete and its resume read."""
    workdir = str(tmp_path_factory.mktemp("earlier"))
    make_trainer(workdir).fit(mlp_examples(32), 2, n_epochs=1, save_every_n_steps=1,
                              keep_last_ckpts=4)
    ckpts = os.path.join(workdir, "ckpts")
    assert sorted(os.listdir(ckpts)) == [f"step_{i}" for i in range(1, 5)]
    return ckpts


def digest(directory: str) -> str:
    h = hashlib.sha256()
    for root, dirs, files in sorted(os.walk(directory)):
        for name in sorted(files):
            path = os.path.join(root, name)
            h.update(os.path.relpath(path, directory).encode())
            h.update(open(path, "rb").read())
    return h.hexdigest()


def digests(ckpts: str, names: list[str]) -> dict[str, str | None]:
    """Each checkpoint's digest, None for one that is gone."""
    return {name: digest(os.path.join(ckpts, name))
            if os.path.isdir(os.path.join(ckpts, name)) else None for name in names}


@pytest.fixture(autouse=True)
def saved_work_is_kept(request, earlier_ckpts):
    if "workdir" not in request.fixturenames:
        yield
        return
    kept = os.path.join(request.getfixturevalue("workdir"), "ckpts")
    shutil.copytree(earlier_ckpts, kept)
    before = digests(kept, sorted(os.listdir(earlier_ckpts)))
    yield
    after = digests(kept, list(before))
    changed = [name for name in before if after[name] != before[name]]
    assert not changed, f"the earlier run's checkpoints {changed} in {kept} were changed or removed"


def fit_refused(trainer, examples, per_device_batch_size=2):
    trainer.fit(examples, per_device_batch_size, n_epochs=1)
    pytest.fail("fit should have refused")


def test_n_model_shards_must_divide_devices(workdir):
    with pytest.raises(ValueError, match=r"n_model_shards=3 .*dividing the number of devices "
                                         r"\(8\).*\[1, 2, 4, 8\]"):
        Deployer(jax_seed=0, n_model_shards=3, workdir=workdir)


def test_collate_returning_lists_is_refused(workdir):
    trainer = make_trainer(workdir, collate_fn=lambda exs: {"x": [list(e["x"]) for e in exs]})
    with pytest.raises(TypeError, match=r"collate_fn output\['x'\] is a list, not an array"):
        fit_refused(trainer, mlp_examples(32))
    assert trainer.state is None  # refused at the first batch: nothing placed, nothing compiled


def test_collate_returning_ragged_rows_is_refused(workdir):
    ragged = lambda exs: {"x": np.array([np.zeros(i + 1) for i in range(len(exs))], dtype=object),
                          "y": mlp_collate(exs)["y"]}
    with pytest.raises(TypeError, match=r"\['x'\] has dtype object \(ragged rows\?\). Pad"):
        fit_refused(make_trainer(workdir, collate_fn=ragged), mlp_examples(32))


def test_collate_with_mismatched_batch_sizes_is_refused(workdir):
    short = lambda exs: {"x": mlp_collate(exs)["x"], "y": mlp_collate(exs)["y"][:-1]}
    # (caught on the first device's batch, collated to trace the loss: 2 examples)
    with pytest.raises(ValueError, match=r"\['y'\] has shape \(1, 1\) but the batch has 2 "
                                         r"examples"):
        fit_refused(make_trainer(workdir, collate_fn=short), mlp_examples(32))


def test_non_scalar_loss_is_refused_before_compiling(workdir):
    per_example = lambda rng, state, params, batch, is_training: jnp.mean(
        (state.apply_fn(params, batch["x"]) - batch["y"]) ** 2, axis=1)
    trainer = make_trainer(workdir, loss_fn=per_example)
    with pytest.raises(ValueError, match=r"loss_fn must return a scalar, but returned \(2,\). "
                                         r"Reduce it"):
        fit_refused(trainer, mlp_examples(32))
    assert trainer.state is None  # refused at the first batch: nothing placed, nothing compiled


def test_empty_dataset_is_refused(workdir):
    with pytest.raises(ValueError, match="train_examples is empty"):
        fit_refused(make_trainer(workdir), [])


def test_batch_larger_than_dataset_is_refused(workdir):
    with pytest.raises(ValueError, match=r"global batch \(64 examples\) is larger than "
                                         r"train_examples \(32 examples\). Lower"):
        fit_refused(make_trainer(workdir), mlp_examples(32), per_device_batch_size=16)


def test_multisteps_disagreeing_with_accumulation_is_refused(workdir):
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=workdir, verbose=False)
    with pytest.raises(ValueError, match=r"MultiSteps\(every_k_schedule=2\) disagrees with "
                                         r"accumulate_grad_batches=4"):
        Trainer(deployer, mlp_collate, mlp_apply, mlp_loss, mlp_init(),
                optax.MultiSteps(optax.sgd(0.1), 2), accumulate_grad_batches=4)


def test_unknown_plugin_names_are_refused(workdir):
    with pytest.raises(ValueError, match=r"No checkpoint formats named 'nope'. Available: "
                                         r"\[.*'orbax'.*\]"):
        Deployer(jax_seed=0, workdir=workdir, checkpoint_format="nope")


def test_a_missing_plugin_of_this_repository_names_the_distribution_to_install(workdir,
                                                                                monkeypatch):
    """What a user who asks for checkpoint_format="msgpack" without redco-msgpack sees (the
    name is made up here, so the test does not depend on what this environment installed)."""
    monkeypatch.setitem(plugins.PROVIDED_BY, "zstd", "redco-zstd")
    with pytest.raises(ValueError, match=r"No checkpoint formats named 'zstd'.*To use it, pip "
                                         r"install redco-zstd \(./plugins/zstd in redco's"):
        Deployer(jax_seed=0, workdir=workdir, checkpoint_format="zstd")


@pytest.mark.parametrize("kwargs, named", [
    ({"per_device_batch_size": -2}, "per_device_batch_size=-2"),
    ({"per_device_batch_size": 0}, "per_device_batch_size=0"),
    ({"per_device_batch_size": 2.5}, "per_device_batch_size=2.5"),
    ({"n_epochs": -1}, "n_epochs=-1"),
    ({"n_epochs": 0}, "n_epochs=0"),
    ({"keep_last_ckpts": 0}, "keep_last_ckpts=0"),
    ({"save_every_n_steps": 0}, "save_every_n_steps=0"),
    ({"eval_per_device_batch_size": -1, "eval_examples": mlp_examples(8)},
     "eval_per_device_batch_size=-1"),
])
def test_bad_numbers_given_to_fit_are_refused_before_compiling(workdir, kwargs, named):
    trainer = make_trainer(workdir)
    args = {"per_device_batch_size": 2, "n_epochs": 1, **kwargs}
    with pytest.raises(ValueError, match=re.escape(named) + r": use an integer >= \d"):
        trainer.fit(mlp_examples(32), **args)
    assert trainer.state is None and trainer.step == 0  # nothing placed, compiled or trained


@pytest.mark.parametrize("kwargs, named", [
    ({"train_size": 0}, "train_size=0: use an integer >= 1"),
    ({"learning_rate": -1e-3}, "learning_rate=-0.001: use a number >= 0"),
    ({"warmup_rate": 1.5}, "warmup_rate=1.5: use a number from 0 to 1"),
    ({"warmup_ratio": -0.1}, "warmup_rate=-0.1: use a number from 0 to 1"),
    ({"warmup_steps": -5}, "warmup_steps=-5: use an integer >= 0 (or None)"),
    ({"n_epochs": "3"}, "n_epochs='3': use an integer >= 1"),
])
def test_bad_numbers_given_to_the_lr_schedule_are_refused(workdir, kwargs, named):
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=workdir, verbose=False)
    args = {"train_size": 64, "per_device_batch_size": 2, "n_epochs": 1, "learning_rate": 1e-3,
            **kwargs}
    with pytest.raises(ValueError, match=re.escape(named)):
        deployer.get_lr_schedule_fn(**args)


def test_a_negative_seed_is_refused(workdir):
    with pytest.raises(ValueError, match=r"jax_seed=-1: use an integer >= 0"):
        Deployer(jax_seed=-1, workdir=workdir)


def test_text_from_collate_fn_is_refused_naming_the_key(workdir):
    texts = lambda exs: {"x": mlp_collate(exs)["x"], "y": mlp_collate(exs)["y"],
                         "name": np.array([f"row {i}" for i in range(len(exs))])}
    trainer = make_trainer(workdir, collate_fn=texts)
    with pytest.raises(TypeError, match=r"collate_fn output\['name'\] holds strings \(<U\d+\): "
                                        r"return numbers, e\.g\. token ids"):
        fit_refused(trainer, mlp_examples(32))
    assert trainer.state is None


@pytest.mark.parametrize("pred_fn, output_fn, message", [
    (lambda params, batch: mlp_apply(params, batch["x"]).sum(), None,
     r"pred_fn output has shape \(\) but the batch has 8 examples"),
    (lambda params, batch: {"y": mlp_apply(params, batch["x"]), "mean": batch["x"].mean()}, None,
     r"pred_fn output\['mean'\] has shape \(\) but the batch has 8 examples"),
    (lambda params, batch: mlp_apply(params, batch["x"]), lambda preds: [preds.sum()],
     r"output_fn returned 1 outputs for a batch of 8 examples"),
])
def test_predictions_without_one_row_per_example_are_refused(workdir, pred_fn, output_fn,
                                                             message):
    from redco import Predictor
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=workdir, verbose=False)
    predictor = Predictor(deployer, mlp_collate, pred_fn, output_fn=output_fn)
    with pytest.raises(ValueError, match=message):
        predictor.predict(mlp_examples(8), per_device_batch_size=2, params=mlp_init())


def mse_metric(examples, preds):
    return {"mse": float(np.mean([(p - e["y"]) ** 2 for p, e in zip(preds, examples)]))}


@contextlib.contextmanager
def compiles() -> Iterator[list[str]]:
    """The compile events JAX records inside the block: each program lowered to MLIR (a
    persistent compile cache hit included) and each backend compile."""
    seen: list[str] = []

    def listen(event: str, duration: float, **_) -> None:
        if event in COMPILE_EVENTS:
            seen.append(event)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)


def test_a_misspelled_metric_is_refused_before_compiling(workdir):
    from redco import Predictor
    trainer = make_trainer(workdir)
    predictor = Predictor(trainer.deployer, mlp_collate, lambda params, batch: mlp_apply(
        params, batch["x"]))
    evaluation = {"eval_examples": mlp_examples(8), "eval_predictor": predictor,
                  "eval_metric_fn": mse_metric}
    with compiles() as compiled, pytest.raises(
            KeyError, match=r"names \['msee'\] but the eval metrics are \['loss', 'mse'\] \(found "
                            r"before compiling"):
        trainer.fit(mlp_examples(32), 2, n_epochs=1, save_argmin_ckpt_by_metrics=["msee"],
                    **evaluation)
    assert compiled == [], f"fit compiled ({compiled}) before refusing the metric name"
    assert trainer.state is None and trainer.step == 0  # nothing placed or trained
    with compiles() as compiled:  # named right: the listener sees it compile; it resumes from
        trainer.fit(mlp_examples(32), 2, n_epochs=2, save_argmin_ckpt_by_metrics=["mse"],
                    **evaluation)  # the earlier run's step_4 and trains the second epoch
    assert compiled and trainer.step == 8


def test_a_workdir_that_is_a_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("mine")
    with pytest.raises(ValueError, match=rf"workdir='{re.escape(str(path))}' cannot be used: .*"
                                         r"\(it is a file\). Give a directory"):
        Deployer(jax_seed=0, workdir=str(path))
    assert path.read_text() == "mine"


def test_params_that_are_not_arrays_are_refused_naming_the_path(workdir):
    params = mlp_init()
    params["Dense_3"]["bias"] = 0.5
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=workdir, verbose=False)
    with pytest.raises(TypeError, match=r"params\['Dense_3'\]\['bias'\] is a float, not an "
                                        r"array: make it one, e\.g\. np\.asarray"):
        Trainer(deployer, mlp_collate, mlp_apply, mlp_loss, params, optax.sgd(0.1))


def test_a_damaged_meta_json_names_the_checkpoint(tmp_path):
    """In a workdir of its own: the checkpoint it damages is its own run's."""
    workdir = str(tmp_path / "own")
    trainer = make_trainer(workdir)
    trainer.fit(mlp_examples(32), 2, n_epochs=1, save_last_ckpt=True)
    meta = os.path.join(workdir, "ckpts", "step_4", "meta.json")
    with open(meta, "a") as f:
        f.write("}garbage")
    again = make_trainer(workdir)
    with pytest.raises(ValueError, match=rf"{re.escape(meta)} is damaged \(not JSON: .*\)\. "
                                         r"Restore it, or delete .*step_4 to use an older"):
        again.fit(mlp_examples(32), 2, n_epochs=2, save_last_ckpt=True)
    assert os.path.isdir(os.path.join(workdir, "ckpts", "step_4"))  # nothing deleted
