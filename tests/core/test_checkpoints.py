"""Checkpoint formats: any layout restores bit-equal, bad checkpoints fail clearly, a checkpoint
reads without redco, third-party formats plug in through entry points."""
import json
import os
import pickle
import re
import subprocess
import sys

import jax
import msgpack
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import (
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

from redco import Deployer, Trainer, checkpointing, plugins
from redco.sharding import named_leaves
from redco_zoo_models import LlamaConfig, LlamaForCausalLM, split_model

FORMATS = ["orbax", "safetensors", "msgpack"]
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def lm_trainer(workdir, n_model_shards=2, fmt="orbax", model=None):
    deployer = Deployer(jax_seed=0, n_model_shards=n_model_shards, workdir=workdir,
                        verbose=False, checkpoint_format=fmt)
    apply_fn, params = model or lm_model()
    return Trainer(deployer, lm_collate, apply_fn, lm_loss, params, optax.adamw(1e-3))


def host(tree) -> dict:
    return {path: np.asarray(x) for path, x in named_leaves(jax.device_get(tree))}


@pytest.fixture(scope="module", params=FORMATS)
def saved(request, tmp_path_factory):
    """A trained LM's step checkpoint, written on dp4 x mp2: ``(path, {name: array})``."""
    trainer = lm_trainer(str(tmp_path_factory.mktemp(request.param)), 2, request.param)
    trainer.fit(lm_examples(32), 2, n_epochs=1)
    return trainer.save_step_ckpt(0), host(trainer._ckpt_tree())


def biggest_file(ckpt: str) -> str:
    files = [os.path.join(d, f) for d, _, names in os.walk(os.path.join(ckpt, "state"))
             for f in names]
    return max(files, key=os.path.getsize)


@pytest.mark.parametrize("layout", ["dp2xmp4", "mp8", "one device"])
def test_restores_onto_any_layout_bit_equal(saved, layout, tmp_path):
    path, want = saved
    if layout == "one device":
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = {"params": lm_model()[1], "opt_state": optax.adamw(1e-3).init(lm_model()[1]),
                  "rng": jax.random.PRNGKey(1)}
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                              target)
        tree, meta = checkpointing.load(path, target)
    else:
        trainer = lm_trainer(str(tmp_path), 4 if layout == "dp2xmp4" else 8)
        tree, meta = trainer.deployer.load_ckpt(path, trainer._ckpt_tree())
        assert tree["params"]["lm_head"]["kernel"].sharding.spec == trainer.state_shardings.params[
            "lm_head"]["kernel"].spec
    got = host(tree)
    assert sorted(got) == sorted(want) and meta["step"] == 4
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        assert got[name].dtype == want[name].dtype


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_run_resumes_from_each_format_to_the_same_bits(fmt, tmp_path):
    def mlp_trainer(workdir):
        deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=str(workdir), verbose=False,
                            checkpoint_format=fmt)
        return Trainer(deployer, mlp_collate, mlp_apply, mlp_loss, mlp_init(), optax.adam(1e-2))

    full = mlp_trainer(tmp_path / "full")
    full.fit(mlp_examples(48), 2, n_epochs=2)  # 6 updates per epoch
    mlp_trainer(tmp_path / "run").fit(mlp_examples(48), 2, n_epochs=1, save_every_n_steps=4)
    assert os.listdir(tmp_path / "run" / "ckpts") == ["step_6"]
    resumed = mlp_trainer(tmp_path / "run")
    resumed.fit(mlp_examples(48), 2, n_epochs=2, save_every_n_steps=4)
    assert resumed.step == full.step == 12
    want, got = host(full.params), host(resumed.params)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


@pytest.mark.parametrize("saved", ["safetensors"], indirect=True)
def test_safetensors_names_params_as_pytorch_does(saved):
    path, want = saved
    from safetensors.numpy import load_file
    torch_params = load_file(os.path.join(path, "state", "model.safetensors"))
    assert len(torch_params) == sum(name.startswith("params/") for name in want)
    np.testing.assert_array_equal(torch_params["model.layers.1.self_attn.k_proj.weight"],
                                  want["params/model/layers/1/self_attn/k_proj/kernel"].T)
    np.testing.assert_array_equal(torch_params["model.embed_tokens.weight"],
                                  want["params/model/embed_tokens/embedding"])
    assert torch_params["model.norm.weight"].shape == (32,)


