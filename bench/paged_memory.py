"""How many concurrent sequences of a length distribution fit one 80 GB device for LLaMA 3.2 1B:
the engine's slot cache (rows of ``max_len``) against its paged cache (``Engine(page_size=)``),
by ahead-of-time compilation (nothing allocated): each decode step compiled on abstract shapes
on one device, its peak read off ``memory_analysis`` (``decode_layout.peak_bytes``), against
the planner's usable 90% of 80 GB.

The distribution: sequences whose prompt + ``max_tokens`` reserve 512, 1,024, 2,048 and 4,096
slots in turn (a quarter each, mean 1,920), ``max_len`` 4,096, bf16 cache, fp32 params. Slots:
every sequence takes a row of 4,096 slots. Pages (16 slots): each takes its own length's
pages; the decode step also gathers every running row's pages into ``span`` contiguous slots
(``engine_paged``), ``span`` the longest running row's rounded up (4,096 once a 4,096-slot
sequence runs). Each count is the largest whose compiled peak fits (``most``).

    python bench/paged_memory.py [--preset llama-3.2-1b --device_gb 80]
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
from functools import partial

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + \
    " --xla_force_host_platform_device_count=8"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from provenance import print_provenance  # noqa: E402

from redco_zoo_models.decode_layout import peak_bytes  # noqa: E402
from redco_zoo_models.decoder import DecoderConfig, DecoderLM  # noqa: E402
from redco_zoo_models.engine_memory import traced, vocab_size  # noqa: E402
from redco_zoo_models.engine_paged import paged_decode  # noqa: E402
from redco_zoo_models.engine_steps import decode_rows  # noqa: E402
from redco_zoo_models.pages import pages_of  # noqa: E402
from redco_zoo_models.presets import preset  # noqa: E402

LENGTHS = (512, 1024, 2048, 4096)
MAX_LEN, PAGE, GiB = 4096, 16, 2 ** 30


def peak(model, rows: int, slots_or_pages: int, paged: bool) -> int:
    """The decode step's compiled peak over ``rows`` rows: a slot cache of ``rows`` x
    ``MAX_LEN``, or a pool of ``slots_or_pages`` pages (span ``MAX_LEN``)."""
    abstract = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    params = nnx.state(model, nnx.Param)
    cache = traced(model, lambda m: m.init_cache(slots_or_pages, PAGE, jnp.bfloat16) if paged
                   else m.init_cache(rows, MAX_LEN, jnp.bfloat16))
    vocab = vocab_size(model, MAX_LEN, jnp.bfloat16)
    args = [params, cache, abstract((rows, MAX_LEN), bool), abstract((rows, vocab), jnp.float32),
            abstract((rows,), jnp.int32), abstract((rows,), bool),
            abstract((3, rows), jnp.float32), abstract((rows, 2), jnp.uint32),
            abstract((rows,), jnp.int32)]
    graphdef = nnx.graphdef(model)
    if paged:
        step = partial(paged_decode, graphdef, 1, None, span=MAX_LEN,
                       slotted=jax.tree.map(lambda _: True, cache))  # (no recurrent layer)
        args.append(abstract((rows, MAX_LEN // PAGE), jnp.int32))
    else:
        step = partial(decode_rows, graphdef, 1, None, span=MAX_LEN)
    return peak_bytes(jax.jit(step, donate_argnums=(1, 2, 3)).lower(*args).compile())


def most(peak_of, budget: int) -> tuple[int, int, int]:
    """``(n, peak(n), peak(n + 1))``: the largest ``n`` whose peak fits ``budget``, from the
    peak's line through ``n`` = 4 and 8 (affine: the params, and per sequence its cache), then
    checked at ``n`` and ``n + 1`` (stepping while the line misses)."""
    a, b = peak_of(4), peak_of(8)
    n = 4 + int((budget - a) // ((b - a) / 4))
    while peak_of(n) > budget:
        n -= 1
    while peak_of(n + 1) <= budget:
        n += 1
    return n, peak_of(n), peak_of(n + 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-3.2-1b")
    parser.add_argument("--device_gb", type=float, default=80)
    args = parser.parse_args()
    print_provenance()
    budget = int(args.device_gb * 1e9 * 0.9)
    model = nnx.eval_shape(lambda: DecoderLM(DecoderConfig.from_hf(preset(args.preset)),
                                             rngs=nnx.Rngs(0)))
    lengths = lambda n: [LENGTHS[i % len(LENGTHS)] for i in range(n)]  # noqa: E731
    n_pages = lambda n: sum(pages_of(x, PAGE) for x in lengths(n))  # noqa: E731
    cached = functools.cache(lambda n, paged: peak(model, n, n_pages(n) if paged else 0, paged))
    print(f"{args.preset}, one {args.device_gb:g} GB device (usable {budget / GiB:.1f} GiB), "
          f"bf16 cache, max_len {MAX_LEN}, sequences of {LENGTHS} slots in turn")
    print(f"{'cache':>26} {'sequences':>9} {'peak':>10} {'one more':>10}")
    for paged, name in ((False, "slots (rows of 4,096)"), (True, f"pages of {PAGE}, span 4,096")):
        n, at, after = most(lambda n: cached(n, paged), budget)
        print(f"{name:>26} {n:>9} {at / GiB:>6.2f} GiB {after / GiB:>6.2f} GiB", flush=True)


if __name__ == "__main__":
    main()
