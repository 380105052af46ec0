"""The planner compiles the step ``Trainer`` runs (``redco.train_step.make_train_step``), not a
copy of it: for the same params, rules, mask and micro-batches, ``measure`` reads the same
FLOPs and the same memory off XLA as ``Trainer.compile_train_step`` (the FLOPs with the
micro-batch loop's second trip, which XLA's count leaves out, added)."""
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from planner_helpers import lm_examples

from redco import Deployer, Trainer, lora
from redco.step_flops import loop_repeats_flops
from redco_planner.measure import measure
from redco_planner.models import lm_loss
from redco_zoo_lm import collate_fn, loss_fn
from redco_zoo_models import LlamaConfig, LlamaForCausalLM, add_lora, split_model


def test_measure_compiles_the_trainers_own_step(workdir):
    cfg = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    apply_fn, params = split_model(add_lora(LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)), rank=4))
    mask = lora.trainable_mask(params)
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=workdir, verbose=False)
    trainer = Trainer(deployer, collate_fn, apply_fn, loss_fn, params, optax.adamw(1e-2),
                      trainable=mask, accumulate_grad_batches=2, count_tokens=None)
    examples = lm_examples(16, seq_len=8)
    trained = trainer.compile_train_step(examples, per_device_batch_size=2)
    batch = {"input_ids": jax.ShapeDtypeStruct((2, 9), jnp.int32)}  # one device's rows
    measured = measure(params, lm_loss(apply_fn), batch, 8, 2, rules=trainer.params_sharding_rules,
                       optimizer=optax.adamw(1e-2), trainable=mask, accumulate_grad_batches=2)
    memory = trained.memory_analysis()
    micro_batches = deployer.make_batch(examples, collate_fn, n_micro=2)  # (2 x 8 rows)
    repeats = loop_repeats_flops(trainer.steps.train.trace(trainer.state, micro_batches))
    assert repeats > 0
    assert measured.flops == pytest.approx(trained.cost_analysis()["flops"] + repeats / 8)
    assert (measured.argument_bytes, measured.output_bytes, measured.alias_bytes,
            measured.temp_bytes) == (memory.argument_size_in_bytes, memory.output_size_in_bytes,
                                     memory.alias_size_in_bytes, memory.temp_size_in_bytes)


def test_an_auto_deployer_plans_the_fsdp_step_its_trainer_then_compiles(workdir):
    """``Deployer(n_model_shards="auto")`` hands the planner the Trainer's own loss: the FSDP
    layout it picks is measured with the per-layer weight gathers the trained step has, so
    the planned memory is the compiled step's."""
    cfg = LlamaConfig(vocab_size=32, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    apply_fn, params = split_model(LlamaForCausalLM(cfg, rngs=nnx.Rngs(0)))
    deployer = Deployer(jax_seed=0, n_model_shards="auto", device_memory="1GB", workdir=workdir,
                        verbose=False, sharding_rules="auto+fsdp", n_context_shards=1)
    trainer = Trainer(deployer, collate_fn, apply_fn, loss_fn, params, optax.adamw(1e-2),
                      remat="full", count_tokens=None)
    examples = lm_examples(16, seq_len=64)
    trained = trainer.compile_train_step(examples, per_device_batch_size=2).memory_analysis()
    planned = deployer.layout_plan.tried[-1]
    assert planned.sharding_rules == "auto+fsdp" and planned.fits
    assert (planned.argument_bytes, planned.temp_bytes) == (trained.argument_size_in_bytes,
                                                            trained.temp_size_in_bytes)
