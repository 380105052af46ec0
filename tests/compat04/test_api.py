"""Each Redco 0.4.x name, called the 0.4.x way, does what 0.4.x did (docs/tutorials/from-0.4.md).

A small regression model on 8 simulated devices; every test checks an outcome (values, files,
steps), not only that the call is accepted.
"""
import json
import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from redco import Deployer, Predictor, Trainer
from redco.sharding import specs_from_rules


def init_params():
    rng = np.random.default_rng(0)
    return {"dense": {"kernel": rng.normal(size=(4, 8)).astype(np.float32),
                      "bias": np.zeros(8, np.float32)},
            "out": {"kernel": rng.normal(size=(8, 1)).astype(np.float32)}}


def apply_fn(params, x):
    return (jnp.tanh(x @ params["dense"]["kernel"] + params["dense"]["bias"])
            @ params["out"]["kernel"])[:, 0]


def loss_fn(rng, state, params, batch, is_training):
    return jnp.mean((state.apply_fn(params, batch["x"]) - batch["y"]) ** 2)


def pred_fn(rng, params, batch):
    return apply_fn(params, batch["x"])


def collate_fn(examples):
    return {"x": np.stack([e["x"] for e in examples]), "y": np.array([e["y"] for e in examples])}


def make_examples(n, seed=1):
    rng = np.random.default_rng(seed)
    return [{"x": x.astype(np.float32), "y": np.float32(x.sum())} for x in rng.normal(size=(n, 4))]


def make_trainer(deployer, **kwargs):
    kwargs.setdefault("params", init_params())
    kwargs.setdefault("optimizer", optax.adam(1e-2))
    return Trainer(deployer=deployer, collate_fn=collate_fn, apply_fn=apply_fn,
                   loss_fn=loss_fn, **kwargs)


def deployer(workdir="./workdir", **kwargs):
    return Deployer(jax_seed=0, n_model_shards=2, workdir=workdir, verbose=False, **kwargs)


def test_log_info_with_title_frames_the_message_in_log_txt():
    d = deployer()
    d.log_info(info="12,345", title="Parameters")
    d.log_info("plain line")
    log = open("workdir/log.txt").read()
    assert "### Parameters\n" in log and "\n12,345\n" in log and "plain line" in log


def test_batch_sizes_and_accumulation():
    d = deployer()  # dp 4 x mp 2
    assert d.get_local_global_micro_batch_size(per_device_batch_size=3) == (12, 12)
    assert d.process_batch_size(per_device_batch_size=3) == (12, 12)
    assert d.get_accumulate_grad_batches(global_batch_size=48, per_device_batch_size=3) == 4
    with pytest.raises(ValueError, match="global_batch_size=50"):
        d.get_accumulate_grad_batches(global_batch_size=50, per_device_batch_size=3)


def test_warmup_ratio_is_warmup_rate_and_params_shape_or_params_is_params():
    d = deployer()
    kwargs = dict(train_size=640, per_device_batch_size=4, n_epochs=2, learning_rate=1e-3)
    old = d.get_lr_schedule_fn(warmup_ratio=0.25, **kwargs)
    new = d.get_lr_schedule_fn(warmup_rate=0.25, **kwargs)
    assert [float(old(s)) for s in range(20)] == [float(new(s)) for s in range(20)]
    # 2 epochs x 40 steps of 16 examples; warm-up over a quarter of them
    assert float(old(10)) == pytest.approx(5e-4) and float(old(20)) == pytest.approx(1e-3)
    params = init_params()
    assert d.get_sharding_rules(params_shape_or_params=params) == d.get_sharding_rules(params)


def test_workdir_none_trains_and_writes_nothing(tmp_path):
    d = deployer(workdir=None)
    trainer = make_trainer(d)
    trainer.fit(make_examples(64), per_device_batch_size=4, n_epochs=2)
    assert trainer.step == 8 and os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="workdir=None"):
        trainer.save_step_ckpt(epoch=1)
    assert d.load_last_ckpt() == (None, None)