# ---- clear errors ----------------------------------------------------------------------------
def test_a_checkpoint_of_another_model_names_the_first_mismatch(saved, tmp_path):
    path, want = saved
    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    trainer = lm_trainer(str(tmp_path), model=split_model(LlamaForCausalLM(cfg, nnx.Rngs(0))))
    name, shape = next((n, np.shape(x)) for n, x in named_leaves(trainer._ckpt_tree())
                       if np.shape(x) != want[n].shape)
    assert "mlp" in name
    message = f"{name} has shape {want[name].shape} in the checkpoint but {shape} here"
    with pytest.raises(ValueError, match=re.escape(message)):
        trainer.deployer.load_ckpt(path, trainer._ckpt_tree())


def test_a_missing_or_unfinished_checkpoint_is_named(saved, tmp_path):
    path, _ = saved
    with pytest.raises(FileNotFoundError, match=r"No checkpoint directory .*step_99\. .* holds "
                                                r"\['step_4'\]"):
        checkpointing.load(os.path.join(os.path.dirname(path), "step_99"), {})
    unfinished = tmp_path / "step_3"
    os.makedirs(unfinished / "state")
    with pytest.raises(FileNotFoundError, match="not a complete redco checkpoint"):
        checkpointing.load(str(unfinished), {})


def copy_ckpt(path, tmp_path) -> str:
    import shutil
    copy = str(tmp_path / os.path.basename(path))
    shutil.copytree(path, copy)
    return copy


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


class Payload:
    """Unpickling this would create the file ``marker``."""
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def forge(ckpt: str, name: str, data: bytes) -> None:
    """Replace ``state/name`` with ``data``, updating meta.json's sizes and hashes as an attacker
    who controls the directory would."""
    with open(os.path.join(ckpt, "state", name), "wb") as f:
        f.write(data)
    meta_path = os.path.join(ckpt, "meta.json")
    with open(meta_path) as f:
        meta = json.load(f)
    meta["files"][name] = {"bytes": len(data),
                           "sha256": checkpointing._sha256(os.path.join(ckpt, "state", name))}
    with open(meta_path, "w") as f:
        json.dump(meta, f)


def test_a_pickle_payload_is_refused_not_executed(saved, tmp_path):
    path, _ = saved
    fmt = json.load(open(os.path.join(path, "meta.json")))["format"]
    marker = str(tmp_path / "executed")
    payload = pickle.dumps(Payload(marker))
    target = {"params": jax.tree.map(np.asarray, lm_model()[1])}
    main_file = {"orbax": "_METADATA", "safetensors": "model.safetensors",
                 "msgpack": "state.msgpack"}[fmt]
    forged = copy_ckpt(path, tmp_path)
    forge(forged, main_file, payload)
    with pytest.raises(ValueError, match=f"Could not read .* as a {fmt} checkpoint"):
        checkpointing.load(forged, target)
    if fmt == "msgpack":  # a pickled object inside Flax's own array extension: dtype object
        ext = msgpack.ExtType(1, msgpack.packb(((32, 32), "O", payload)))
        forge(forged, main_file, msgpack.packb({"params": {"lm_head": {"kernel": ext}}}))
        with pytest.raises(ValueError, match="Could not read"):
            checkpointing.load(forged, {"params": {"lm_head": {"kernel": np.zeros((32, 32))}}})
    assert not os.path.exists(marker)


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


# ---- readable without redco; third-party formats -------------------------------------------
def readme_snippet() -> str:
    readme = open(os.path.join(REPO, "README.md")).read()
    return readme.split("<!-- checkpoint-snippet -->\n```python\n", 1)[1].split("```", 1)[0]


def test_the_readme_snippet_reads_a_checkpoint_without_redco(saved, tmp_path):
    path, want = saved
    code = readme_snippet().replace('"workdir/ckpts/step_100"', repr(path))
    fmt = json.load(open(os.path.join(path, "meta.json")))["format"]
    leaf = ('params["model.layers.1.mlp.down_proj.weight"].T' if fmt == "safetensors"
            else 'params["model"]["layers"]["1"]["mlp"]["down_proj"]["kernel"]')
    script = ("import sys\nsys.modules['redco'] = None  # importing redco fails\n" + code +
              f"\nnp.save({str(tmp_path / 'leaf.npy')!r}, {leaf})\n")
    subprocess.run([sys.executable, "-c", script], check=True,
                   env={**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"})
    np.testing.assert_array_equal(np.load(tmp_path / "leaf.npy"),
                                  want["params/model/layers/1/mlp/down_proj/kernel"])


PLUGIN = '''
import os
import numpy as np
import jax
import redco
from redco.builtins.checkpoints import host_arrays, place


class NpzFormat:
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
        other = lm_trainer(str(tmp_path / "other"), n_model_shards=4)
        tree, meta = other.deployer.load_ckpt(path, other._ckpt_tree())
        assert meta["format"] == "npz"
        want, got = host(trainer._ckpt_tree()), host(tree)
        for name in want:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    finally:
        plugins.pm.unregister(name="npz")


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
