"""The decode layout (``redco_zoo_models.decode_layout``) against decoding on FSDP's training
layout, on 8 simulated CPU devices.

1. **A 1B-shaped model by AOT** (``--preset``, default llama-3.2-1b, fp32 weights as a
   trainer holds them; nothing allocated): the engine's decode step (``--rows`` rows of
   ``--max_len`` slots, one token each) compiled ahead of time on FSDP's layout (weights split
   over 8 devices: what GRPO's rollouts decoded on) and on each decode layout (tensor parallel
   over 1, 2, 4, 8, the other devices replicas). Per layout: the weights a device holds, the
   step's peak (``memory_analysis()``), and the bytes its collectives deliver to a device
   (``decode_layout.collective_bytes``: the compiled HLO's all-gather, all-reduce,
   reduce-scatter, all-to-all and collective-permute results) per step and per generated token
   (a step decodes one token for each row); then the chooser's pick for two memory budgets.
2. **GRPO rounds on a tiny model on the CPU** (LLaMA width ``--width``, ``--layers`` layers,
   random weights, a chat word tokenizer; 16 prompts x 8 samples of at most 64 new tokens, an
   engine of 32 rows; 2 updates a round): a trainer under FSDP over 8 devices, its rollouts on
   the training layout (today's ``--decode_model_shards train``) against the decode layout
   (``auto``: degree 1 here, the CPU reporting no memory; and 2). Per setting, rounds 2 to 4
   (round 1 compiles): rollout completion tokens/s, rollout seconds, whole-round seconds
   (rollout, updates and clip fraction), and the bytes of live arrays on device 0 while the
   rollout decodes (params, optimizer state, cache: ``jax.live_arrays()``), with the params'
   own share.

    python bench/decode_layout.py [--preset llama-3.2-1b --rows 32 --max_len 512]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + \
    " --xla_force_host_platform_device_count=8"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from provenance import print_provenance  # noqa: E402

from redco import plugins  # noqa: E402
from redco.sharding import make_mesh, shardings_from_specs, specs_from_rules  # noqa: E402
from redco_zoo_models.decode_layout import (  # noqa: E402
    choose_decode_layout,
    collective_bytes,
    compile_decode_step,
    decode_shardings,
    held_bytes,
    peak_bytes,
)

GiB, MiB = 2 ** 30, 2 ** 20


def fsdp_layout(params):
    mesh = make_mesh(jax.devices(), 1)
    rules = plugins.lookup("sharding_rules", "fsdp")(params, mesh)
    return mesh, shardings_from_specs(specs_from_rules(params, rules, mesh), mesh)


def aot_row(name, model, params, mesh, shardings, args) -> None:
    compiled = compile_decode_step(model, params, mesh, shardings, args.rows, args.max_len)
    moved = collective_bytes(compiled)
    total = sum(moved.values())
    ops = ", ".join(f"{op} {b / MiB:.2f}" if b >= MiB // 100 else f"{op} {b} bytes"
                    for op, b in sorted(moved.items())) or "none"
    print(f"{name:>22} {held_bytes(params, shardings) / GiB:>9.2f} "
          f"{peak_bytes(compiled) / GiB:>9.2f} {total / MiB:>12.2f} "
          f"{total / args.rows:>12.0f}   {ops}")


def aot(args) -> None:
    from redco_zoo_models.decoder import DecoderConfig, DecoderLM
    from redco_zoo_models.presets import preset
    model = nnx.eval_shape(lambda: DecoderLM(DecoderConfig.from_hf(preset(args.preset)),
                                             rngs=nnx.Rngs(0)))
    params = nnx.state(model, nnx.Param)
    n = sum(x.size for x in jax.tree.leaves(params))
    print(f"1. decode step of {args.preset} ({n / 1e9:.2f}B params, fp32), {args.rows} rows of "
          f"{args.max_len} slots, one token each; 8 devices, by AOT")
    print(f"{'layout':>22} {'weights':>9} {'peak':>9} {'coll. MiB':>12} {'bytes/token':>12}   "
          "by collective (MiB a step)\n" + f"{'':>22} {'GiB/dev':>9} {'GiB/dev':>9} "
          f"{'a step':>12}")
    aot_row("FSDP (training) dp8", model, params, *fsdp_layout(params), args)
    for mp in (1, 2, 4, 8):
        mesh = make_mesh(jax.devices(), mp)
        aot_row(f"decode mp{mp} x dp{8 // mp}", model, params, mesh,
                decode_shardings(params, mesh), args)
    for budget in (80, 4):
        layout = choose_decode_layout(model, params, jax.devices(), args.rows, args.max_len,
                                      budget * GiB)
        print(f"   chooser with {budget} GiB a device: {layout.describe()}")


def tiny_model_dir(root: str, width: int, layers: int) -> str:
    from redco_zoo_models import LlamaConfig, LlamaForCausalLM
    from redco_zoo_models.toy import chat_word_tokenizer, save_model_dir
    words = ["system", "user", "assistant"] + [f"w{i}" for i in range(253)]
    tokenizer = chat_word_tokenizer(words)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(words) + 4, hidden_size=width, intermediate_size=2 * width,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4), nnx.Rngs(0))
    save_model_dir(model, tokenizer._tokenizer, root)
    tokenizer.save_pretrained(root)
    return root


def live_bytes(device) -> int:
    return sum(s.data.nbytes for a in jax.live_arrays() if not a.is_deleted()
               for s in a.addressable_shards if s.device == device)


def grpo_rounds(model_dir: str, decode_model_shards, workdir: str) -> dict:
    import optax

    from redco import Deployer, Trainer
    from redco_zoo_grpo import exact_match, loss_fn, pred_fn
    from redco_zoo_grpo.pipeline import collate_fn, prompt_examples
    from redco_zoo_grpo.rollout import GRPO, GRPOConfig
    from redco_zoo_models import runner, split_model
    from redco_zoo_sft.pipeline import load_chat_tokenizer
    tokenizer, (model, _) = load_chat_tokenizer(model_dir), runner.load_model(model_dir, False, 0)
    rng = np.random.default_rng(0)
    rows = [{"prompt": " ".join(f"w{i}" for i in rng.integers(0, 253, 8)), "answer": "w0"}
            for _ in range(64)]
    (prompts, rows), _ = prompt_examples(tokenizer, (rows, rows[:1]), "prompt", 32)
    deployer = Deployer(jax_seed=0, workdir=workdir, verbose=False, sharding_rules="fsdp")
    apply_fn, params = split_model(model)
    trainer = Trainer(deployer, collate_fn, apply_fn, loss_fn, params, optax.adam(1e-5))
    grpo = GRPO(trainer, model, tokenizer, pred_fn, exact_match,
                GRPOConfig(n_samples=8, max_new_tokens=64, n_updates=2), 16, engine_rows=32,
                decode_model_shards=decode_model_shards)
    grpo.decide_layout(prompts, 0)
    device, seen = jax.devices()[0], {}
    run_engine = grpo.engine.engine.run_until_done

    def measured(requests):  # the bytes live on device 0 as the rollout decodes
        seen["live"] = live_bytes(device)
        seen["params"] = sum(s.data.nbytes for x in jax.tree.leaves(grpo.engine.engine.params)
                             for s in x.addressable_shards if s.device == device)
        return run_engine(requests)
    grpo.engine.engine.run_until_done = measured
    walls = []
    with trainer.run(loop=grpo) as run:
        for r in range(4):
            start = time.perf_counter()
            grpo.train_round(run, prompts[16 * r:16 * (r + 1)], rows[16 * r:16 * (r + 1)],
                             "prompt", 4)
            walls.append(time.perf_counter() - start)
            run.step_done()
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        logged = [row for row in map(json.loads, f) if "rollout/seconds" in row][1:]
    return {"tok_s": np.mean([row["rollout/tokens_per_s"] for row in logged]),
            "rollout_s": np.mean([row["rollout/seconds"] for row in logged]),
            "round_s": np.mean(walls[1:]), **seen}


def grpo(args) -> None:
    print(f"\n2. GRPO rounds: LLaMA width {args.width}, {args.layers} layers, trained under FSDP "
          "over 8 CPU devices; 16 prompts x 8 samples, <= 64 new tokens, 32 engine rows; "
          "rounds 2-4")
    print(f"{'rollouts decode on':>26} {'tok/s':>8} {'rollout s':>10} {'round s':>8} "
          f"{'live MiB':>9} {'params MiB':>11}  (device 0, while decoding)")
    with tempfile.TemporaryDirectory() as root:
        model_dir = tiny_model_dir(os.path.join(root, "model"), args.width, args.layers)
        for name, setting in (("training layout (FSDP)", None), ("decode layout auto (mp1)",
                                                                 "auto"), ("decode layout mp2", 2)):
            out = grpo_rounds(model_dir, setting, os.path.join(root, str(setting)))
            print(f"{name:>26} {out['tok_s']:>8.0f} {out['rollout_s']:>10.2f} "
                  f"{out['round_s']:>8.2f} {out['live'] / MiB:>9.2f} {out['params'] / MiB:>11.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-3.2-1b")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--max_len", type=int, default=512)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--skip", choices=("aot", "grpo"), help="leave one part out")
    args = parser.parse_args()
    print_provenance()
    if args.skip != "aot":
        aot(args)
    if args.skip != "grpo":
        grpo(args)
