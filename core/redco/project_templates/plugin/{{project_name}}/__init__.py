"""{{project_name}}: a Redco plugin registering the sharding rule set ``{{project_name}}``.

Once installed (``pip install -e .``) it shows in ``redco list plugins`` and
``Deployer(sharding_rules="{{project_name}}")`` uses it. The same module could implement any
other hook of ``redco.hookspecs``: ``register_launchers``, ``register_checkpoint_formats``,
``register_loggers``, ``register_zoo_pipelines``, ``register_templates`` or the ``on_*``
callbacks.
"""
import re

from jax.sharding import PartitionSpec as P

import redco
from redco.sharding import named_leaves


def larger_dim_rules(params, mesh, trace_fn=None):
    """Each 2-D parameter split over ``mp`` on its larger dimension, when that divides; the
    rest replicated. ``params`` holds ``jax.ShapeDtypeStruct`` leaves."""
    rules = []
    for path, leaf in named_leaves(params):
        if len(leaf.shape) == 2:
            dim = int(leaf.shape[1] >= leaf.shape[0])
            if leaf.shape[dim] % mesh.shape["mp"] == 0:
                rules.append((f"^{re.escape(path)}$", P(None, "mp") if dim else P("mp", None)))
    return rules


@redco.hookimpl
def register_sharding_rules(register):
    register("{{project_name}}", larger_dim_rules)
