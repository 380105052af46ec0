"""fit / eval / predict semantics, checkpoints and resume, logs."""
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import Recorder, mlp_apply, mlp_collate, mlp_examples, mlp_init, mlp_loss

import redco
from redco import Deployer, Predictor, Trainer


def make_trainer(workdir, n_model_shards=2, **kwargs):
    deployer = Deployer(jax_seed=0, n_model_shards=n_model_shards, workdir=workdir,
                        verbose=False)
    return Trainer(deployer, mlp_collate, mlp_apply, mlp_loss, mlp_init(), optax.adam(1e-2),
                   **kwargs)


def test_eval_loss_counts_every_example_by_size(workdir):
    trainer = make_trainer(workdir)
    examples = mlp_examples(37)  # 4 dp * 4 per device = 16: two full batches and 5 left over
    loss = trainer.eval_loss(examples, 4)  # the first batch: the layout is decided, state placed
    params = jax.device_get(trainer.params)
    per_example = [float(mlp_loss(None, trainer.state, params, mlp_collate([e]), False))
                   for e in examples]
    np.testing.assert_allclose(loss, np.mean(per_example), rtol=1e-6)


def test_compile_train_step_analyses_the_step_fit_runs_without_running_it(workdir):
    """The step for 4 rows per device and 2 micro-batches, compiled ahead of time: XLA's memory
    and FLOPs per device, no update made; too few examples is refused naming the fix."""
    trainer = make_trainer(workdir, accumulate_grad_batches=2)
    with pytest.raises(ValueError, match="Lower per_device_batch_size"):
        trainer.compile_train_step(mlp_examples(31), 4)  # 4 dp x 4 rows x 2 micro-batches: 32
    before = jax.device_get(trainer.params)
    compiled = trainer.compile_train_step(mlp_examples(32), 4)
    assert compiled.memory_analysis().argument_size_in_bytes > 0
    assert compiled.cost_analysis()["flops"] > 0
    assert trainer.step == 0
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(jax.device_get(trainer.params))):
        np.testing.assert_array_equal(a, b)
    trainer.fit(mlp_examples(32), per_device_batch_size=4, n_epochs=1)
    assert trainer.step == 1


def test_predict_returns_one_output_per_example_in_order(workdir):
    trainer = make_trainer(workdir)
    examples = mlp_examples(21)
    pred_fn = lambda pred_rng, params, batch: mlp_apply(params, batch["x"])[:, 0]
    predictor = trainer.get_default_predictor(pred_fn=pred_fn)
    preds = predictor.predict(examples, per_device_batch_size=2, params=trainer.params)
    expected = mlp_apply(jax.device_get(trainer.params), mlp_collate(examples)["x"])[:, 0]
    assert len(preds) == 21
    np.testing.assert_allclose(np.array(preds), expected, atol=1e-6)
    with_output_fn = Predictor(trainer.deployer, mlp_collate, pred_fn,
                               output_fn=lambda batch_preds: [f"{p:.3f}" for p in batch_preds])
    texts = with_output_fn.predict(examples, 3, params=jax.device_get(trainer.params))
    assert texts == [f"{p:.3f}" for p in expected]


@pytest.mark.parametrize("n_model_shards", [1, 2])
def test_fit_leaves_the_callers_device_params_alive(workdir, n_model_shards):
    """The train step donates its state; the trainer's copy, not the arrays it was given."""
    params = jax.device_put(mlp_init())  # on device 0, which the mesh's first shard is on too
    deployer = Deployer(jax_seed=0, n_model_shards=n_model_shards, workdir=workdir, verbose=False)
    trainer = Trainer(deployer, mlp_collate, mlp_apply, mlp_loss, params, optax.adam(1e-2))
    trainer.fit(mlp_examples(64), 4, n_epochs=1)
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(params))
    np.testing.assert_array_equal(params["Dense_0"]["kernel"], mlp_init()["Dense_0"]["kernel"])


@pytest.mark.parametrize("verbose", [True, False])
def test_verbose_false_keeps_the_terminal_quiet_and_still_logs(tmp_path, capsys, verbose):
    deployer = Deployer(jax_seed=0, workdir=str(tmp_path), verbose=verbose)
    trainer = Trainer(deployer, mlp_collate, mlp_apply, mlp_loss, mlp_init(), optax.adam(1e-2))
    predictor = trainer.get_default_predictor(lambda rng, params, batch: batch["x"][:, 0])
    trainer.fit(mlp_examples(64), 4, n_epochs=1, eval_examples=mlp_examples(16),
                eval_predictor=predictor)
    out = capsys.readouterr()
    printed = out.out + out.err
    if verbose:  # progress bars and log lines
        assert "epoch 1/1" in printed and "predict epoch 1" in printed and "eval" in printed
    else:
        assert printed == "", printed
    assert "epoch 1 eval" in (tmp_path / "log.txt").read_text()


