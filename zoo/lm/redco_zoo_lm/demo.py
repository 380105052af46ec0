"""The main job: a small LLaMA-style model learns English from Python's own docs.

Trains on ``pydoc_data.topics`` (bytes as tokens) on every device it finds; on a CPU-only
machine that is 8 simulated devices. Reports eval perplexity, prints a sample, saves a
checkpoint; run it again and it resumes from that checkpoint.
"""
import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()

import argparse  # noqa: E402
import functools  # noqa: E402
import math  # noqa: E402
from pydoc_data.topics import topics  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from redco import Deployer, Predictor, Trainer  # noqa: E402
from redco_zoo_lm.pipeline import collate_fn, loss_fn, pred_fn  # noqa: E402
from redco_zoo_models import LlamaConfig, LlamaForCausalLM, split_model  # noqa: E402


def byte_sequences(seq_len: int) -> list[dict]:
    data = np.frombuffer("\n".join(topics.values()).encode(), np.uint8).astype(np.int32)
    n = len(data) // (seq_len + 1)
    return [{"token_ids": row} for row in data[:n * (seq_len + 1)].reshape(n, seq_len + 1)]


def make_model(hidden_size: int, n_layers: int, seed: int) -> LlamaForCausalLM:
    """The demo's model: bytes in, bytes out (``vocab_size`` 256)."""
    config = LlamaConfig(hidden_size=hidden_size, num_hidden_layers=n_layers,
                         intermediate_size=hidden_size * 11 // 4)
    return LlamaForCausalLM(config, rngs=nnx.Rngs(seed))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--n_model_shards", type=int, help="default: 2 where the device count "
                        "is even (8 simulated CPU devices, 8 GPUs), else 1 (one GPU)")
    parser.add_argument("--per_device_batch_size", type=int, default=8)
    parser.add_argument("--n_epochs", type=int, default=1)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--n_layers", type=int, default=2)
    parser.add_argument("--hidden_size", type=int, default=128)
    parser.add_argument("--workdir", default="./workdir/lm-demo")
    parser.add_argument("--jax_seed", type=int, default=42)
    args = parser.parse_args(argv)

    if args.n_model_shards is None:
        args.n_model_shards = 2 if jax.device_count() % 2 == 0 else 1
    deployer = Deployer(n_model_shards=args.n_model_shards, jax_seed=args.jax_seed,
                        workdir=args.workdir, run_tensorboard=True)
    examples = byte_sequences(args.seq_len)
    n_eval = len(examples) // 20
    train_examples, eval_examples = examples[n_eval:], examples[:n_eval]

    model = make_model(args.hidden_size, args.n_layers, args.jax_seed)
    apply_fn, params = split_model(model)
    lr_schedule_fn = deployer.get_lr_schedule_fn(
        train_size=len(train_examples), per_device_batch_size=args.per_device_batch_size,
        n_epochs=args.n_epochs, learning_rate=args.learning_rate, schedule_type="cosine",
        warmup_rate=0.05)
    trainer = Trainer(deployer=deployer, collate_fn=collate_fn, apply_fn=apply_fn,
                      loss_fn=loss_fn, params=params,
                      optimizer=optax.adamw(lr_schedule_fn, weight_decay=0.01),
                      lr_schedule_fn=lr_schedule_fn,
                      params_sharding_rules=deployer.get_sharding_rules(
                          params=params, trace_fn=lambda p: apply_fn(p, np.zeros((1, 8), np.int32))))
    trainer.fit(train_examples=train_examples, per_device_batch_size=args.per_device_batch_size,
                n_epochs=args.n_epochs, eval_examples=eval_examples, save_last_ckpt=True,
                save_every_n_steps=50)
    eval_loss = trainer.eval_loss(eval_examples, args.per_device_batch_size)
    deployer.log_info(f"eval loss {eval_loss:.4f}, perplexity {math.exp(eval_loss):.3f} "
                      f"(bytes; uniform would be 256)")

    prompt = "The import statement"
    predictor = Predictor(
        deployer=deployer,
        collate_fn=lambda exs: {"input_ids": np.stack([np.frombuffer(e.encode(), np.uint8)
                                                       .astype(np.int32) for e in exs])},
        pred_fn=functools.partial(pred_fn, model=model),
        # bytes that are not UTF-8 (a byte model may sample them) show as \xNN
        output_fn=lambda preds: [bytes(row.astype(np.uint8)).decode(errors="backslashreplace")
                                 for row in preds],
        params_sharding_rules=trainer.params_sharding_rules)
    sample = predictor.predict([prompt], per_device_batch_size=1, params=trainer.params)[0]
    deployer.log_info(f"sample: {prompt}{sample}")
    deployer.close()


if __name__ == "__main__":
    main()
