"""The planner's last lever: LoRA over a quantised base (QLoRA), tried only once neither full
fine-tuning nor LoRA over the unquantised base fits any layout.

The model is built abstractly with its attention and MLP projections as
``redco_zoo_models.quantized_linear.QuantizedLinear`` layers plus LoRA adapters
(``redco_planner.models.zoo_decoder``'s ``quantized(rank, fmt)``), so the compiled step
holds the frozen codes and scales at their real byte sizes (uint8 codes two weights a byte for
NF4, int8 or float8 codes for the others, float32 scales), the adapters and their AdamW state
in the params' dtype, and dequantises each kernel inside the step as training does. The parts
are laid out where their kernel's rule by name puts the kernel (``LoraModel.overrides``), as
the zoo's runs lay them out.

``quantize_base="auto"`` tries the formats in order of fidelity, ``AUTO_ORDER``: int8 first,
then nf4 (half the bytes of a weight, more error). int8 rather than fp8: both hold a weight in
one byte, so fp8 fits nowhere int8 does not, and int8's per-channel grid (error at most
absmax / 254, uniform) is finer than e4m3's 3-bit mantissa for all but the smallest weights:
on a 4096 x 1024 Gaussian kernel the relative RMS error is 0.87% for int8, 2.6% for fp8 and
9.2% for NF4 (``redco_zoo_models.quantize``). A named format tries only that one.
"""
from __future__ import annotations

from typing import Callable

from redco.protocols import UsageError
from redco_planner.models import LoraModel

FORMATS = ("nf4", "int8", "fp8")  # (redco_zoo_models.quantize.FORMATS)
AUTO_ORDER = ("int8", "nf4")  # most faithful first (module docstring)


def formats(quantize_base: str) -> tuple[str, ...]:
    """The formats ``quantize_base`` tries, in order: ``AUTO_ORDER`` for ``auto``."""
    return AUTO_ORDER if quantize_base == "auto" else (quantize_base,)


class QuantizeBaseError(UsageError, ValueError):
    """A quantised base the planner cannot try; the message names the fix (the ``redco``
    command prints it in one line)."""


def check(quantize_base: str | None, lora_rank: int | None,
          quantized: Callable | None) -> None:
    """Refuse, before anything compiles, a quantised base the planner cannot try."""
    if quantize_base is None:
        return
    if quantize_base not in ("auto", *FORMATS):
        raise QuantizeBaseError(f"quantize_base={quantize_base!r}: choose auto or one of {FORMATS}.")
    if lora_rank is None:
        raise QuantizeBaseError(f"quantize_base={quantize_base!r} without lora_rank: a quantised base "
                         "is frozen and trains only through LoRA adapters; give lora_rank "
                         "(--lora_rank 16), or drop quantize_base.")
    if quantized is None:
        raise QuantizeBaseError(f"quantize_base={quantize_base!r}: the model has no quantised build "
                         "(plan(quantized=...)); the zoo's decoders have one: redco plan "
                         "--model <preset>, or redco_planner.models.zoo_decoder.")


def quantized_bases(quantized: Callable[[int, str], LoraModel], rank: int, quantize_base: str,
                    log: Callable[[str], None]) -> dict[str, LoraModel]:
    """``{format: the model over that base}`` for the formats ``quantize_base`` tries, built
    abstractly up front (so a named format the model's shapes refuse fails before any
    compile); under ``auto``, one they refuse is skipped and said in ``log``."""
    built = {}
    for fmt in formats(quantize_base):
        try:
            built[fmt] = quantized(rank, fmt)
        except ValueError as e:
            if quantize_base != "auto":
                raise QuantizeBaseError(str(e)) from e
            log(f"LoRA rank {rank} over a {fmt} base not tried: {e}")
    return built
