"""Where a CI run's CPU goes, per Python process and per compile phase: with
``$PROCESS_PROFILE_OUT`` set, every Python process of a test run (pytest, the CLI runs and
workers tests start, pip; ``sitecustomize.py`` beside this file imports it) appends one JSON line
at exit: its argv, its own CPU and wall seconds, and, where it imported jax, the seconds jax
reported tracing, lowering to MLIR and compiling (``jax.monitoring``'s duration events, in total
and per function name). A process killed by a signal writes nothing. A whole run, summarised::

    PROCESS_PROFILE_OUT=/tmp/procs.jsonl tox p
    python tools/cpu_profile.py --processes /tmp/procs.jsonl
"""
import atexit
import collections
import importlib.abc
import importlib.machinery
import json
import os
import resource
import sys
import time

_started = time.time()
_events: dict = collections.defaultdict(float)
_counts: collections.Counter = collections.Counter()
_by_function: dict = collections.defaultdict(float)

def _on_duration(event: str, seconds: float, fun_name: str = "", **_) -> None:
    _events[event.rsplit("/", 1)[-1]] += seconds
    _counts[event.rsplit("/", 1)[-1]] += 1
    if "/jax/core/compile/" in event:
        _by_function[fun_name] += seconds

class _ListenOnceJaxLoads(importlib.abc.MetaPathFinder):
    """Registers the listener as ``jax.monitoring`` is first imported (importing jax here
    would slow every Python process, jax-free ones too)."""

    def find_spec(self, name, path, target=None):
        if name != "jax.monitoring":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None:
            load = spec.loader.exec_module

            def exec_module(module):
                load(module)
                module.register_event_duration_secs_listener(_on_duration)
            spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, _ListenOnceJaxLoads())

@atexit.register
def _write() -> None:
    own = resource.getrusage(resource.RUSAGE_SELF)
    top = sorted(_by_function.items(), key=lambda kv: -kv[1])[:40]
    row = {"env": os.environ.get("TOX_ENV_NAME", ""), "argv": sys.argv[:6],
           "cpu": round(own.ru_utime + own.ru_stime, 3),
           "wall": round(time.time() - _started, 3),
           "events": {k: [round(v, 3), _counts[k]] for k, v in _events.items()},
           "functions": {k: round(v, 3) for k, v in top}}
    with open(os.environ["PROCESS_PROFILE_OUT"], "a") as f:
        f.write(json.dumps(row) + "\n")
