"""How many of the D devices sample GRPO's rollouts (``--rollout_devices auto``), and the
decode layout they sample on, chosen from the compiled cost and memory of one round, before
any weight is loaded.

**What is compiled**, ahead of time on abstract params (the model built with
``nnx.eval_shape`` from ``config.json`` or a preset: nothing allocated), for every N in
``1 .. D - 1``:

* the *rollout side*, on the last N devices, at each decode tensor-parallel degree of N (or the
  one ``--decode_model_shards`` gives): the engine's decode step over its ``engine_rows`` rows,
  one token (``decode_layout.compile_decode_step``), and its prefill of as many prompts of
  the round's prompt width as the engine reads at once (``engine_admission.prompts_per_prefill``;
  ``engine_steps.prefill_rows``);
* the *update side*, on the first D - N devices at the run's ``n_model_shards``: GRPO's own
  train step (the pipeline's loss over ``per_device_batch_size`` rows of prompt + completion,
  TIS weights included) compiled as ``Trainer`` compiles it (``redco_planner.measure``).

**Time is an estimate, not a measurement.** Each program's seconds are a roofline of its
per-device cost as XLA's ``cost_analysis()`` counts it: ``max(FLOPs / speed.flops, bytes
accessed / speed.bandwidth)``, plus the bytes its collectives deliver over ``speed.link``
(``redco.hlo_collectives``), on the speeds of ``Speed`` (default: an H100 SXM's dense bf16
FLOP/s, HBM and NVLink bandwidths; a CPU's compiled program on those speeds is a proxy). A
round's rollout is ``ceil(P / c)`` prefills of ``c`` prompts plus ``ceil(P G T / R)`` decode
steps (P prompts, G samples, T new tokens, R engine rows: every completion counted at
``max_new_tokens``, an upper bound where completions end early); its update is ``(mu + 2/3) x
P G / minibatch`` train steps: ``mu`` epochs of minibatches plus the two forward passes that
score the samples (their old log-probs before, the clip fraction after), a forward counted as
a third of a step. The round, with K = ``max_off_policy_steps``:

* K = 0: ``rollout(N) + update(D - N)`` (they alternate);
* K >= 1: ``max(rollout(N), update(D - N))`` (they overlap: ``async_rollouts.py``).

**Memory.** The rollout side fits where the compiled decode step's and prefill's peaks (params
+ key/value cache + temporaries) fit one device less ``HEADROOM``; the update side where the
compiled train step's (params + optimizer state + gradients + temporaries) does. An N whose
trainer mesh cannot be made (``n_model_shards`` not dividing D - N) or whose round does not
split into minibatches (P G a multiple of ``per_device_batch_size x dp``) is no candidate.

**The pick**: the N of least round time where both sides fit, with the decode degree of least
rollout time at that N. With P processes the candidates are the multiples of P (each process
gives N / P of its devices, its last, as ``--rollout_devices N`` does: ``async_rollouts.py``),
planned once the processes joined. Every N is logged as a row of a table (``Split.table``); where none
fits the run is refused before loading, naming the fix.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp

from redco.hlo_collectives import collectives
from redco.protocols import UsageError
from redco.sharding import dataflow_trace, make_mesh
from redco_zoo_models.decode_layout import (
    compile_decode_step,
    compile_prefill,
    decode_shardings,
    held_bytes,
    model_shard_degrees,
    peak_bytes,
)
from redco_zoo_models.engine_admission import prompts_per_prefill
from redco_zoo_models.engine_reading import prefill_width

FORWARD_SHARE = 1 / 3  # of a train step's cost, one forward pass (the scoring passes)


@dataclass(frozen=True)
class Speed:
    """One device's speeds the round's seconds are estimated on (module docstring)."""
    flops: float = 989e12  # FLOP/s: an H100 SXM's dense bf16
    bandwidth: float = 3.35e12  # bytes/s of memory: its HBM3
    link: float = 450e9  # bytes/s a device receives: NVLink 4, one direction

    def seconds(self, compiled) -> float:
        """``compiled``'s roofline seconds on one device, its collectives included."""
        cost = compiled.cost_analysis() or {}
        moved = sum(e["bytes"] for e in collectives(compiled.as_text()).values())
        return max(cost.get("flops", 0.0) / self.flops,
                   cost.get("bytes accessed", 0.0) / self.bandwidth) + moved / self.link