def test_save_ckpt_and_load_ckpt_by_directory_with_float_dtype():
    d = deployer()
    trainer = make_trainer(d)
    trainer.fit(make_examples(64), per_device_batch_size=4, n_epochs=1)
    d.save_ckpt(ckpt_dir="./saved", params=trainer.get_params_to_save(),
                opt_state=trainer.state.opt_state, float_dtype=jnp.bfloat16, step=7, epoch_idx=0)
    after_save = d.gen_rng()

    shapes = d.load_params_shape("./saved")
    assert shapes["dense"]["kernel"].shape == (4, 8) and shapes["dense"]["kernel"].dtype == jnp.bfloat16
    other = deployer(workdir="./other")
    ckpt, info = other.load_ckpt(ckpt_dir="./saved", optimizer=optax.adam(1e-2),
                                 float_dtype=jnp.float32, update_rng=True)
    assert info["step"] == 7 and info["epoch_idx"] == 0
    want = jax.device_get(trainer.params)
    got = jax.device_get(ckpt["params"])
    assert got["dense"]["kernel"].dtype == np.float32
    np.testing.assert_array_equal(
        got["dense"]["kernel"], want["dense"]["kernel"].astype(jnp.bfloat16).astype(np.float32))
    assert ckpt["params"]["dense"]["kernel"].sharding.spec == \
        trainer.params["dense"]["kernel"].sharding.spec  # placed by the deployer's rules
    mu = jax.tree.leaves(ckpt["opt_state"])
    assert len(mu) == len(jax.tree.leaves(trainer.state.opt_state))
    np.testing.assert_array_equal(other.gen_rng(), after_save)  # update_rng took the saved rng
    params_only, _ = other.load_ckpt(ckpt_dir="./saved", load_opt_state=False)
    assert params_only["opt_state"] is None and params_only["params"] is not None


def test_load_last_ckpt_and_last_ckpt_info_continue_training():
    examples = make_examples(64)
    first = make_trainer(deployer())
    first.fit(examples, per_device_batch_size=4, n_epochs=1, save_last_ckpt=True)

    d = deployer()
    ckpt, info = d.load_last_ckpt(optimizer=optax.adam(1e-2), float_dtype=jnp.float32)
    assert info["step"] == 4
    trainer = make_trainer(d, params=ckpt["params"], opt_state=ckpt["opt_state"],
                           last_ckpt_info=info, params_sharded=True, opt_state_sharded=True)
    assert trainer.step == 4
    trainer.fit(examples, per_device_batch_size=4, n_epochs=2, resume=False)
    straight = make_trainer(deployer(workdir="./straight"))
    straight.fit(examples, per_device_batch_size=4, n_epochs=2)
    assert trainer.step == straight.step == 8
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(trainer.params),
                 jax.device_get(straight.params))


def test_callable_train_examples_resume_on_the_right_epoch():
    chunks = {i: make_examples(32, seed=10 + i) for i in range(3)}
    asked = []

    def train_examples(epoch_idx):
        asked.append(epoch_idx)
        return chunks[epoch_idx]

    make_trainer(deployer()).fit(train_examples, per_device_batch_size=4, n_epochs=2,
                                 save_last_ckpt=True)
    asked.clear()
    resumed = make_trainer(deployer())
    resumed.fit(train_examples, per_device_batch_size=4, n_epochs=3, save_last_ckpt=True)
    assert resumed.step == 6 and asked[-1] == 2  # epochs 0 and 1 came from the checkpoint
    straight = make_trainer(deployer(workdir="./straight"))
    straight.fit(train_examples, per_device_batch_size=4, n_epochs=3)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.params),
                 jax.device_get(straight.params))


def test_eval_metric_fn_gets_examples_and_preds_by_name():
    seen = {}

    def metric(preds, examples):  # declared in the other order, as 0.4.x's MAML example does
        seen["types"] = (type(preds[0]).__name__, type(examples[0]).__name__)
        return {"mse": float(np.mean([(p - e["y"]) ** 2 for p, e in zip(preds, examples)]))}

    d = deployer()
    trainer = make_trainer(d)
    predictor = Predictor(deployer=d, collate_fn=collate_fn, pred_fn=pred_fn)
    trainer.fit(make_examples(64), per_device_batch_size=4, n_epochs=1,
                eval_examples=make_examples(16, seed=2), eval_predictor=predictor,
                eval_metric_fn=metric)
    assert seen["types"][0] != "dict" and seen["types"][1] == "dict"  # preds, then examples


