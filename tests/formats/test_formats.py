"""What every checkpoint format must do (``fmt``: orbax, safetensors, msgpack): come from its
own distribution through the ``redco`` entry-point group, restore bit-equal onto any mesh (or a
part of the tree onto one device), resume a run to the same bits, refuse a forged file without
running it, and be readable without redco by the README's snippet."""
import json
import os
import pickle
import re
import shutil
import subprocess
import sys

import jax
import msgpack
import numpy as np
import optax
import pytest
from ckpt_helpers import REPO, assert_bit_equal, copy_ckpt, forge, host, lm_trainer, placed
from helpers import lm_examples, lm_model, mlp_apply, mlp_collate, mlp_examples, mlp_init, mlp_loss

from redco import Deployer, Trainer, checkpointing, plugins

sys.path.insert(0, os.path.join(REPO, "tests"))
from readme_blocks import block  # noqa: E402

DISTRIBUTION = {"orbax": "redco", "safetensors": "redco-safetensors", "msgpack": "redco-msgpack"}
MAIN_FILE = {"orbax": "_METADATA", "safetensors": "model.safetensors", "msgpack": "state.msgpack"}


@pytest.fixture(scope="module")
def saved(fmt, tmp_path_factory):
    """A trained LM's step checkpoint in ``fmt``, written on dp4 x mp2: ``(path, {name: array})``."""
    trainer = lm_trainer(str(tmp_path_factory.mktemp(fmt)), 2, fmt)
    trainer.fit(lm_examples(32), 2, n_epochs=1)
    return trainer.save_step_ckpt(0), host(trainer.ckpt_tree())


def test_the_format_is_registered_by_its_distribution(fmt):
    found = plugins.lookup("checkpoint_formats", fmt)
    assert hasattr(found, "save") and hasattr(found, "load")
    assert plugins.plugin_sources[fmt].split()[0] == DISTRIBUTION[fmt]


def on_one_device(tree):
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), tree)


@pytest.mark.parametrize("layout", ["dp2xmp4", "mp8", "one device", "params only"])
def test_restores_onto_any_layout_bit_equal(saved, layout, tmp_path):
    path, want = saved
    if layout in ("one device", "params only"):
        params = lm_model()[1]
        target = {"params": params}
        if layout == "one device":
            target.update(opt_state=optax.adamw(1e-3).init(params), rng=jax.random.PRNGKey(1))
        else:
            want = {name: x for name, x in want.items() if name.startswith("params/")}
        tree, meta = checkpointing.load(path, on_one_device(target))
    else:
        trainer = placed(lm_trainer(str(tmp_path), 4 if layout == "dp2xmp4" else 8))
        tree, meta = trainer.deployer.load_ckpt(path, trainer.ckpt_tree())
        assert tree["params"]["lm_head"]["kernel"].sharding.spec == trainer.state_shardings.params[
            "lm_head"]["kernel"].spec
    assert meta["step"] == 4
    assert_bit_equal(host(tree), want)


def test_a_run_resumes_to_the_same_bits(fmt, tmp_path):
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
    assert_bit_equal(host(resumed.params), host(full.params))


class Payload:
    """Unpickling this would create the file ``marker``."""
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickle_payload_is_refused_not_executed(saved, fmt, tmp_path):
    path, _ = saved
    marker = str(tmp_path / "executed")
    payload = pickle.dumps(Payload(marker))
    target = {"params": jax.tree.map(np.asarray, lm_model()[1])}
    forged = copy_ckpt(path, tmp_path)
    assert os.path.isfile(os.path.join(forged, "state", MAIN_FILE[fmt]))
    forge(forged, MAIN_FILE[fmt], payload)
    with pytest.raises(ValueError, match=f"Could not read .* as a {fmt} checkpoint"):
        checkpointing.load(forged, target)
    if fmt == "msgpack":  # a pickled object inside Flax's own array extension: dtype object
        ext = msgpack.ExtType(1, msgpack.packb(((32, 32), "O", payload)))
        forge(forged, MAIN_FILE[fmt], msgpack.packb({"params": {"lm_head": {"kernel": ext}}}))
        with pytest.raises(ValueError, match="Could not read"):
            checkpointing.load(forged, {"params": {"lm_head": {"kernel": np.zeros((32, 32))}}})
    assert not os.path.exists(marker)


def test_no_pickle_or_eval_in_the_format(fmt):
    module = sys.modules[type(plugins.lookup("checkpoint_formats", fmt)).__module__]
    unsafe = re.compile(r"import pickle|pickle\.|\beval\(|\bexec\(|allow_pickle=True")
    assert not unsafe.search(open(module.__file__).read()), module.__file__


def test_the_readme_snippet_reads_a_checkpoint_without_redco(saved, fmt, tmp_path):
    """The block of docs/guides/checkpoints.md, as written, run where ``workdir/ckpts/step_100``
    is this checkpoint."""
    path, want = saved
    shutil.copytree(path, tmp_path / "workdir" / "ckpts" / "step_100")
    leaf = ('params["model.layers.1.mlp.down_proj.weight"].T' if fmt == "safetensors"
            else 'params["model"]["layers"]["1"]["mlp"]["down_proj"]["kernel"]')
    script = ("import sys\nsys.modules['redco'] = None  # importing redco fails\n"
              f"sys.modules['redco_{fmt}'] = None\n" +
              block("read-checkpoint", "docs/guides/checkpoints.md") +
              f"\nnp.save({str(tmp_path / 'leaf.npy')!r}, {leaf})\n")
    subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp_path,
                   env={**os.environ, "XLA_FLAGS": "", "JAX_PLATFORMS": "cpu"})
    np.testing.assert_array_equal(np.load(tmp_path / "leaf.npy"),
                                  want["params/model/layers/1/mlp/down_proj/kernel"])
    assert json.load(open(os.path.join(path, "meta.json")))["format"] == fmt
