"""The one plugin manager, and the registries built from the ``register_*`` hooks.

Every plugin, built-in or third-party, is found the same way: an entry point in the ``redco``
group. Two environment variables control loading:

* ``REDCO_PLUGINS=name1,name2`` loads only these third-party plugins (redco's own, and
  ``redco-ip`` which it depends on, always load);
* ``REDCO_DISABLE_PLUGIN_AUTOLOAD=1`` loads no third-party plugin at all (useful in tests).

A third-party plugin that fails to import is skipped with a warning naming it.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import os
import threading
import warnings

import pluggy

from redco import hookspecs
from redco.protocols import NotRegistered, missing

hookimpl = pluggy.HookimplMarker("redco")
# Always loaded, whatever REDCO_PLUGINS says: redco itself and the distribution it depends on.
CORE_DISTRIBUTIONS = {"redco", "redco-ip"}

pm = pluggy.PluginManager("redco")
pm.add_hookspecs(hookspecs)
plugin_sources: dict[str, str] = {}  # plugin name -> "distribution version"
refused: dict[tuple[str, str], str] = {}  # (kind, name) -> why the registration was refused
_loading = threading.Lock()  # a checkpoint writer thread looks plugins up too
# Names this repository's plugin distributions provide, to say what to install when one is missing.
PROVIDED_BY = {"tensorboard": "redco-tensorboard", "safetensors": "redco-safetensors",
               "msgpack": "redco-msgpack", "slurm": "redco-slurm", "xmanager": "redco-xmanager",
               "auto": "redco-planner", "plan": "redco-planner", "rules": "redco-planner",
               "wandb": "redco-wandb"}


def _allowed(ep: importlib.metadata.EntryPoint, dist_name: str) -> bool:
    if dist_name in CORE_DISTRIBUTIONS:
        return True
    if os.environ.get("REDCO_DISABLE_PLUGIN_AUTOLOAD"):
        return False
    allow = os.environ.get("REDCO_PLUGINS")
    return allow is None or ep.name in {n.strip() for n in allow.split(",")}


def load_entrypoint_plugins() -> None:
    """Register every allowed plugin of the ``redco`` entry-point group (once each)."""
    with _loading:
        _load_entrypoint_plugins()


def _load_entrypoint_plugins() -> None:
    for ep in importlib.metadata.entry_points(group="redco"):
        dist = ep.dist
        dist_name = dist.metadata["Name"] if dist else "?"
        if pm.has_plugin(ep.name) or pm.is_blocked(ep.name) or not _allowed(ep, dist_name):
            continue
        try:
            plugin = ep.load()
            pm.register(plugin, name=ep.name)
        except Exception as e:  # a broken third-party plugin must not take redco down
            warnings.warn(f"redco plugin {ep.name!r} from {dist_name} failed to load and is "
                          f"skipped: {type(e).__name__}: {e}", stacklevel=2)
            continue
        plugin_sources[ep.name] = f"{dist_name} {dist.version if dist else ''}".strip()


def registry(kind: str) -> dict:
    """Call every plugin's ``register_<kind>``; return ``{name: thing}`` in call order.

    The first registration of a name wins. Built-in plugins implement ``register_*`` hooks with
    ``trylast=True``, so a third-party plugin replaces a built-in by registering the same name.
    A thing that lacks a method of its kind (``redco.protocols``) is refused with a warning
    naming the plugin and what is missing.
    """
    load_entrypoint_plugins()
    found: dict = {}
    caller = getattr(pm.hook, f"register_{kind}")
    for impl in reversed(caller.get_hookimpls()):  # pluggy's call order

        def register(name: str, thing, plugin: str = impl.plugin_name) -> None:
            lacks = missing(kind, thing)
            if lacks:
                refused[(kind, name)] = (f"redco plugin {plugin!r} registers {kind} {name!r} "
                                         f"without {', '.join(lacks)}")
                warnings.warn(f"{refused[(kind, name)]}; it is refused. See redco.protocols "
                              "for what each kind must have.", stacklevel=2)
                return
            found.setdefault(name, thing)
        impl.function(register=register)
    return found


def lookup(hook_name: str, name: str):
    """The thing registered under ``name`` by ``register_<hook_name>``, or a clear error."""
    things = registry(hook_name)
    if name not in things:
        why = refused.get((hook_name, name))
        dist = PROVIDED_BY.get(name)
        install = (f"pip install {dist} (./plugins/{dist[len('redco-'):]} in redco's repository)"
                   if dist else "install the plugin that provides it")
        raise NotRegistered(f"No {hook_name.replace('_', ' ')} named {name!r}"
                         + (f" ({why})" if why else "") + f". Available: {sorted(things)}. "
                         f"To use it, {install}; or pick one of these.")
    return things[name]


def list_plugins() -> list[dict]:
    """Name, source distribution and implemented hooks of every loaded plugin."""
    load_entrypoint_plugins()
    rows = []
    for name, plugin in pm.list_name_plugin():
        hooks = sorted(h.name for h in pm.get_hookcallers(plugin) or [])
        rows.append({"name": name, "source": plugin_sources.get(name, "registered at run time"),
                     "hooks": hooks})
    return rows


class DeferredCommand:
    """A ``Command`` (``redco.protocols``) registered by where it lives, imported the first time
    it is asked for its flags or run: ``DeferredCommand("redco_zoo_lm.pipeline:LMPipeline",
    "causal LM: ...")``. The zoo packages register their pipelines so: every process that loads
    plugins (each ``redco`` call, each ``Deployer``) then skips importing the pipelines, and their
    models, that it does not run (~0.2 CPU s a process with the zoo installed)."""

    def __init__(self, target: str, description: str):
        self.target, self.description = target, description
        self._command = None

    def load(self):
        """The command itself: ``target``'s class (``module:Class``), imported and made once."""
        if self._command is None:
            module, _, name = self.target.partition(":")
            self._command = getattr(importlib.import_module(module), name)()
        return self._command

    def add_arguments(self, parser) -> None:
        self.load().add_arguments(parser)

    def run(self, args):
        return self.load().run(args)


def zoo_hooks(name: str, target: str, description: str, package_dir: str):
    """A zoo package's ``register_zoo_pipelines`` and ``register_templates`` hooks: its pipeline
    ``target`` (``module:Class``, a ``DeferredCommand``) and the ``template`` folder beside it, both
    registered as ``name``."""

    @hookimpl
    def register_zoo_pipelines(register):
        register(name, DeferredCommand(target, description))

    @hookimpl
    def register_templates(register):
        register(name, os.path.join(package_dir, "template"))
    return register_zoo_pipelines, register_templates


def deferred_exports(package: str, modules: dict[str, list[str]]):
    """``(__all__, __getattr__)`` for a package whose names live in its submodules,
    ``{"pipeline": ["collate_fn", ...]}``: each submodule is imported when one of its names is
    first used (PEP 562), so that importing the package's plugin module stays cheap."""
    where = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{package}.{where[name]}"), name)
    return sorted(where), __getattr__
