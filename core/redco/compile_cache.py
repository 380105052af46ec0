"""The persistent compile cache: XLA's compiled programs kept on disk, so that a run started again
(resumed after a kill, requeued by SLURM, or simply rerun) loads its train step instead of
compiling it again.

By default the cache is ``<workdir>/compile_cache``, which every process of a run shares when the
workdir is on a shared filesystem (JAX writes entries from process 0 and reads them everywhere).
``Deployer(compile_cache_dir=...)`` or ``REDCO_COMPILE_CACHE`` moves it; ``off`` (or
``compile_cache_dir=False``) turns it off. JAX keeps one cache per process: a later ``Deployer``
with another directory switches it. Whether a compile came from the cache is read from JAX's own
monitoring events.
"""
from __future__ import annotations

import os

import jax
from jax import monitoring
from jax.experimental.compilation_cache import compilation_cache

ENV = "REDCO_COMPILE_CACHE"
OFF = ("off", "0", "false", "")
_events = {"hits": 0, "misses": 0}


def _count(event: str, **_) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _events["hits"] += 1
    elif event == "/jax/compilation_cache/cache_misses":
        _events["misses"] += 1


monitoring.register_event_listener(_count)


def resolve(setting: str | bool | None, workdir: str | None) -> str | None:
    """The cache directory for ``Deployer(compile_cache_dir=setting)``, or None for no cache:
    ``setting`` if a path, else ``$REDCO_COMPILE_CACHE``, else ``<workdir>/compile_cache``."""
    if setting is False:
        return None
    if setting is None:
        setting = os.environ.get(ENV)
    if setting is None:
        return os.path.join(workdir, "compile_cache") if workdir is not None else None
    if not isinstance(setting, str):
        raise TypeError(f"compile_cache_dir={setting!r}: give a directory, False, or None (the "
                        "default: $REDCO_COMPILE_CACHE, else <workdir>/compile_cache)")
    return None if setting.strip().lower() in OFF else os.path.abspath(setting)


def use(path: str | None) -> None:
    """Make ``path`` this process's compile cache (None: none); every program is cached, however
    small or quick to compile."""
    if jax.config.jax_compilation_cache_dir == path:
        return
    compilation_cache.reset_cache()
    jax.config.update("jax_compilation_cache_dir", path)
    if path is not None:
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def counts() -> tuple[int, int]:
    """``(hits, misses)`` of the compile cache so far in this process."""
    return _events["hits"], _events["misses"]