def test_eval_sanity_check_fails_before_training():
    def broken_metric(examples, preds):
        return {"acc": examples[0]["missing"]}

    d = deployer()
    trainer = make_trainer(d)
    predictor = Predictor(deployer=d, collate_fn=collate_fn, pred_fn=pred_fn)
    with pytest.raises(KeyError, match="missing"):
        trainer.fit(make_examples(64), per_device_batch_size=4, n_epochs=1,
                    eval_examples=make_examples(16), eval_predictor=predictor,
                    eval_metric_fn=broken_metric, eval_sanity_check=True)
    assert trainer.step == 0


def test_epoch_checkpoints_with_float_dtype_and_without_opt_state():
    trainer = make_trainer(deployer())
    trainer.fit(make_examples(64), per_device_batch_size=4, n_epochs=2,
                save_ckpt_every_k_epochs=1, save_opt_states=False, save_float_dtype=jnp.bfloat16)
    for epoch in (0, 1):
        meta = json.load(open(f"workdir/ckpts/epoch_{epoch}/meta.json"))
        assert meta["epoch_idx"] == epoch and meta["step"] == 4 * (epoch + 1)
        assert {dtype for _, dtype in meta["arrays"].values()} == {"bfloat16"}
        assert all(name.startswith("params/") for name in meta["arrays"])


def test_train_one_pass_then_predict_with_old_flags():
    d = deployer()
    trainer = make_trainer(d)
    examples = make_examples(64)
    before = trainer.eval_loss(examples, per_device_batch_size=4)
    for _ in range(3):
        trainer.train(examples, per_device_batch_size=4, desc="pass")
    # 3 passes of 4 updates; measured about 0.6x the starting loss
    assert trainer.step == 12 and trainer.eval_loss(examples, per_device_batch_size=4) < 0.75 * before
    predictor = Predictor(deployer=d, collate_fn=collate_fn, pred_fn=pred_fn)
    preds = predictor.predict(examples[:5], per_device_batch_size=4, params=trainer.params,
                              params_replicated=False, params_sharded=True)
    want = apply_fn(jax.device_get(trainer.params), np.stack([e["x"] for e in examples[:5]]))
    np.testing.assert_allclose(np.array(preds), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="params_shardedd"):
        predictor.predict(examples, 4, params=trainer.params, params_shardedd=True)


def test_log_metrics_in_the_old_argument_order():
    d = deployer()
    d.log_metrics({"reward": 1.5}, step=3)
    d.close()
    rows = [json.loads(line) for line in open("workdir/metrics.jsonl")]
    assert {"step": 3, "reward": 1.5}.items() <= rows[-1].items()


def test_rules_as_name_tuples_and_as_a_tree_of_rule_lists():
    mesh = deployer().mesh
    params = {"model": {"attn": {"q_proj": {"kernel": np.zeros((4, 8))}},
                        "xq_proj": {"kernel": np.zeros((4, 8))}},
              "lora": {"a": np.zeros((4, 8))}}
    rules = [(("q_proj", "kernel"), P(None, "mp"))]
    specs = specs_from_rules(params, {"model": rules, "lora": None}, mesh)
    assert specs["model"]["attn"]["q_proj"]["kernel"] == P(None, "mp")
    assert specs["model"]["xq_proj"]["kernel"] == P()  # a name matches whole, as in 0.4.x
    assert specs["lora"]["a"] == P()


def dp_mean_step(rng, state, batch, loss_fn, lr_schedule_fn, mesh, compute_dtype):
    """0.4.x's default step, as a user's ``train_step_fn`` re-expresses it: one gradient per
    data-parallel group (vmap over the leading dp axis), averaged."""
    def loss_and_grads(rng_, batch_):
        return jax.value_and_grad(lambda p: loss_fn(rng=rng_, state=state, params=p,
                                                    batch=batch_, is_training=True))(state.params)
    loss, grads = jax.vmap(loss_and_grads)(jax.random.split(rng, mesh.shape["dp"]), batch)
    grads = jax.tree.map(lambda g: g.mean(axis=0), grads)
    return state.apply_gradients(grads=grads), {"loss": loss.mean(), "step": state.step}


