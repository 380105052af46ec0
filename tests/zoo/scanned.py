"""What the scanned-layer tests share (``redco_zoo_models.layer_scan``): the same params stored
unrolled or stacked, and a few SGD updates on dp4 x mp2 compared between the two."""
import dataclasses
import functools

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P
from step_rows import StepRows

from redco import Deployer, Trainer, layer_stacks, lora
from redco.tree_paths import named_leaves
from redco_zoo_lm import collate_fn, loss_fn
from redco_zoo_models import LlamaConfig, LlamaForCausalLM, add_lora, split_model


@functools.cache
def params_of(cfg: LlamaConfig, scan: bool, lora_rank: int = 0):
    """``(apply_fn, params)``: numpy draws (an eager init compiles op by op) for the unrolled
    model, LoRA adapters on its projections when ``lora_rank`` (``B`` drawn too, not zeros: a
    mistake in it then shows); the scanned one's are the same, stacked by layer
    (``layer_stacks.stack``)."""
    def build():
        model = LlamaForCausalLM(dataclasses.replace(cfg, scan_layers=scan), nnx.Rngs(0))
        return add_lora(model, rank=lora_rank) if lora_rank else model
    apply_fn, shapes = split_model(nnx.eval_shape(build))
    if not scan:
        rng = np.random.default_rng(0)
        return apply_fn, jax.tree.map(lambda s: (0.2 * rng.normal(size=s.shape)).astype(s.dtype),
                                      shapes)
    named = dict(named_leaves(params_of(cfg, False, lora_rank)[1]))
    paths = [p for p, _ in named_leaves(shapes)]
    stacked = layer_stacks.stack(named, [p for p in paths if layer_stacks.layers_of(p)], np.stack)
    return apply_fn, jax.tree.unflatten(jax.tree.structure(shapes), [stacked[p] for p in paths])


def examples() -> list[dict]:
    """32 rows of 17 tokens: 4 updates of 8 rows on dp4 x mp2."""
    rng = np.random.default_rng(0)
    return [{"token_ids": (np.arange(17) * rng.integers(1, 4) + rng.integers(64)) % 64}
            for _ in range(32)]


def fit(cfg, scan: bool, rules: str = "auto", policy: str | None = None, lora_rank: int = 0):
    """4 SGD updates on dp4 x mp2 (of the adapters alone with ``lora_rank``): ``(loss and grad
    norm rows, final params per layer, specs per param path, the trainer)``."""
    deployer = Deployer(jax_seed=0, n_model_shards=2, verbose=False, compile_cache_dir=False,
                        sharding_rules=rules)
    apply_fn, params = params_of(cfg, scan, lora_rank)
    rows = StepRows()
    t = Trainer(deployer, collate_fn, apply_fn, loss_fn, params, optax.sgd(0.1), remat=policy,
                callbacks=[rows], trainable=lora.trainable_mask(params) if lora_rank else None)
    t.fit(examples(), per_device_batch_size=2, n_epochs=1, eval_sanity_check=False)
    final = layer_stacks.unstack({p: np.asarray(x) for p, x in named_leaves(t.params)})
    specs = {p: s.spec for p, s in named_leaves(t.state_shardings.params)}
    return np.array(rows.rows), final, specs, t


def padded(spec: P, ndim: int) -> tuple:
    return tuple(spec) + (None,) * (ndim - len(spec))


def check_equal_training(cfg, rules="auto", policy=None, lora_rank=0):
    """The scanned model's 4 updates equal the unrolled one's (losses, gradient norms, every
    layer's final params); each stacked param's spec is its layers' unrolled spec behind an
    unsplit layer axis. Returns ``(scanned specs, final params per layer, scanned trainer)``."""
    rows, final, specs, trainer = fit(cfg, True, rules, policy, lora_rank)
    want_rows, want_final, want_specs, _ = fit(cfg, False, rules, policy, lora_rank)
    assert len(rows) == 4 and rows[-1, 0] < rows[0, 0]
    np.testing.assert_allclose(rows, want_rows, rtol=1e-5, atol=1e-6)
    assert final.keys() == want_final.keys()
    for path in final:
        np.testing.assert_allclose(final[path], want_final[path], rtol=1e-5, atol=1e-6,
                                   err_msg=path)
    stacked = [p for p in specs if layer_stacks.layers_of(p)]
    assert stacked, "nothing stacked"
    for path in stacked:
        for layer in layer_stacks.layer_names(path):
            ndim = np.ndim(want_final[layer])
            assert padded(specs[path], ndim + 1) == (None, *padded(want_specs[layer], ndim)), path
    return specs, final, trainer


def first_layer_with(layers, part: str):
    """The first layer of a model's ``layers`` state (keyed by layer number, or ``a:b`` for a
    stack of layers) that holds ``part`` (``"mlp/experts"``): ``(its subtree, lead)``, ``lead``
    the spec entries before one layer's (``(None,)``: a stack's layer axis, else ``()``)."""
    for key in sorted(layers.keys(), key=lambda k: int(str(k).split(":")[0])):
        node = layers[key]
        try:
            for name in part.split("/"):
                node = node[name]
        except KeyError:
            continue
        return node, (None,) if ":" in str(key) else ()
    raise KeyError(f"no layer holds {part}")
