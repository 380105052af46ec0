"""Every private JAX and optax API redco uses (``redco/_private.py``) still exists with the
signature and behaviour relied on, each wrapper run for real; and what the hang watchdog does
when the coordination service behind its heartbeats fails. An upgrade that changes one of these
fails here, by name."""
import inspect
import json
import os
import socket
import subprocess
import sys
import threading
import warnings

import jax
import optax
import pytest
from jax._src import config as jax_config

from redco import _private, watchdog
from redco.train_step import unwrap_multisteps

# Run in a fresh process: jax.distributed can be initialized only once per process.
DISTRIBUTED = """
import json, sys
import jax
from redco import _private
out = {"before": [_private.coordination_client() is None, _private.preemption_service_on()]}
jax.distributed.initialize(f"127.0.0.1:{sys.argv[1]}", num_processes=1, process_id=0)
client = _private.coordination_client()
out["type"] = type(client).__module__ + "." + type(client).__name__
out["docs"] = {name: getattr(type(client), name).__doc__.splitlines()[0]
               for name in ("key_value_set", "key_value_dir_get", "get_live_nodes",
                            "wait_at_barrier")}
_private.wait_at_barrier(client, "test/barrier", 10_000)  # (the only process: passes at once)
_private.key_value_set(client, "test/0", "a")
_private.key_value_set(client, "test/0", "b")  # overwritten, not refused
_private.key_value_set(client, "test/1", "c")
out["dir"] = sorted(_private.key_value_dir_get(client, "test/"))
try:  # a refusal of the store is a JaxRuntimeError: the one error the watchdog survives
    client.key_value_set("test/0", "d")
except jax.errors.JaxRuntimeError as error:
    out["refused"] = str(error)
out["live"] = _private.live_processes(client, 1)
out["preemption"] = _private.preemption_service_on()
print(json.dumps(out))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_coordination_client_its_key_value_store_and_live_processes():
    done = subprocess.run([sys.executable, "-c", DISTRIBUTED, str(free_port())],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["before"] == [True, False]  # None, and no preemption service, before initialize
    assert out["type"] == "jaxlib._jax.DistributedRuntimeClient"
    assert out["docs"] == {
        "key_value_set": "key_value_set(self, key: str, value: str, allow_overwrite: bool = "
                         "False) -> None",
        "key_value_dir_get": "key_value_dir_get(self, key: str) -> list[tuple[str, str]]",
        "get_live_nodes": "get_live_nodes(self, process_ids: collections.abc.Sequence[int]) -> "
                          "dict[int, int]",
        "wait_at_barrier": "wait_at_barrier(self, barrier_id: str, timeout_in_ms: int, "
                           "process_ids: collections.abc.Sequence[int] | None = None) -> None"}
    assert out["dir"] == [["test/0", "b"], ["test/1", "c"]]
    assert "ALREADY_EXISTS" in out["refused"]
    assert out["live"] == [0] and out["preemption"] is True


def test_enum_config_state_is_a_jit_key_and_a_with_block():
    params = inspect.signature(jax_config.enum_state).parameters
    assert list(params)[:4] == ["name", "enum_values", "default", "help"]
    assert {"include_in_jit_key", "include_in_trace_context"} <= set(params)
    state = _private.enum_config_state("redco_test_private_enum", ["a", "b"], "a", "test")
    traced = []

    @jax.jit
    def f(x):
        traced.append(state.value)
        return x + 1
    f(1)
    with state("b"):
        assert state.value == "b"
        f(1)
    f(1)  # "a" again: cached, not traced again
    assert state.value == "a" and traced == ["a", "b"]
    with pytest.raises(ValueError):
        state("c").__enter__()


def test_multisteps_every_k_reads_optax_private_schedule():
    assert callable(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=4)._every_k_schedule)
    assert _private.multisteps_every_k(optax.MultiSteps(optax.sgd(0.1), every_k_schedule=4)) == 4
    assert _private.multisteps_every_k(optax.MultiSteps(optax.sgd(0.1), lambda step: 3)) == 3
    inner = optax.sgd(0.1)
    assert unwrap_multisteps(optax.MultiSteps(inner, every_k_schedule=2), 2) is inner
    with pytest.raises(ValueError, match=r"MultiSteps\(every_k_schedule=2\) disagrees"):
        unwrap_multisteps(optax.MultiSteps(inner, every_k_schedule=2), 4)


def test_slurm_coordinator_address_is_jaxs(monkeypatch):
    from jax._src.clusters import SlurmCluster
    params = inspect.signature(SlurmCluster.get_coordinator_address).parameters
    assert {"timeout_secs", "override_coordinator_port"} <= set(params)
    monkeypatch.delenv("JAX_COORDINATOR_PORT", raising=False)
    monkeypatch.delenv("SLURM_STEP_NODELIST", raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "4100")
    assert _private.slurm_coordinator_address() is None  # not in a job step
    monkeypatch.setenv("SLURM_STEP_NODELIST", "gpu[007-009,012],cpu1")
    assert _private.slurm_coordinator_address() == f"gpu007:{4100 % 4096 + 61440}"
    monkeypatch.setenv("JAX_COORDINATOR_PORT", "1234")
    assert _private.slurm_coordinator_address() == "gpu007:1234"


class Store:
    """A coordination client whose key-value store refuses writes, or reads."""

    def __init__(self, records: dict, refuse: str):
        self.records, self.refuse, self.writes = records, refuse, 0
        self.wrote = threading.Condition()

    def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
        with self.wrote:
            self.writes += 1
            self.wrote.notify_all()
        if self.refuse == "writes":
            raise jax.errors.JaxRuntimeError("UNAVAILABLE: the coordination service is gone")

    def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
        if self.refuse == "reads":
            raise jax.errors.JaxRuntimeError("INTERNAL: the store is in an error state")
        return [(f"{prefix}{i}", json.dumps(r)) for i, r in self.records.items()]

    def wait_for_writes(self, n: int) -> None:
        with self.wrote:
            assert self.wrote.wait_for(lambda: self.writes >= n, 60), f"{n} heartbeats not tried"


def test_a_heartbeat_that_cannot_be_published_is_said_once_and_blames_nobody():
    """Process 0 (this one) cannot publish; the stale record the store holds would blame it."""
    store = Store({0: {"time": 0.0, "step": 1, "paused": False}}, refuse="writes")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # each warning recorded, repeats too
        dog = watchdog.Watchdog(1000.0, client=store)
        try:
            store.wait_for_writes(1)
            for n in (2, 3):
                dog.progress(n)  # publishes at once
                store.wait_for_writes(n + 1)  # the n-th failure was handled
            stuck = dog._stuck()
        finally:
            dog.stop()
    said = [str(w.message) for w in caught if "heartbeat" in str(w.message)]
    assert len(said) == 1, said
    assert said[0].startswith("Process 0 could not publish its hang-watchdog heartbeat in JAX's "
                              "key-value store (JaxRuntimeError: UNAVAILABLE: the coordination "
                              "service is gone)")
    assert stuck == ("unknown: this process could not publish its heartbeat in JAX's key-value "
                     "store (JaxRuntimeError: UNAVAILABLE: the coordination service is gone), so "
                     "it cannot tell which process is hung")


def test_heartbeats_that_cannot_be_read_blame_nobody():
    store = Store({}, refuse="reads")
    dog = watchdog.Watchdog(1000.0, client=store)
    dog.stop()
    assert dog._stuck() == ("unknown: this process could not read the heartbeats from JAX's "
                            "key-value store (JaxRuntimeError: INTERNAL: the store is in an error "
                            "state), so it cannot tell which process is hung")


def test_no_private_jax_or_optax_name_outside_the_private_module():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    found = subprocess.run(["git", "grep", "-n", "-e", "jax._src", "-e", "._every_k_schedule",
                            "--", "core/redco", "plugins/*/redco_*"],
                           cwd=root, capture_output=True, text=True).stdout
    assert [line for line in found.splitlines()
            if not line.startswith("core/redco/_private.py:")] == []
