"""Built-in sharding rule sets: ``auto`` (the paper's two rules) and ``replicate``."""
from __future__ import annotations

import re

from jax.sharding import PartitionSpec as P

from redco.plugins import hookimpl
from redco.sharding import Rules, named_leaves

QKV = re.compile(r"(^|/)(q|k|v|query|key|value|[qkv]_proj|qkv|wq|wk|wv)/(kernel|weight)$")
ATTN_OUT = re.compile(r"(^|/)(o|out|o_proj|out_proj|wo)/(kernel|weight)$")
FFN_IN = re.compile(r"(^|/)(gate|up|gate_proj|up_proj|w1|w3|wi|wi_0|wi_1|fc1|fc_in|c_fc|"
                    r"dense_h_to_4h)/(kernel|weight)$")
FFN_OUT = re.compile(r"(^|/)(down|down_proj|w2|fc2|fc_out|dense_4h_to_h)/(kernel|weight)$")
EMBEDDING = re.compile(r"(embed|embedding|wte|tok_embeddings)")
COLUMN, ROW = P(None, "mp"), P("mp", None)


def natural_key(path: str):
    """Sort ``Dense_2`` before ``Dense_10``: compare digit runs as numbers."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path)]


def auto_rules(params, n_model_shards: int) -> Rules:
    """The paper's two rules, one explicit rule per sharded parameter.

    1. Fully connected kernels alternate column split (output dim) and row split (input dim).
       Known feed-forward names (``gate_proj``/``up_proj`` then ``down_proj``, ``fc1`` then
       ``fc2``, ...) get their place in the pair directly; other kernels alternate in natural
       path order (``Dense_2`` before ``Dense_10``), restarting in every parent module.
    2. Attention Q, K, V split on the heads (output) side; the output projection on its input.
    Embedding tables split on the vocabulary; biases, norms and scalars are replicated.
    """
    if n_model_shards == 1:
        return []
    rules, n_dense = [], {}
    for path, leaf in sorted(named_leaves(params), key=lambda kv: natural_key(kv[0])):
        if len(leaf.shape) != 2:
            continue
        if QKV.search(path) or FFN_IN.search(path):
            spec = COLUMN
        elif ATTN_OUT.search(path) or FFN_OUT.search(path) or EMBEDDING.search(path):
            spec = ROW
        else:
            parent = path.rsplit("/", 2)[0] if path.count("/") >= 2 else ""
            spec = COLUMN if n_dense.get(parent, 0) % 2 == 0 else ROW
            n_dense[parent] = n_dense.get(parent, 0) + 1
        rules.append((f"^{re.escape(path)}$", spec))
    return rules


@hookimpl(trylast=True)
def register_sharding_rules(register):
    register("auto", auto_rules)
    register("replicate", lambda params, n_model_shards: [])