@dataclass(frozen=True)
class RoundShape:
    """What one GRPO round runs: ``prompts`` x ``samples`` completions of ``new_tokens`` after
    prompts ``prompt_len`` wide, on an engine of ``engine_rows`` rows; ``n_updates`` epochs of
    minibatches of ``per_device_batch_size`` x dp on a trainer split ``n_model_shards`` ways."""
    prompts: int
    samples: int
    prompt_len: int
    new_tokens: int
    engine_rows: int
    per_device_batch_size: int
    n_updates: int = 1
    n_model_shards: int = 1
    sharding_rules: str = "auto"
    remat: str = "none"
    compute_dtype: Any = None
    beta: float = 0.0

    def batch(self) -> dict:
        """One device's minibatch rows as the loss reads them, abstract."""
        b, w, t = self.per_device_batch_size, self.prompt_len, self.new_tokens
        shapes = dict(prompt_ids=((b, w), jnp.int32), prompt_mask=((b, w), bool),
                      tokens=((b, t), jnp.int32), completion_mask=((b, t), bool),
                      advantage=((b,), jnp.float32), old_logps=((b, t), jnp.float32),
                      is_weight=((b, t), jnp.float32))
        if self.beta:
            shapes["ref_logps"] = ((b, t), jnp.float32)
        return {k: jax.ShapeDtypeStruct(*v) for k, v in shapes.items()}


@dataclass
class Side:
    """One side of a split: its estimated seconds a round, its compiled per-device peak, whether
    it fits, and why not (``note``); ``degree``: the rollout side's decode degree."""
    seconds: float | None = None
    peak_bytes: int | None = None
    fits: bool = False
    note: str = ""
    degree: int | None = None

    def cell(self) -> str:
        if self.seconds is None:
            return self.note
        return (f"{ms(self.seconds)} {self.peak_bytes / 2 ** 20:9.1f} MiB "
                f"{'fits' if self.fits else 'over'}")


def ms(seconds: float) -> str:
    """``seconds`` in milliseconds, or in seconds from 1 s on."""
    return f"{seconds:9.3g} s " if seconds >= 1 else f"{seconds * 1e3:9.3g} ms"


@dataclass
class Candidate:
    n: int  # rollout devices
    rollout: Side
    update: Side

    def round_seconds(self, k: int) -> float | None:
        """The round-time model (module docstring); None where a side does not fit."""
        if not (self.rollout.fits and self.update.fits):
            return None
        both = (self.rollout.seconds, self.update.seconds)
        return max(both) if k else sum(both)


@dataclass
class Split:
    """The pick: ``rollout_devices`` and their ``decode_model_shards``, and every candidate."""
    rollout_devices: int
    decode_model_shards: int
    k: int
    n_devices: int
    candidates: list[Candidate] = field(default_factory=list)
    processes: int = 1

    def table(self) -> str:
        """Each N: its rollout and update estimates, peaks, fits, and the round's time."""
        head = f"{'N':>3} {'rollout (decode mp)':>36} {'update':>32} {'round':>12}"
        lines = [head]
        for c in self.candidates:
            round_s = c.round_seconds(self.k)
            mp = f" (mp {c.rollout.degree})" if c.rollout.degree else ""
            lines.append(f"{c.n:>3} {c.rollout.cell() + mp:>36} {c.update.cell():>32} "
                         + (ms(round_s) if round_s is not None else "-")
                         + ("  <- pick" if c.n == self.rollout_devices else ""))
        return "\n".join(lines)

    def reason(self) -> str:
        c = next(c for c in self.candidates if c.n == self.rollout_devices)
        rule = "max(rollout, update)" if self.k else "rollout + update"
        each = "" if self.processes == 1 else (
            f" (of the multiples of the {self.processes} processes: each gives N / "
            f"{self.processes} = {c.n // self.processes} of its devices)")
        return (f"N={c.n} of {self.n_devices} devices{each} has the least estimated round ({rule}, "
                f"K={self.k}) of the splits where both sides fit: rollout "
                f"{ms(c.rollout.seconds).strip()} on {c.n} devices (decode mp "
                f"{c.rollout.degree}), update {ms(c.update.seconds).strip()} on the other "
                f"{self.n_devices - c.n}")


