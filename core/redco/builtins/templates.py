"""Built-in project templates for ``redco new``: ``minimal`` (the three functions on a tiny
model) and ``plugin`` (a package that registers a sharding rule set through entry points)."""
from __future__ import annotations

import os

from redco.plugins import hookimpl

HERE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "project_templates")


@hookimpl(trylast=True)
def register_templates(register):
    for name in ("minimal", "plugin"):
        register(name, os.path.join(HERE, name))
