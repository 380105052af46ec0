"""One Trainer's hooks: its own observers first, then the process-wide plugins.

Each ``Trainer`` has a ``RunHooks``: a pluggy manager of its own holding one instance of every
observer class registered through ``register_observers`` (built-in and third-party alike) and
its ``callbacks``. ``hooks.on_step_end(trainer=..., ...)`` calls that manager's implementations,
then those of the process-wide plugin manager (``redco.plugins.pm``), so two Trainers in one
process (FedAvg's clients) never see each other's observers, while a plugin registered for
the whole process sees every Trainer. Results of both are returned as one list.

``state_to_save`` is gathered here into one dict, refusing two plugins that claim one key.
"""
from __future__ import annotations

import contextlib
import json
from typing import Any, Callable, Iterator, Sequence

import pluggy

from redco import hookspecs, plugins
from redco.plugins import pm


class RunHooks:
    def __init__(self, trainer: Any, callbacks: Sequence[Any] = ()):
        self._local = pluggy.PluginManager("redco")
        self._local.add_hookspecs(hookspecs)
        for callback in callbacks:  # registered first: the observers' hooks run before theirs
            self._local.register(callback)
        self.observers = {name: make(trainer) for name, make in plugins.registry("observers").items()}
        for name, observer in self.observers.items():
            self._local.register(observer, name=f"observer:{name}")

    def __getattr__(self, name: str) -> Callable[..., list]:
        if not name.startswith(("on_", "collect_", "state_")):
            raise AttributeError(name)

        def call(**kwargs) -> list:
            return [*getattr(self._local.hook, name)(**kwargs), *getattr(pm.hook, name)(**kwargs)]
        return call

    @contextlib.contextmanager
    def registered(self, callback: Any) -> Iterator[None]:
        """``callback``'s hooks called meanwhile (after the others')."""
        self._local.register(callback)
        try:
            yield
        finally:
            self._local.unregister(callback)

    def saved_state(self, trainer: Any, step: int) -> dict:
        """Every plugin's ``state_to_save``, merged; an error naming two plugins that return
        the same key, or a value JSON cannot hold."""
        merged, owner, args = {}, {}, {"trainer": trainer, "step": step}
        for manager in (self._local, pm):
            for impl in manager.hook.state_to_save.get_hookimpls():
                state = impl.function(*(args[name] for name in impl.argnames)) or {}
                for key, value in state.items():
                    if key in owner:
                        raise ValueError(
                            f"Plugins {owner[key]!r} and {impl.plugin_name!r} both save state "
                            f"under {key!r} in step checkpoints; one would overwrite the other. "
                            "Rename the key in one of them.")
                    try:
                        json.dumps(value)
                    except TypeError as e:
                        raise TypeError(
                            f"Plugin {impl.plugin_name!r} saves {key!r} = {value!r} in step "
                            f"checkpoints, which JSON cannot hold ({e}). Return numbers, "
                            "strings, lists and dicts from state_to_save.") from e
                    merged[key], owner[key] = value, impl.plugin_name
        return merged
