"""Asynchronous GRPO rollouts on devices of their own (``--rollout_devices N``,
``--max_off_policy_steps K``).

**Two meshes, one program.** Of each process's devices the last ``N / P`` (``P`` processes:
N a multiple of P) form the rollout mesh, on which the engine decodes with a decode layout of
its own (``decode_layout.py``); the others train (the trainer's ``Deployer`` is made with
``devices=`` picking them: the rest stay visible to JAX). One process: the first ``D - N``
of the ``D`` devices train, the last ``N`` sample. The rollout mesh holds its own copy of the
params: after each round's update ``publish`` copies them onto the decode shardings, device to
device, no host round trip (one process: ``jax.device_put``; several, where JAX copies only
between the same devices, each leaf is gathered whole onto the training devices and every
rollout device takes its part from its own process's copy), and numbers them with the rounds
of updates they hold, their *version*. ``--rollout_devices auto``
leaves N, and the rollout mesh's decode layout, to the planner (``rollout_split.py``).

**Running ahead.** Round ``t``'s samples are dispatched in round ``t - K``, just before its
update (round 1's, and ``K = 0``'s, as their round starts), on the params published then:
version ``max(0, t - 1 - K)``. So
from round ``K + 1`` on, a round trains on samples ``K`` versions behind the policy it
updates; ``K = 0`` samples each round on the params it starts from, as synchronous GRPO does.
The engine runs on the main thread, its calls in the order dispatched (the greedy
evaluations among them): the rollouts dispatched ahead run once the update is dispatched,
before it is waited for (``Trainer.train_scanned(during=)``), so the rollout programs on the
rollout devices and the update on the training devices run at once, and every process
dispatches the same programs in the same order. (With several processes, programs of two
meshes dispatched from two threads hang in collectives: measured on jax 0.10 over gloo.)

**Off-policy correction** (truncated importance sampling, TIS: Yao et al. 2025, "Your
efficient RL framework secretly brings you off-policy RL training"). The loss's ratio divides
by ``old_logps``, the trainer's own log-probabilities of the sampled tokens under the params
before the update (``rollout.py``, step 4); the tokens were drawn by the rollout policy
instead (older params, other numerics). Each counted token's loss is therefore weighted by
``w = min(exp(old_logp - rollout_logp), is_cap)`` (a constant: no gradient flows through it),
the truncation bounding the variance a stale or mismatched sample can add. Its mean and max
before truncation, and the share truncated, are logged each round (``rollout/is_ratio_*``).
Each sample carries its ``policy_version`` and ``rollout_logps``.

**Dynamic sampling** (DAPO's): a round's extra draws depend on its first draw's rewards, so
they cannot be dispatched ahead; they run on the rollout mesh when the round asks for them, on
the params published last (each sample keeps its own version: the extra draws' are newer than
the round's first draw's, their TIS weights computed alike), and take the prompts after those
already taken for the rounds dispatched ahead.

**Resume.** The in-flight rollouts cannot be regenerated from a step checkpoint: they were
drawn by params older than the checkpointed ones. So ``state_dict`` runs them and keeps
their tokens, log-probabilities, versions and prompt indices in the checkpoint's loop state;
a resumed run consumes them as the uninterrupted one did, bit for bit.

**Timeline.** ``timeline.jsonl`` in the workdir (process 0's) gets, per round, when (seconds
since the rollouts started) its rollout was dispatched, started and finished (and on which
thread), and when
its update was dispatched and returned: where the CPU cannot show the overlap in round times,
the intervals show it (``bench/async_grpo.py``).
"""
from __future__ import annotations

import base64
import dataclasses
import json
import os
import threading
import time
from typing import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from redco import plugins
from redco.protocols import UsageError
from redco_zoo_grpo.engine_rollouts import EngineRollouts


@dataclasses.dataclass(frozen=True)
class AsyncConfig:
    """Rollouts on the last ``rollout_devices`` devices (``"auto"``: as many as
    ``rollout_split.py`` picks), ``max_off_policy_steps`` rounds ahead, their tokens' TIS
    weights truncated at ``is_cap`` (module docstring)."""
    rollout_devices: int | str = 0
    max_off_policy_steps: int = 0
    is_cap: float = 2.0


def is_weights(old_logps: np.ndarray, rollout_logps: np.ndarray, mask: np.ndarray,
               cap: float) -> tuple[np.ndarray, dict]:
    """(M, N) TIS weights ``min(exp(old - rollout), cap)`` (1 where ``mask`` is False) and the
    untruncated ratio's mean, max and truncated share over the counted tokens."""
    ratio = np.exp(np.asarray(old_logps, np.float64) - np.asarray(rollout_logps, np.float64))
    counted = ratio[mask] if mask.any() else np.ones(1)
    metrics = {"is_ratio_mean": counted.mean(), "is_ratio_max": counted.max(),
               "is_truncated": np.mean(counted > cap)}
    return np.where(mask, np.minimum(ratio, cap), 1.0).astype(np.float32), metrics