def test_rng_argument_names_and_short_signatures(workdir):
    """loss_fn(train_rng, ...), loss_fn(rng, ...) and the paper's loss_fn(batch, params)."""
    def paper_style(batch, params):
        return jnp.mean((mlp_apply(params, batch["x"]) - batch["y"]) ** 2)

    def with_rng(rng, params, batch):
        noise = jax.random.normal(rng, ()) * 0.0
        return paper_style(batch, params) + noise

    losses = []
    for loss_fn in (mlp_loss, paper_style, with_rng):
        recorder = Recorder()
        deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=workdir, verbose=False)
        Trainer(deployer, mlp_collate, mlp_apply, loss_fn, mlp_init(), optax.sgd(0.1),
                callbacks=[recorder]).fit(mlp_examples(32), 2, n_epochs=1, resume=False)
        losses.append(recorder.losses)
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)
    np.testing.assert_allclose(losses[0], losses[2], rtol=1e-6)


def test_compute_dtype_runs_loss_in_bfloat16_and_keeps_fp32_params(workdir):
    seen = []

    def loss_fn(rng, state, params, batch, is_training):
        seen.append(params["Dense_0"]["kernel"].dtype)
        return mlp_loss(rng, state, params, batch, is_training).astype(jnp.float32)

    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=workdir, verbose=False)
    trainer = Trainer(deployer, mlp_collate, mlp_apply, loss_fn, mlp_init(), optax.sgd(0.1),
                      compute_dtype=jnp.bfloat16)
    trainer.fit(mlp_examples(32), 2, n_epochs=1)
    assert seen and all(d == jnp.bfloat16 for d in seen)
    assert trainer.params["Dense_0"]["kernel"].dtype == jnp.float32


def test_compute_dtype_reaches_every_matmul_of_the_zoo_llama(workdir):
    """nnx.Embed pins its output dtype at init; the zoo model must still compute in bf16."""
    from helpers import lm_examples, lm_model

    from redco_zoo_lm import collate_fn, loss_fn
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=workdir, verbose=False)
    apply_fn, params = lm_model()
    trainer = Trainer(deployer, collate_fn, apply_fn, loss_fn, params, optax.adamw(1e-3),
                      compute_dtype=jnp.bfloat16)
    hlo = trainer.lower_train_step(lm_examples(8), 1).as_text()
    found = re.findall(r"stablehlo.dot_general .*: \(tensor<[0-9x]*x(\w+)>, tensor<[0-9x]*x(\w+)>\)", hlo)
    assert len(found) > 20 and ("f32", "f32") not in found  # (attention's softmax
    assert found.count(("bf16", "bf16")) > 40                # is fp32 by design)


class Crash(Exception):
    pass


class CrashAt:
    def __init__(self, step):
        self.step = step

    @redco.hookimpl
    def on_step_end(self, trainer, step, metrics):
        if step == self.step:
            raise Crash(step)


def test_resume_continues_exactly_where_it_stopped(workdir):
    examples = mlp_examples(64)  # 8 updates per epoch
    full = make_trainer(workdir + "full")
    full.fit(examples, 2, n_epochs=3)

    with pytest.raises(Crash):  # dies mid-epoch 2, after the checkpoint of step 10
        make_trainer(workdir, callbacks=[CrashAt(11)]).fit(
            examples, 2, n_epochs=3, save_every_n_steps=5)
    assert os.listdir(os.path.join(workdir, "ckpts")) == ["step_10"]

    resumed = make_trainer(workdir)  # the same command, run again
    resumed.fit(examples, 2, n_epochs=3, save_every_n_steps=5)
    assert resumed.step == full.step == 24
    for a, b in zip(jax.tree.leaves(jax.device_get(resumed.params)),
                    jax.tree.leaves(jax.device_get(full.params))):
        np.testing.assert_array_equal(a, b)