def test_train_step_fn_runs_in_the_sharded_loop_and_matches_the_built_in_step():
    examples = make_examples(64)
    custom = make_trainer(deployer(), train_step_fn=dp_mean_step)
    custom.fit(examples, per_device_batch_size=4, n_epochs=2, save_last_ckpt=True)
    built_in = make_trainer(deployer(workdir="./built_in"))
    built_in.fit(examples, per_device_batch_size=4, n_epochs=2)
    assert custom.step == built_in.step == 8
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5),
                 jax.device_get(custom.params), jax.device_get(built_in.params))
    assert custom.params["dense"]["kernel"].sharding.spec != P()  # sharded, not replicated


SEEN_ROWS: list[int] = []


def pmap_mean_step(rng, state, batch, loss_fn, lr_schedule_fn, mesh, compute_dtype):
    """0.4.x's default step as 0.4.23 ran it with ``n_model_shards=1``: under ``jax.pmap``, no
    mesh, this device's rows; the gradient averaged over ``'dp'`` by the step itself."""
    assert mesh is None
    SEEN_ROWS.append(jax.tree.leaves(batch)[0].shape[0])
    loss, grads = jax.value_and_grad(lambda p: loss_fn(rng=rng, state=state, params=p, batch=batch,
                                                       is_training=True))(state.params)
    grads = jax.lax.pmean(grads, "dp")
    return state.apply_gradients(grads=grads), {"loss": jax.lax.pmean(loss, "dp"), "step": state.step}


def test_with_one_model_shard_train_step_fn_runs_per_device_as_under_pmap():
    SEEN_ROWS.clear()
    examples = make_examples(64)
    one_shard = partial(Deployer, jax_seed=0, n_model_shards=1, verbose=False)
    custom = make_trainer(one_shard(workdir="./custom"), train_step_fn=pmap_mean_step)
    custom.fit(examples, per_device_batch_size=4, n_epochs=2)
    built_in = make_trainer(one_shard(workdir="./built_in"))
    built_in.fit(examples, per_device_batch_size=4, n_epochs=2)
    assert SEEN_ROWS and set(SEEN_ROWS) == {4}  # a device's rows, not the global batch's 32
    assert custom.step == built_in.step == 4
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-5),
                 jax.device_get(custom.params), jax.device_get(built_in.params))


def test_set_train_state_with_the_old_keywords():
    optimizer = optax.adam(1e-2)
    trainer = make_trainer(deployer(), optimizer=optimizer)
    trainer.fit(make_examples(64), per_device_batch_size=4, n_epochs=1)
    fresh = init_params()
    trainer.set_train_state(apply_fn=apply_fn, optimizer=optimizer, params=fresh, step=0,
                            params_sharded=False)
    assert trainer.step == 0
    np.testing.assert_array_equal(jax.device_get(trainer.params)["dense"]["kernel"],
                                  fresh["dense"]["kernel"])
    # a new optimizer (FedAvg's clients bring theirs): its state starts fresh and it is used
    trainer.set_train_state(apply_fn=apply_fn, params=fresh, optimizer=optax.sgd(0.0), step=0)
    trainer.fit(make_examples(64), per_device_batch_size=4, n_epochs=1)
    assert trainer.step == 4
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(trainer.params), fresh)


def test_a_second_fit_on_the_same_trainer_trains_its_epochs_again():
    """0.4.x's PPO calls fit once per episode on the same trainer: each call trains."""
    trainer = make_trainer(deployer())
    examples = make_examples(64)
    trainer.fit(examples, per_device_batch_size=4, n_epochs=2, save_last_ckpt=True)
    loss = trainer.eval_loss(examples, per_device_batch_size=4)
    trainer.fit(examples, per_device_batch_size=4, n_epochs=2, save_last_ckpt=True)
    assert trainer.step == 16 and trainer.eval_loss(examples, per_device_batch_size=4) < loss
    assert os.path.isdir("workdir/ckpts/step_16")