def rollout_devices(n: int, training: list | None = None,
                    devices: list | None = None) -> tuple[list, list]:
    """``(training devices, rollout devices)`` of ``devices`` (default: all): of each of the P
    processes', the first and the last ``n / P``; refused where no device would be left to
    train on, where the processes cannot give as many each, or where the ``training``
    devices (a trainer's, given) reach into the rollout ones."""
    devices, p = list(devices or jax.devices()), jax.process_count()
    if not 0 < n <= len(devices) - p or n % p:
        raise UsageError(f"--rollout_devices {n}: of the {len(devices)} devices, give "
                         f"{p} to {len(devices) - p}" + (f" (a multiple of the {p} processes: "
                                                         "each gives as many)" if p > 1 else "")
                         + " to the rollouts (the rest train), or 0 to sample on the training "
                         "devices.")
    mine = [[d for d in devices if d.process_index == i] for i in range(p)]
    split = [(ds[:len(ds) - n // p], ds[len(ds) - n // p:]) for ds in mine]
    train, rollout = ([d for part in split for d in part[k]] for k in (0, 1))
    if training is not None and set(training) & set(rollout):
        raise UsageError(f"--rollout_devices {n}: the trainer's Deployer holds rollout devices "
                         f"too; make it with devices=training_devices({n}) "
                         "(pipeline.py does).")
    return train, rollout


def where(devices: list) -> list[tuple[int, int]]:
    """``(process, local index)`` of each of ``devices`` (for the log)."""
    local = {p: [d for d in jax.devices() if d.process_index == p]
             for p in {d.process_index for d in devices}}
    return [(d.process_index, local[d.process_index].index(d)) for d in devices]


def training_devices(n: int) -> Callable[[list], list]:
    """``Deployer(devices=)`` for a trainer beside ``n`` rollout devices (``rollout_devices``)."""
    return lambda devices: rollout_devices(n, devices=devices)[0]


def joins_processes() -> bool:
    """Whether the run will be several processes, not joined yet (a launcher other than the
    one-process fallback detects itself): then no device may be asked for before the
    ``Deployer`` joins them."""
    return jax.distributed.is_initialized() or any(
        launcher.detect({}) for name, launcher in plugins.registry("launchers").items()
        if name != "local")


def put_across(params, shardings):
    """``params`` copied onto ``shardings`` (another mesh's), device to device: with one process
    ``jax.device_put``; with several, each leaf gathered whole onto its own mesh, each of this
    process's target devices taking its part from this process's copy (module docstring)."""
    if jax.process_count() == 1:
        return jax.device_put(params, shardings)

    def leaf(x, sharding):
        whole = jax.device_put(x, NamedSharding(x.sharding.mesh, P()))
        local = whole.addressable_shards[0].data
        parts = [jax.device_put(local[index], device) for device, index in
                 sharding.addressable_devices_indices_map(x.shape).items()]
        return jax.make_array_from_single_device_arrays(x.shape, sharding, parts)
    return jax.tree.map(leaf, params, shardings)


def encode(a: np.ndarray) -> dict:
    return {"dtype": str(a.dtype), "shape": list(a.shape),
            "data": base64.b64encode(np.ascontiguousarray(a).tobytes()).decode()}


def decode(d: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(d["data"]), d["dtype"]).reshape(d["shape"]).copy()


class AsyncRollouts(EngineRollouts):
    """``EngineRollouts`` on ``devices`` (the rollout mesh), on params ``publish`` copies
    there, run ahead ``max_off_policy_steps`` rounds, on the main thread (module docstring)."""

    def __init__(self, *args, devices: list, max_off_policy_steps: int,
                 timeline: str | None = None, **kwargs):
        super().__init__(*args, devices=devices, **kwargs)
        self.trainer.deployer.log_info(f"GRPO rollouts on devices {where(devices)} (process, "
                                       "local index); the trainer on the others")
        self.k, self.timeline_path = max_off_policy_steps, timeline
        self.params, self.version = None, 0
        # round -> indices, version, and the params and prompts to sample, or the arrays
        self.pending: dict[int, dict] = {}
        self.times: dict[int, dict] = {}
        self.start = time.perf_counter()

    def publish(self, params, version: int) -> None:
        """The trainer's params after ``version`` rounds of updates, copied onto the rollout
        mesh (device to device); the copy before is dropped once its rollouts let it go."""
        self.params = put_across(params, self.layout.shardings)
        self.version = version

    def _generate(self, params, prompts: list[dict], round_: int, greedy: bool,
                  times: dict | None = None):
        if times is not None:
            times.update(rollout_start=time.perf_counter() - self.start,
                         rollout_thread=threading.current_thread().name)
        self.engine.params = params
        try:
            return self.generate(prompts, round_, greedy)
        finally:
            self.engine.params = None
            if times is not None:
                times["rollout_ready"] = time.perf_counter() - self.start

    def feed(self, take: Callable[[], list[int]], prompts_of: Callable[[list[int]], list[dict]],
             n_rounds: int) -> None:
        """Where rounds' prompts come from: ``take()`` the next indices, ``prompts_of`` their
        prompts; ``n_rounds`` rounds in all."""
        self.take, self.prompts_of, self.n_rounds = take, prompts_of, n_rounds

    def ahead(self, round_: int, n_more: int = 0) -> list[int]:
        """Dispatch the rollouts of rounds ``round_ .. round_ + n_more`` (at most the last)
        not yet dispatched, each on the next prompts, on the params published last (run by
        ``run_dispatched``); returns round ``round_``'s prompt indices."""
        for r in range(round_, min(round_ + n_more, self.n_rounds) + 1):
            if r not in self.pending:
                indices, self.times[r] = self.take(), dict(
                    rollout_dispatch=time.perf_counter() - self.start)
                self.pending[r] = dict(indices=indices, version=self.version,
                                       params=self.params, prompts=self.prompts_of(indices))
        return self.pending.get(round_, {}).get("indices")

    def run_dispatched(self) -> None:
        """The rollouts dispatched and not yet run, in the order dispatched, on this thread
        (``Trainer.train_scanned(during=)`` calls it while the update runs)."""
        for r in sorted(self.pending):
            p = self.pending[r]
            if "params" in p:
                p["tokens"], p["logps"] = self._generate(p.pop("params"), p.pop("prompts"), r,
                                                         False, self.times.get(r))

    def sample(self, prompts: list[dict], round_: int, greedy: bool):
        """Round ``round_``'s rollouts, dispatched ahead; greedy ones (the evaluations), and
        dynamic sampling's extra draws (a ``round_`` never dispatched: ``rollout.DRAW_STRIDE``),
        now, on the params published last, after the rollouts dispatched before them.
        ``current_version``: the version the rollouts handed out were drawn by."""
        self.run_dispatched()
        if greedy or round_ not in self.pending:
            self.current_version = self.version
            return self._generate(self.params, prompts, round_, greedy)
        p = self.pending.pop(round_)
        self.current_version = p["version"]
        return p["tokens"], p["logps"]

    def correct(self, samples: list[dict], old: np.ndarray, rollout_logps: np.ndarray,
                counted: np.ndarray, round_: int, cap: float, versions: np.ndarray) -> dict:
        """Round ``round_``'s samples get their policy version (``versions``: each one's),
        rollout log-probs and TIS weights; returns the weights' metrics and the oldest
        sample's version and lag (a dynamic sampling's extra draw is newer)."""
        weights, metrics = is_weights(old, rollout_logps, counted, cap)
        for sample, logps, weight, version in zip(samples, rollout_logps, weights, versions):
            sample.update(rollout_logps=logps, is_weight=weight,
                          policy_version=np.int32(version))
        version = int(versions.min())
        return dict(metrics, policy_version=version, policy_lag=round_ - 1 - version)

    def updated(self, round_: int, dispatched: float, params) -> None:
        """After round ``round_``'s update (dispatched at ``dispatched``, perf_counter): its
        params published, its timeline row written."""
        row = dict(self.times.pop(round_, {}), round=round_,
                   update_dispatch=dispatched - self.start,
                   update_ready=time.perf_counter() - self.start)
        self.publish(params, round_)
        if self.timeline_path and self.trainer.deployer.is_main_process:
            with open(self.timeline_path, "a") as f:
                f.write(json.dumps(row) + "\n")

    def state_dict(self) -> dict:
        """The rollouts in flight, run: their prompts, versions and arrays."""
        self.run_dispatched()
        out = {}
        for r, p in self.pending.items():
            out[str(r)] = dict(indices=p["indices"], version=p["version"],
                               tokens=encode(p["tokens"]), logps=encode(p["logps"]))
        return out

    def load_state_dict(self, state: dict) -> None:
        self.pending = {int(r): dict(indices=p["indices"], version=p["version"],
                                     tokens=decode(p["tokens"]), logps=decode(p["logps"]))
                        for r, p in state.items()}


def check_async(config: AsyncConfig, engine_rows: int, environment: str | None,
                decode_model_shards) -> None:
    """Refuse what asynchronous rollouts cannot run with, naming the flag to change."""
    rollout_devices_, k = config.rollout_devices, config.max_off_policy_steps
    if config.is_cap < 1:
        raise UsageError(f"--is_cap {config.is_cap}: the TIS weights are truncated at it; give "
                         "1 or more (default 2).")
    if k < 0:
        raise UsageError(f"--max_off_policy_steps {k}: give 0 (on-policy) or more.")
    if not rollout_devices_:
        if k:
            raise UsageError(f"--max_off_policy_steps {k} runs rollouts ahead on devices of "
                             "their own: give --rollout_devices N too.")
        return
    for bad, why in ((not engine_rows, "--engine_rows 0 (the rollout mesh runs the engine)"),
                     (environment, "--environment (multi-turn rollouts sample on the "
                      "training devices)"),
                     (decode_model_shards is None, "--decode_model_shards train")):
        if bad:
            raise UsageError(f"--rollout_devices {rollout_devices_} does not run with {why}.")


def timeline_path(workdir: str | None) -> str | None:
    return None if workdir is None else os.path.join(workdir, "timeline.jsonl")
