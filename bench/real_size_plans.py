"""``auto`` plans of real-size models (abstract shapes, nothing allocated): per-device parameter
bytes against total / n_model_shards, and what stays replicated.

Tiny test configs overstate what stays whole (position tables, norms); this shows the published
shapes. Needs transformers<5 (the HF Flax models of ``tests/sharding_hf/hf_archs.py``).

Run:  python bench/real_size_plans.py
"""
import os
import sys
import tempfile
import warnings

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "sharding_hf"))

import hf_archs  # noqa: E402

from redco import Deployer  # noqa: E402
from redco_planner.inspection import human_bytes, plan_table, totals  # noqa: E402

MODELS = {  # name -> (hf_archs arch, published config fields)
    "gpt2-large": ("gpt2", dict(n_embd=1280, n_layer=36, n_head=20, n_inner=5120,
                                 n_positions=1024, vocab_size=50257)),
    "gpt2-large, vocab padded to 50304": (
        "gpt2", dict(n_embd=1280, n_layer=36, n_head=20, n_inner=5120, n_positions=1024,
                     vocab_size=50304)),
    "llama-7b": ("llama", dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                               max_position_embeddings=2048)),
    "t5-v1_1-xxl": ("t5", dict(d_model=4096, d_kv=64, d_ff=10240, num_layers=24,
                               num_decoder_layers=24, num_heads=64, vocab_size=32128,
                               feed_forward_proj="gated-gelu", tie_word_embeddings=False)),
}


def main() -> None:
    print(f"{'model':<36}{'params':>8}{'mp':>4}{'per device / (total/mp)':>25}{'replicated':>12}")
    for name, (arch, config) in MODELS.items():
        model = hf_archs.build(arch, abstract=True, **config)
        batch = model.batch(1)
        for mp in (4, 8):
            deployer = Deployer(jax_seed=0, n_model_shards=mp, workdir=tempfile.mkdtemp(),
                                verbose=False, loggers=())
            with warnings.catch_warnings(record=True) as warned:
                warnings.simplefilter("always")
                rules = deployer.get_sharding_rules(
                    model.params, trace_fn=lambda p: model.apply_fn(p, batch))
            t = totals(plan_table(deployer, model.params, rules), 8)
            note = f"  ({len(str(warned[0].message).split('; '))} params replicated: " \
                   "dims or heads do not divide)" if warned else ""
            print(f"{name:<36}{t['bytes'] / 4e9:>7.2f}B{mp:>4}"
                  f"{t['bytes_per_device'] / (t['bytes'] / mp):>25.3f}"
                  f"{human_bytes(t['replicated_bytes']):>12}{note}", flush=True)


if __name__ == "__main__":
    from provenance import print_provenance
    print_provenance()
    main()
