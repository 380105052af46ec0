"""FSDP's per-device peak and FLOPs over 2, 4 and 8 devices, with each layer gathering its own
weights (``redco.fsdp``, what trains) and without (XLA's SPMD partitioner choosing alone, as
before it): the planner's ``measure`` of the zoo LLaMA's train step (width 1024, 8 layers, one
512-token row per device, fp32, AdamW), ``auto+fsdp`` at mp=1 and mp=2, no remat,
``dots_saveable`` and ``full``. The FLOPs per device should not grow with the devices: each
device computes its own rows.

    python bench/fsdp_memory.py        # 8 simulated CPU devices; a few minutes
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def peaks(gather: bool, remat: str, mp: int) -> dict[int, tuple[float, float, float]]:
    """``{devices: (peak MB, temp MB, GFLOPs)}`` per device of the step, with or without the
    per-layer gather."""
    from redco import fsdp
    from redco_planner.measure import measure
    from redco_planner.models import zoo_llama
    model = zoo_llama(512, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                      num_attention_heads=8, num_key_value_heads=8)
    declared = fsdp.targets
    if not gather:
        fsdp.targets = lambda leaves: [None] * len(leaves)
    try:
        return {n: (t.peak_bytes / 1e6, t.temp_bytes / 1e6, t.flops / 1e9)
                for n in (2, 4, 8) if n > mp
                for t in [measure(model.params, model.loss_fn, model.batch(1), n, mp,
                                  sharding_rules="auto+fsdp", remat=remat)]}
    finally:
        fsdp.targets = declared


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from provenance import print_provenance
    print_provenance()
    print("remat          mp  per-layer gather   peak (temp) MB, GFLOPs per device on 2 / 4 / 8 "
          "devices")
    for remat in ("none", "dots_saveable", "full"):
        for mp in (1, 2):
            for gather in (False, True):
                row = "  ".join(f"{n}: {p:7.1f} ({t:6.1f}) {f:5.1f}"
                                for n, (p, t, f) in peaks(gather, remat, mp).items())
                print(f"{remat:14s} {mp}   {'yes' if gather else 'no ':16s} {row}", flush=True)
