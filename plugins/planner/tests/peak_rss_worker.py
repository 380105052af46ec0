"""Run by ``test_planner_accuracy.py`` in a fresh process (its memory is the measurement): plan a
LLaMA train step on simulated CPU devices for the tightest budget that forces model parallelism,
train the chosen layout, and print one JSON line with the planned per-device peak and the real
peak of the process's memory while the steps ran.

argv[1] is a JSON object: ``n_devices``, ``config`` (``LlamaConfig`` fields), ``seq_len``,
``batch`` (per device) and ``steps`` (measured steps after the first).
"""
import ctypes
import gc
import json
import math
import os
import sys
import tempfile

ARGS = json.loads(sys.argv[1])
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={ARGS['n_devices']}")
os.environ["HF_HUB_OFFLINE"] = "1"
LIBC = ctypes.CDLL("libc.so.6")
# glibc keeps freed blocks of up to 32 MiB in its arenas (the mmap threshold grows to the largest
# block freed), so RSS would hold every step's temporaries and their fragments. A fixed 64 KiB
# threshold (M_MMAP_THRESHOLD = -3) gives each buffer above it its own mapping, unmapped when
# freed: the RSS peak is then the live bytes' peak, as a GPU allocator's peak_bytes_in_use is.
LIBC.mallopt(-3, 64 * 1024)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from redco import Deployer, Trainer  # noqa: E402
from redco_planner.layouts import HEADROOM, usable_bytes  # noqa: E402
from redco_planner.models import lm_loss  # noqa: E402
from redco_planner.planner import plan  # noqa: E402
from redco_zoo_lm import collate_fn, loss_fn  # noqa: E402
from redco_zoo_models import LlamaConfig, LlamaForCausalLM, split_model  # noqa: E402

# plan() is called three times on the same layouts; the cache makes the repeats free.
jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp())
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
RULE_SETS = ("auto",)  # one rule set: two compiles (mp=1, mp=2), not three or four with auto+fsdp


def proc_status(key: str) -> int:
    """``VmRSS`` (resident now) or ``VmHWM`` (its peak since the last reset), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def reset_peak_rss() -> None:
    """Linux resets VmHWM to the current RSS when "5" is written to clear_refs."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    if proc_status("VmHWM") - proc_status("VmRSS") > 2 ** 20:
        raise RuntimeError("VmHWM did not reset: the peak cannot be measured here.")


def tightest_plan(params, loss, batch, n_devices, optimizer):
    """The plan for the smallest budget that still gets a model-parallel pick, all three budgets
    read off the planner's own peaks: a roomy one gives mp=1's peak, one byte under it gives the
    layout picked when mp=1 does not fit, and the budget whose usable bytes are exactly that
    layout's peak must pick it again."""
    def run(budget):
        return plan(params, loss, batch, n_devices=n_devices, device_memory_bytes=budget,
                    optimizer=optimizer, rule_sets=RULE_SETS)
    mp1_peak = run(2 ** 50).tried[0].peak_bytes
    pick = run(mp1_peak - 1)
    budget = math.ceil(pick.peak_bytes / (1 - HEADROOM))
    while usable_bytes(budget) < pick.peak_bytes:
        budget += 1
    while usable_bytes(budget - 1) >= pick.peak_bytes:
        budget -= 1
    tight = run(budget)
    assert (tight.n_model_shards, tight.peak_bytes) == (pick.n_model_shards, pick.peak_bytes)
    return tight, mp1_peak


def state_bytes(trainer) -> int:
    """Params and optimizer state as held: every device's shard, replicas included."""
    leaves = jax.tree.leaves((trainer.state.params, trainer.state.opt_state))
    return sum(shard.data.nbytes for x in leaves for shard in x.addressable_shards)


def train_and_measure(result, config, optimizer) -> int:
    """Train the planned layout; the bytes the steps add to the process's memory, with the
    train state (which the plan counts too) put back in. The first step (compile included) runs
    before the measurement: the compiler's memory is the host's, not the device's."""
    apply_fn, params = split_model(LlamaForCausalLM(config, rngs=nnx.Rngs(0)))
    deployer = Deployer(jax_seed=0, n_model_shards=result.n_model_shards,
                        sharding_rules=result.sharding_rules, workdir=tempfile.mkdtemp(),
                        verbose=False, loggers=())
    trainer = Trainer(deployer, collate_fn, apply_fn, loss_fn, params, optimizer,
                      params_sharding_rules=result.rules)
    del params
    rows = ARGS["batch"] * deployer.dp_size
    rng = np.random.default_rng(0)
    examples = [{"token_ids": rng.integers(0, config.vocab_size, ARGS["seq_len"] + 1)}
                for _ in range(rows * (1 + ARGS["steps"]))]
    trainer.fit(examples[:rows], per_device_batch_size=ARGS["batch"], n_epochs=1)
    jax.block_until_ready(trainer.state.params)
    gc.collect()
    LIBC.malloc_trim(0)
    baseline = proc_status("VmRSS") - state_bytes(trainer)
    reset_peak_rss()
    trainer.fit(examples[rows:], per_device_batch_size=ARGS["batch"], n_epochs=1)  # trains anew
    jax.block_until_ready(trainer.state.params)
    assert trainer.step == 1 + ARGS["steps"]  # the first step, then the measured ones
    return proc_status("VmHWM") - baseline


def main():
    config = LlamaConfig(max_position_embeddings=ARGS["seq_len"] + 1, **ARGS["config"])
    optimizer = optax.adamw(1e-4)
    apply_fn, params = split_model(nnx.eval_shape(lambda: LlamaForCausalLM(config, rngs=nnx.Rngs(0))))
    batch = {"input_ids": jax.ShapeDtypeStruct((ARGS["batch"], ARGS["seq_len"] + 1), jnp.int32)}
    result, mp1_peak = tightest_plan(params, lm_loss(apply_fn), batch, ARGS["n_devices"], optimizer)
    real_total = train_and_measure(result, config, optimizer)
    print(json.dumps({"n_devices": ARGS["n_devices"], "n_model_shards": result.n_model_shards,
                      "budget": result.device_memory_bytes, "planned": result.peak_bytes,
                      "mp1_planned": mp1_peak, "real_total": real_total,
                      "plan": str(result)}))


if __name__ == "__main__":
    main()