def rollout_side(model, params, devices: list, shape: RoundShape, usable: int, speed: Speed,
                 degrees: list[int]) -> Side:
    """The rollout side on ``devices``: of the decode ``degrees`` that fit, the fastest."""
    max_len = shape.prompt_len + shape.new_tokens
    read = min(prompts_per_prefill(prefill_width(shape.prompt_len, max_len)),
               max(1, shape.engine_rows // shape.samples), shape.prompts)
    read = 1 << (read - 1).bit_length()  # the engine's prefill shapes: powers of two
    steps = math.ceil(shape.prompts * shape.samples * shape.new_tokens / shape.engine_rows)
    best, tried = Side(note="no decode degree fits"), []
    for mp in degrees:
        mesh = make_mesh(list(devices), mp)
        shardings = decode_shardings(params, mesh)
        if held_bytes(params, shardings) > usable:
            tried.append(f"mp {mp}: weights over")
            continue
        decode = compile_decode_step(model, params, mesh, shardings, shape.engine_rows, max_len)
        prefill = compile_prefill(model, params, mesh, shardings, shape.engine_rows, read,
                                  shape.prompt_len, max_len)
        peak = max(peak_bytes(decode), peak_bytes(prefill))
        seconds = steps * speed.seconds(decode) \
            + math.ceil(shape.prompts / read) * speed.seconds(prefill)
        side = Side(seconds, peak, peak <= usable, degree=mp)
        if side.fits and (not best.fits or seconds < best.seconds) or best.seconds is None:
            best = side
    return best


def update_side(params, loss: Callable, n_train: int, shape: RoundShape, usable: int,
                speed: Speed, trainable=None) -> Side:
    """The update side on the first ``n_train`` devices: GRPO's compiled train step, the round's
    steps (module docstring); a note where the mesh or the minibatches cannot be made."""
    from redco_planner.measure import measure
    mp, rows = shape.n_model_shards, shape.prompts * shape.samples
    if n_train % mp:
        return Side(note=f"n_model_shards {mp} does not divide {n_train}")
    minibatch = shape.per_device_batch_size * (n_train // mp)
    if rows % minibatch:
        return Side(note=f"{rows} samples not in minibatches of {minibatch}")
    batch = shape.batch()
    layout = measure(params, loss, batch, n_train, mp, shape.sharding_rules,
                     trace_fn=dataflow_trace(loss, batch), remat=shape.remat,
                     trainable=trainable, compute_dtype=shape.compute_dtype, skip_above=usable)
    if layout.over_budget is not None:
        return Side(note=f"state {layout.state_bytes / 2 ** 20:.1f} MiB over")
    step = max(layout.flops / speed.flops, layout.bytes_accessed / speed.bandwidth) + sum(
        e["bytes"] for e in layout.collectives.values()) / speed.link
    seconds = step * (rows // minibatch) * (shape.n_updates + 2 * FORWARD_SHARE)
    return Side(seconds, layout.peak_bytes, layout.peak_bytes <= usable)


def split_counts(n_devices: int, processes: int = 1) -> list[int]:
    """The rollout device counts tried: ``1 .. D - 1``; with P processes the multiples of P
    below D (each process gives as many, and keeps one to train on at least)."""
    return list(range(processes, n_devices - processes + 1, processes))


def plan_split(model, params, loss: Callable, shape: RoundShape, device_memory_bytes: int,
               k: int, decode_degree: int | str = "auto", speed: Speed = Speed(),
               trainable=None, headroom: float = 0.1, counts: list[int] | None = None,
               log: Callable[[str], None] = print, devices: list | None = None) -> Split:
    """The split of ``devices`` (default ``jax.devices()``; module docstring) for a round of
    ``shape`` of the abstract ``model`` (``params``: its ``split_model`` params;
    ``loss(params, batch)``: its GRPO loss); ``counts``: the N tried (default
    ``split_counts``). Raises ``UsageError`` naming the fix where no N fits."""
    from redco_zoo_grpo.async_rollouts import rollout_devices
    devices, usable = list(devices or jax.devices()), int(device_memory_bytes * (1 - headroom))
    processes = len({d.process_index for d in devices})
    split = Split(0, 0, k, len(devices), processes=processes)
    for n in counts or split_counts(len(devices), processes):
        update = update_side(params, loss, len(devices) - n, shape, usable, speed, trainable)
        degrees = model_shard_degrees(n) if decode_degree == "auto" else \
            [int(decode_degree)] if n % int(decode_degree) == 0 else []
        rollout = Side(note="not compiled") if update.note and update.seconds is None else \
            rollout_side(model, params, rollout_devices(n, devices=devices)[1], shape, usable,
                         speed, degrees) \
            if degrees else Side(note=f"--decode_model_shards {decode_degree} does not divide {n}")
        split.candidates.append(Candidate(n, rollout, update))
    fitting = [c for c in split.candidates if c.round_seconds(k) is not None]
    if not fitting:
        log(split.table())
        raise UsageError(
            f"--rollout_devices auto: no split of the {len(devices)} devices fits both a rollout "
            f"and an update in {usable / 2 ** 30:.2f} GiB a device (table above): lower "
            "--engine_rows or --per_device_batch_size, train LoRA adapters (--lora_rank), "
            "give --n_model_shards more devices, or sample on the training devices "
            "(--rollout_devices 0).")
    pick = min(fitting, key=lambda c: (c.round_seconds(k), c.n))
    split.rollout_devices, split.decode_model_shards = pick.n, pick.rollout.degree
    log(split.table())
    return split
