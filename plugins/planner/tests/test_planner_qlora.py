"""The planner's quantised-base lever (QLoRA, ``quantize_base``): tried only once neither full
fine-tuning nor LoRA over the unquantised base fits; ``auto`` tries int8, then nf4. Measured by
the same ahead-of-time compile on the 8 simulated devices, the frozen codes and scales at their
byte sizes as written out here (``redco_zoo_models.quantize``'s formats), the adapters and
their AdamW state in float32."""
import math
import re

import pytest

from redco.sharding import named_leaves
from redco_planner.inspection import load_model
from redco_planner.models import zoo_llama
from redco_planner.planner import plan
from redco_planner.qlora import QuantizeBaseError

RANK = 8
PROJECTIONS = re.compile(r"(q|k|v|o|gate|up|down)_proj/kernel$")


@pytest.fixture(scope="module")
def model():
    """Projections (2 x 2.4M weights) outweigh the rest (256-token vocabulary, 16 tokens)."""
    return zoo_llama(16, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                     vocab_size=256)


def kernel_bytes(n_in: int, n_out: int, fmt: str | None) -> int:
    """One projection's frozen bytes: float32; int8 codes and a float32 scale per output
    channel; NF4 codes two a byte, an int8 absmax per 64 inputs, a float32 scale per 256
    absmaxes along the output axis, one float32 offset."""
    if fmt is None:
        return 4 * n_in * n_out
    if fmt == "int8":
        return n_in * n_out + 4 * n_out
    blocks = n_in // 64
    return n_in * n_out // 2 + blocks * n_out + 4 * blocks * (n_out // math.gcd(n_out, 256)) + 4


def expected_bytes(params, fmt: str | None) -> tuple[int, int]:
    """``(params, adapters)`` bytes of LoRA rank ``RANK`` over a ``fmt`` base (None: float32),
    from the unquantised model's shapes: every other param float32. A stacked projection
    (layers, in, out) counts as its layers' own (scanned layers, the zoo's default)."""
    total = adapters = 0
    for path, leaf in named_leaves(params):
        if PROJECTIONS.search(path):
            *layers, n_in, n_out = leaf.shape
            total += math.prod(layers) * kernel_bytes(n_in, n_out, fmt)
            adapters += math.prod(layers) * 4 * RANK * (n_in + n_out)
        else:
            total += 4 * math.prod(leaf.shape)
    return total + adapters, adapters


def plan_qlora(model, memory: int, quantize_base: str):
    """One row per device on 8 devices, mp=1 (the batch split over dp=8), ``auto`` rules."""
    return plan(model.params, model.loss_fn, model.batch(1), 8, memory, rule_sets=("auto",),
                model_degrees=(1,), headroom=0.0, lora_rank=RANK, lora=model.lora,
                quantize_base=quantize_base, quantized=model.quantized)


def lora_state(model) -> int:
    """Unquantised LoRA's params and the adapters' AdamW moments: its peak is above this."""
    params, adapters = expected_bytes(model.params, None)
    return params + 2 * adapters


@pytest.mark.parametrize("quantize_base,fmt", [("auto", "int8"), ("nf4", "nf4")])
def test_a_quantised_base_is_picked_where_only_it_fits(model, quantize_base, fmt):
    memory = lora_state(model) - 1  # full fine-tuning and plain LoRA cannot fit
    result = plan_qlora(model, memory, quantize_base)
    assert [(t.lora_rank, t.quantized, t.fits) for t in result.tried] == [
        (None, None, False), (RANK, None, False), (RANK, fmt, True)]
    assert result.lora_rank == RANK and result.quantize_base == fmt
    assert result.peak_bytes <= memory
    assert result.reason.startswith(
        f"no full fine-tuning layout fits, nor LoRA rank {RANK} over the unquantised base; "
        f"with LoRA rank {RANK} over an {fmt.upper()} base (redco_zoo_models.add_lora over "
        f"{fmt.upper()} QuantizedLinear"), result.reason
    pick = result.tried[-1]
    params, adapters = expected_bytes(model.params, fmt)
    assert pick.params_bytes == params  # the codes at their byte size, not as float32
    # AdamW's mu and nu for the adapters alone (a step count and the rng beside): none for the
    # frozen codes and scales, and no gradient
    assert 2 * adapters <= pick.argument_bytes - pick.params_bytes <= 2 * adapters + 1024


def test_auto_takes_nf4_only_where_int8_does_not_fit(model):
    int8, nf4 = (plan_qlora(model, lora_state(model) - 1, fmt).peak_bytes
                 for fmt in ("int8", "nf4"))
    assert nf4 < int8  # (2.4M weights: 1.2 MB of NF4 codes less than int8's)
    result = plan_qlora(model, (int8 + nf4) // 2, "auto")
    assert [(t.quantized, t.fits) for t in result.tried] == [
        (None, False), (None, False), ("int8", False), ("nf4", True)]
    assert result.quantize_base == "nf4" and result.peak_bytes == nf4
    assert "nor LoRA rank 8 over the unquantised base, nor LoRA rank 8 over an INT8 base; " \
        "with LoRA rank 8 over an NF4 base" in result.reason


def test_a_quantised_base_without_lora_rank_or_a_quantised_build_is_refused(model):
    with pytest.raises(QuantizeBaseError, match=r"without lora_rank.*give lora_rank"):
        plan(model.params, model.loss_fn, model.batch(1), 8, 2 ** 30, quantize_base="nf4")
    with pytest.raises(QuantizeBaseError, match=r"no quantised build.*redco plan --model"):
        plan(model.params, model.loss_fn, model.batch(1), 8, 2 ** 30, lora_rank=RANK,
             quantize_base="auto")


def test_redco_plan_refuses_quantize_base_before_building_anything(capsys):
    from redco.cli import main
    with pytest.raises(SystemExit):
        main(["plan", "--model", "llama-tiny", "--devices", "1", "--device_memory", "1GB",
              "--quantize_base", "auto"])
    assert "--quantize_base auto without --lora_rank" in capsys.readouterr().err
    tiny = load_model("llama-tiny")  # its MLP's 352 inputs are no whole number of NF4 blocks
    with pytest.raises(QuantizeBaseError, match="use --quantize_base int8 or fp8"):
        plan(tiny.params, tiny.loss_fn, tiny.batch(1), 1, 2 ** 30, lora_rank=RANK,
             quantize_base="nf4", quantized=tiny.quantized)


def test_redco_plan_prints_the_quantised_pick_and_why(capsys):
    from redco.cli import main
    tiny = load_model("llama-tiny", seq_len=16)
    memory = int(lora_state(tiny) * 0.99 / 0.9)  # usable: 99% of plain LoRA's state
    main(["plan", "--model", "llama-tiny", "--devices", "1", "--device_memory", str(memory),
          "--seq_len", "16", "--rules", "auto", "--lora_rank", str(RANK),
          "--quantize_base", "auto"])
    out = capsys.readouterr().out
    assert re.search(r"lora r=8 over int8 peak .*  fits", out), out
    assert f"LoRA rank {RANK} over an INT8 base (peak" in out
    assert f"why: no full fine-tuning layout fits, nor LoRA rank {RANK} over the unquantised " \
        f"base; with LoRA rank {RANK} over an INT8 base" in out
