"""What ``redco zoo run lm --weight_decay D --max_grad_norm C --expert_parallel ...`` gives the
``Trainer`` it builds, seen from a process-wide plugin (as any user's plugin sees a run): the
optimizer that trainer holds makes two AdamW updates as the formula written out here does,
after clipping to C (the first gradient clipped, the second not), and the MoE experts are split
over ``dp`` as expert parallelism lays them out."""
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from scanned import first_layer_with

import redco
from redco import plugins
from redco.cli import main
from redco_zoo_models.toy import save_model_dir, tiny_family, word_tokenizer

WORDS = "zero one two three four five six seven eight nine".split()
LR, DECAY, CLIP = 0.01, 0.3, 0.5
B1, B2, EPS = 0.9, 0.999, 1e-8  # AdamW's defaults


class TrainerOfTheRun:
    """A process-wide plugin keeping the trainer a run fits."""
    trainer = None

    @redco.hookimpl
    def on_fit_start(self, trainer, n_epochs, steps_per_epoch):
        self.trainer = trainer


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The trainer of a 3-update ``redco zoo run lm`` of a tiny Qwen3-MoE (4 experts) on 4 x 2
    devices, linear decay from LR (no warmup)."""
    root = tmp_path_factory.mktemp("levers")
    save_model_dir(tiny_family("qwen3-moe"), word_tokenizer(WORDS, ("<pad>", "</s>", "<unk>")),
                   str(root / "model"))
    starts = np.random.default_rng(0).integers(0, 10, 40)
    (root / "train.txt").write_text("".join(
        " ".join(WORDS[(s + i) % 10] for i in range(20)) + "\n" for s in starts))
    seen = TrainerOfTheRun()
    plugins.pm.register(seen, name="trainer-of-the-run")
    try:
        main(["zoo", "run", "lm", "--model", str(root / "model"), "--train",
              str(root / "train.txt"), "--workdir", str(root / "run"), "--block_size", "16",
              "--per_device_batch_size", "1", "--max_steps", "3", "--eval_steps", "1",
              "--learning_rate", str(LR), "--warmup_rate", "0", "--schedule", "linear",
              "--weight_decay", str(DECAY), "--max_grad_norm", str(CLIP),
              "--n_model_shards", "2", "--expert_parallel"])
    finally:
        plugins.pm.unregister(name="trainer-of-the-run")
    assert seen.trainer is not None and seen.trainer.step == 3
    return seen.trainer


def adamw_two_updates(p: np.ndarray, grads: list[np.ndarray], scales: list[float]):
    """Two AdamW updates of one leaf ``p``, written out: gradient ``g * scale`` (the clipping),
    learning rates LR and LR / 2 (linear decay over the 2 updates after the first to 0), weight
    decay DECAY on the params before each update."""
    m = v = np.zeros_like(p, np.float64)
    p, updates = p.astype(np.float64), []
    for t, (g, scale, lr) in enumerate(zip(grads, scales, (LR, LR / 2)), start=1):
        g = g.astype(np.float64) * scale
        m, v = B1 * m + (1 - B1) * g, B2 * v + (1 - B2) * g * g
        m_hat, v_hat = m / (1 - B1 ** t), v / (1 - B2 ** t)
        updates.append(-lr * (m_hat / (np.sqrt(v_hat) + EPS) + DECAY * p))
        p = p + updates[-1]
    return updates


def test_the_runs_optimizer_is_adamw_with_the_decay_after_clipping(run):
    import optax
    params = jax.device_get(run.params)
    leaves = jax.tree.leaves(params)
    big = [np.sin(np.arange(x.size, dtype=np.float32) + 1).reshape(x.shape) * 3 for x in leaves]
    small = [np.cos(np.arange(x.size, dtype=np.float32)).reshape(x.shape) * 1e-3 for x in leaves]
    norms = [np.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in gs)) for gs in (big, small)]
    assert norms[0] > CLIP > norms[1]  # the first is clipped, the second is not
    treedef = jax.tree.structure(params)
    g1, g2 = (jax.tree.unflatten(treedef, gs) for gs in (big, small))
    update = jax.jit(run.optimizer.update)  # (one compile, not one per op and leaf)
    state = jax.jit(run.optimizer.init)(params)
    u1, state = update(g1, state, params)
    u2, _ = update(g2, state, optax.apply_updates(params, u1))
    for p, a, b, got1, got2 in zip(leaves, big, small, jax.tree.leaves(u1), jax.tree.leaves(u2)):
        want1, want2 = adamw_two_updates(np.asarray(p), [a, b], [CLIP / norms[0], 1.0])
        np.testing.assert_allclose(np.asarray(got1), want1, rtol=1e-4, atol=LR * 1e-5)
        np.testing.assert_allclose(np.asarray(got2), want2, rtol=1e-4, atol=LR * 1e-5)


def test_expert_parallel_splits_the_experts_over_dp(run):
    assert dict(run.deployer.mesh.shape) == {"dp": 4, "mp": 2}
    experts, lead = first_layer_with(run.params["model"]["layers"], "mlp/experts")
    assert experts["gate_proj"].sharding.spec == P(*lead, "dp", None, "mp")  # 4 experts: 1 a
    assert experts["up_proj"].sharding.spec == P(*lead, "dp", None, "mp")  # dp rank
    assert experts["down_proj"].sharding.spec == P(*lead, "dp", "mp", None)