def test_best_checkpoints_and_logs(workdir):
    trainer = make_trainer(workdir)
    neg_loss = lambda examples, preds: {"neg_mse": -float(np.mean(
        [(p - e["y"][0]) ** 2 for p, e in zip(preds, examples)]))}
    predictor = trainer.get_default_predictor(
        pred_fn=lambda rng, params, batch: mlp_apply(params, batch["x"])[:, 0])
    trainer.fit(mlp_examples(64), 2, n_epochs=2, eval_examples=mlp_examples(20, seed=1),
                eval_predictor=predictor, eval_metric_fn=neg_loss, save_last_ckpt=True,
                save_argmin_ckpt_by_metrics=["loss"], save_argmax_ckpt_by_metrics=["neg_mse"])
    trainer.deployer.close()
    ckpts = sorted(os.listdir(os.path.join(workdir, "ckpts")))
    assert ckpts == ["best_loss", "best_neg_mse", "step_16"]
    with open(os.path.join(workdir, "ckpts", "best_loss", "meta.json")) as f:
        best = json.load(f)
    records = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    eval_losses = [r["eval/loss"] for r in records if "eval/loss" in r]
    assert len(eval_losses) == 2 and best["loss"] == min(eval_losses)
    np.testing.assert_allclose([-r["eval/neg_mse"] for r in records if "eval/neg_mse" in r],
                               eval_losses, rtol=1e-5)  # same quantity, two routes
    assert [r["step"] for r in records if "train/loss" in r] == list(range(1, 17))
    assert "eval: loss" in open(os.path.join(workdir, "log.txt")).read()


def test_the_papers_rules_call_ends_in_the_dataflow_plan_placed_once(workdir, monkeypatch):
    """Names mislead (``a_second`` runs after ``z_first``): the paper's call
    ``deployer.get_sharding_rules(params=params)`` splits them by name, but the Trainer decides
    the layout at the first batch from the loss's dataflow and places the state once; a
    predictor made before fit predicts with those final shardings."""
    from jax.sharding import PartitionSpec as P

    import redco.trainer
    key = iter(jax.random.split(jax.random.PRNGKey(0), 3))
    params = {name: jax.random.normal(next(key), shape) / 4 for name, shape in
              (("z_first", (8, 16)), ("a_second", (16, 16)), ("m_third", (16, 2)))}

    def apply(p, x):
        return jnp.tanh(jnp.tanh(x @ p["z_first"]) @ p["a_second"]) @ p["m_third"]

    def loss_fn(state, params, batch):
        return jnp.mean((state.apply_fn(params, batch["x"]) - batch["y"]) ** 2)

    def collate(examples):
        batch = mlp_collate(examples)
        return {"x": batch["x"], "y": np.repeat(batch["y"], 2, axis=1)}

    placed = []
    place_copy = redco.state_placement.place_copy
    monkeypatch.setattr(redco.state_placement, "place_copy",
                        lambda tree, shardings: placed.append(1) or place_copy(tree, shardings))
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=workdir, verbose=False)
    column, row = P(None, "mp"), P("mp", None)
    by_names = deployer.get_sharding_rules(params=params)
    assert dict(by_names)["^a_second$"] == column  # by names: alternating in natural order
    trainer = Trainer(deployer, collate, apply, loss_fn, params, optax.adam(1e-2),
                      params_sharding_rules=by_names)
    predictor = trainer.get_default_predictor(lambda params, batch: apply(params, batch["x"]))
    assert trainer.state is None and not placed  # nothing placed before the first batch
    trainer.fit(mlp_examples(64), per_device_batch_size=2, n_epochs=2)
    assert len(placed) == 1  # params once (the optimizer state is made on its shardings)
    dataflow = {"z_first": column, "a_second": row, "m_third": column}
    assert {k: s.spec for k, s in trainer.state_shardings.params.items()} == dataflow
    assert trainer.step == 16 and trainer.params["a_second"].sharding.spec == row
    seen = []
    monkeypatch.setattr(jax, "device_put", lambda x, s, _put=jax.device_put: seen.append(
        s) or _put(x, s))
    predictor.predict(mlp_examples(4), 1, params=jax.device_get(trainer.params))
    assert {k: s.spec for k, s in seen[0].items()} == dataflow  # the final layout, not names


def test_fit_hands_its_plan_every_argument_by_name_with_its_own_default():
    """``fit``'s arguments reach ``plan_fit`` as one ``FitOptions`` made by keyword: the two
    list the same names with the same defaults, so no option is dropped or swapped."""
    import dataclasses
    import inspect

    from redco.fit_plan import FitOptions
    params = {name: p.default for name, p in inspect.signature(Trainer.fit).parameters.items()
              if name not in ("self", "v04_options")}
    fields = {f.name: f.default for f in dataclasses.fields(FitOptions) if f.name != "v04_options"}
    assert set(fields) == set(params)
    for name, default in params.items():
        want = None if default is inspect.Parameter.empty else default
        got = None if fields[name] is dataclasses.MISSING else fields[name]
        assert got == want, name
