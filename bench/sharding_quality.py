"""Sharding quality: redco's ``auto`` rules vs a hand-written Megatron-LM plan vs Redco 0.4.23.

On 8 simulated CPU devices, for each layout dp x mp in (4x2, 2x4, 1x8), this compiles the
whole train step of HuggingFace Flax models (``tests/sharding_hf/hf_archs.py``, transformers
4.57.6, random weights) under each rule source and measures:

(a) memory: per-device bytes of the params plus the AdamW state (``mu``, ``nu``, ``count``) under
    the plan, from each leaf's shard shape, against the ideal ``total / 8`` (every byte on
    exactly one device) and against ``total / mp`` (the best a plan over ``mp`` alone can do:
    these rule sets split over ``mp`` and replicate over ``dp``);
(b) collectives: the step (``jax.value_and_grad`` of the model's loss, ``optax.adamw`` update,
    params and optimizer state donated, explicit in/out shardings for params and optimizer
    state, the batch split over ``'dp'``) is compiled with
    ``jax.jit(...).lower(...).compile()`` and its optimized HLO (``compiled.as_text()``) is
    parsed. Every instruction whose opcode is ``all-reduce``, ``all-gather``, ``reduce-scatter``,
    ``all-to-all`` or ``collective-permute`` (or its ``-start`` async form) counts once; its
    bytes are the bytes of its **result buffer(s) on one device** (every element of a tuple
    result; for an async pair, the result of the ``-done``, so nothing is counted twice). That
    is "coll MiB": result bytes per device, summed over the ops of one step. "ring MiB" is a
    second estimate of the bytes each device *sends* with ring algorithms over the op's group
    of g devices: all-reduce 2(g-1)/g x S, all-gather and all-to-all (g-1)/g x S, reduce-scatter
    (g-1) x S (S = result bytes), collective-permute S. Counts are HLO instructions (XLA
    combines many gradient all-reduces into one tuple all-reduce: that counts once);
(c) correctness: ``--steps`` real steps run sharded and on a 1-device mesh from the same
    params and batches; the largest ``|loss difference|`` over the steps is reported (aim:
    below 1e-5).

Rule sources (table 1: GPT-2, LLaMA, T5 at moderate sizes where every split dim divides 8):

  auto          redco's ``auto`` rule set given a ``trace_fn`` (the loss on one dp shard's
                batch of zeros, only traced), i.e. the rules derived from the model's dataflow;
  megatron      hand-written below (``MEGATRON``): column-parallel Q/K/V (GPT-2's fused
                ``c_attn``) and FFN-in with their biases, row-parallel attention-out and FFN-out,
                vocab-parallel token embedding and LM head, everything else replicated;
  redco-0.4.23  the original Redco's ``Deployer.get_sharding_rules`` run in its own venv
                (``--old_python``) on a params tree of the same paths and shapes; its rules
                (tuples of per-key regexes matched against any window of the key path) are
                converted to ``(regex, PartitionSpec)`` rules over ``/``-joined paths and applied
                here with ``redco.sharding.specs_from_rules``; the converted specs are checked
                against the specs 0.4.23's own ``get_params_spec`` assigns;
  auto+fsdp     redco's ``auto`` over ``mp`` plus ZeRO-3 over ``dp`` (for the memory column:
                the only source here that can approach ``total / 8`` when dp > 1).

Every layout trains the same global batch (``--global_batch`` rows, split over ``dp``), so
the reference losses come from one 1-device run per model and layouts compare like for like.

Table 2 runs ``auto`` on every architecture in ``hf_archs.ARCHS`` (tiny configs, hidden 64,
``--archs_heads`` attention and KV heads, 8 by default so that mp=8 splits whole heads).

Table 3 (``--paper_call``; GPT-2, BERT, ViT, GPT-Neo by default, the tiny configs of table 2)
checks the paper's Appendix A call, ``params_sharding_rules=deployer.get_sharding_rules(
params=params)`` with no ``trace_fn``, end to end: a real ``redco.Deployer(n_model_shards=mp)``
and ``redco.Trainer`` decide the layout at their first batch (``trainer.eval_loss``), and the
trainer's final ``params_sharding_rules`` (checked to be what it placed its state by) are
compiled into the same step as every other source. Side by side, per arch and layout:

  paper-call    those final rules;
  auto          the ``auto`` rule set given an explicit ``trace_fn`` (as in table 1);
  names         the same call's rules forced to a plain list (``list(rules)``: from parameter
                names only, what the call gave before the Trainer decided the layout);
  megatron      the hand-written plan, where there is one (GPT-2).

Run (``tox -e bench-sharding`` builds the 0.4.23 venv):
  python bench/sharding_quality.py --old_python /path/to/redco0423-venv/bin/python
Table 3 alone (no 0.4.23 venv needed):
  python bench/sharding_quality.py --families "" --archs none --layouts 4x2,2x4 --paper_call
"""
from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from collections import Counter  # noqa: E402

RESULT = "BENCH_RESULT "
HERE = os.path.dirname(os.path.abspath(__file__))
N_DEVICES = 8

# ---- models: moderate configs where every split dim divides 8 -------------------------------
FAMILIES = {
    "gpt2": dict(n_embd=256, n_head=8, n_layer=2, n_inner=1024, vocab_size=512,
                 n_positions=64),
    # 16 query heads over 8 KV heads (grouped-query attention), head_dim 16
    "llama": dict(hidden_size=256, num_attention_heads=16, num_key_value_heads=8,
                  num_hidden_layers=2, intermediate_size=512, vocab_size=512,
                  max_position_embeddings=64),
    "t5": dict(d_model=256, d_kv=32, num_heads=8, d_ff=512, num_layers=2, vocab_size=512,
               relative_attention_num_buckets=32),
}

# table 2: hf_archs' tiny configs (hidden 64), with this many attention heads (and KV heads),
# so that every layout up to mp=8 can split whole heads (hf_archs' default is 4 heads)
HEAD_FIELDS = {
    "gpt2": ("n_head",), "gptj": ("n_head",), "gpt_neo": ("num_heads",), "t5": ("num_heads",),
    "llama": ("num_attention_heads", "num_key_value_heads"),
    "mistral": ("num_attention_heads", "num_key_value_heads"),
    "bart": ("encoder_attention_heads", "decoder_attention_heads"),
    "mbart": ("encoder_attention_heads", "decoder_attention_heads"),
}


def head_overrides(arch: str, heads: int) -> dict:
    return {} if not heads else {f: heads for f in HEAD_FIELDS.get(arch,
                                                                  ("num_attention_heads",))}


# ---- the hand-written Megatron-LM plan ------------------------------------------------------
# HF Flax GPT-2 uses Conv1D: kernels are stored (out, in) and transposed for the matmul, so
# column-parallel (split the output features) is P('mp', None) and row-parallel is
# P(None, 'mp'), the opposite of an nn.Dense kernel (in, out). The fused c_attn (out = 3H,
# laid out [Q | K | V]) can only be split contiguously on its output dim: Megatron's own
# checkpoints interleave Q, K, V per head so each rank gets whole heads, HF's layout does not,
# so the split Q/K/V outputs straddle shards (XLA reshuffles them; both plans pay the same).
MP = "mp"
COL_CONV, ROW_CONV = (MP, None), (None, MP)  # Conv1D kernels (out, in)
COL, ROW = (None, MP), (MP, None)  # Dense kernels (in, out)
VOCAB = (MP, None)  # embedding tables (vocab, hidden)
MEGATRON = {
    "gpt2": [
        (r"/attn/c_attn/kernel$", COL_CONV), (r"/attn/c_attn/bias$", (MP,)),
        (r"/attn/c_proj/kernel$", ROW_CONV),
        (r"/mlp/c_fc/kernel$", COL_CONV), (r"/mlp/c_fc/bias$", (MP,)),
        (r"/mlp/c_proj/kernel$", ROW_CONV),
        (r"(^|/)wte/embedding$", VOCAB),  # tied LM head: logits = h @ wte.T, vocab-parallel
    ],
    "llama": [
        (r"/self_attn/(q_proj|k_proj|v_proj)/kernel$", COL),
        (r"/self_attn/o_proj/kernel$", ROW),
        (r"/mlp/(gate_proj|up_proj)/kernel$", COL),
        (r"/mlp/down_proj/kernel$", ROW),
        (r"(^|/)embed_tokens/embedding$", VOCAB),
        (r"(^|/)lm_head/kernel$", COL),  # (hidden, vocab): vocab-parallel
    ],
    "t5": [
        (r"/(SelfAttention|EncDecAttention)/(q|k|v)/kernel$", COL),
        (r"/(SelfAttention|EncDecAttention)/o/kernel$", ROW),
        (r"/DenseReluDense/(wi|wi_0|wi_1)/kernel$", COL),
        (r"/DenseReluDense/wo/kernel$", ROW),
        (r"(^|/)shared/embedding$", VOCAB),  # tied LM head
        (r"(^|/)lm_head/kernel$", COL),  # only when untied
    ],
}

# ---- parsing collectives out of compiled HLO text -------------------------------------------
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.+?)\s+"
    r"(?P<op>all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)"
    r"(?P<suffix>-start|-done)?\((?P<args>[^)]*)\)(?P<rest>.*)$")
SHAPE = re.compile(r"\b(?P<dtype>pred|token|[sufc]\d+|bf16|f8e\w+)\[(?P<dims>[\d,]*)\]")
DTYPE_BITS = {"pred": 8, "token": 0, "bf16": 16}


def shape_bytes(type_text: str) -> int:
    """Bytes of every array in an HLO result type (a shape or a tuple of shapes)."""
    total = 0
    for m in SHAPE.finditer(type_text):
        dtype = m["dtype"]
        bits = DTYPE_BITS.get(dtype) or (8 if dtype.startswith("f8") else int(dtype[1:]))
        total += math.prod(int(d) for d in m["dims"].split(",") if d) * bits // 8
    return total


def group_size(rest: str, n_devices: int) -> int:
    """Devices per replica group, from any of XLA's three spellings of ``replica_groups``."""
    if m := re.search(r"replica_groups=\[(\d+),(\d+)\]<=", rest):  # iota: [groups, size]
        return int(m[2])
    if m := re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", rest):
        sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", m[1])}
        return math.prod(sizes[a] for a in re.findall(r"'([^']+)'", m[2]))
    if m := re.search(r"replica_groups=\{\{([\d,]*)\}", rest):
        return len(m[1].split(","))
    return n_devices  # replica_groups={} : every device


def ring_bytes(op: str, size: int, g: int) -> float:
    if g <= 1:
        return 0.0
    return {"all-reduce": 2 * (g - 1) / g * size, "all-gather": (g - 1) / g * size,
            "all-to-all": (g - 1) / g * size, "reduce-scatter": (g - 1) * size,
            "collective-permute": size}[op]


def where(rest: str) -> str:
    """The op's source location (``op_name`` metadata), layer numbers folded to ``N``."""
    m = re.search(r'op_name="([^"]*)"', rest)
    name = m[1] if m else "?"
    return re.sub(r"/\d+/", "/N/", name.replace("jit(step)/", ""))[:110]


def parse_collectives(hlo: str, n_devices: int) -> dict:
    """``{'count': {op: n}, 'bytes': {op: result bytes}, 'ring': {op: bytes}, 'by_site':
    {(op, where): bytes}}`` over every collective instruction of ``hlo``."""
    count, nbytes, ring = Counter(), Counter(), Counter()
    by_site: Counter = Counter()
    starts, done_bytes = {}, {}
    for line in hlo.splitlines():
        m = INSTRUCTION.match(line)
        if not m:
            continue
        op, suffix = m["op"], m["suffix"]
        if suffix == "-done":  # the result of an async pair: its bytes, not a second count
            done_bytes[m["args"].strip().lstrip("%")] = shape_bytes(m["type"])
            continue
        size = shape_bytes(m["type"])
        if suffix == "-start":
            starts[m["name"]] = (op, m["rest"])
        count[op] += 1
        if suffix is None:
            g = group_size(m["rest"], n_devices)
            nbytes[op] += size
            ring[op] += ring_bytes(op, size, g)
            by_site[op, where(m["rest"])] += size
    for name, (op, rest) in starts.items():
        size = done_bytes.get(name, 0)
        nbytes[op] += size
        ring[op] += ring_bytes(op, size, group_size(rest, n_devices))
        by_site[op, where(rest)] += size
    return {"count": dict(count), "bytes": dict(nbytes), "ring": dict(ring),
            "by_site": {f"{op} @ {w}": b for (op, w), b in by_site.items()}}


# ---- the old side: Redco 0.4.23's rules, in its own interpreter -----------------------------
def old_side_worker() -> None:
    """stdin: ``{"jobs": [{"key", "mp", "shapes": {path: shape}}]}``; stdout: one RESULT line
    with each job's rules and the per-path specs 0.4.23 assigns with them."""
    import jax
    from flax.traverse_util import flatten_dict, unflatten_dict

    import redco
    jobs, out = json.load(sys.stdin)["jobs"], []

    def entry(e):
        return list(e) if isinstance(e, tuple) else e

    for job in jobs:
        tree = unflatten_dict({tuple(p.split("/")): jax.ShapeDtypeStruct(tuple(s), "float32")
                               for p, s in job["shapes"].items()})
        deployer = redco.Deployer(jax_seed=0, n_model_shards=job["mp"], verbose=False)
        rules = deployer.get_sharding_rules(params_shape_or_params=tree)
        specs = flatten_dict(deployer.get_params_spec(tree, rules))
        out.append({"key": job["key"], "mp": job["mp"],
                    "rules": [[list(keys), [entry(e) for e in spec]] for keys, spec in rules],
                    "specs": {"/".join(k): [entry(e) for e in v] for k, v in specs.items()}})
    print(RESULT + json.dumps({"redco": redco.__version__, "jobs": out}), flush=True)


def old_rule_regex(keys: list[str]) -> str:
    """0.4.23 matches ``keys`` (each a regex that must match one whole path key) against any
    window of consecutive keys of the path; the same over ``/``-joined paths."""
    return "(?:^|/)" + "/".join(f"(?:{k})" for k in keys) + "(?:/|$)"


def fetch_old_rules(python: str, jobs: list[dict]) -> tuple[dict, str | None, str]:
    """``{(key, mp): (rules, specs)}`` from 0.4.23, or an error message."""
    if not python or not (os.path.exists(python) or shutil.which(python)):
        return {}, f"no 0.4.23 interpreter at {python!r} (pass --old_python)", ""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # only 0.4.23's redco
    proc = subprocess.run([python, os.path.abspath(__file__), "--old_side"],
                          input=json.dumps({"jobs": jobs}), text=True, capture_output=True,
                          env=env)
    lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT)]
    if proc.returncode or not lines:
        return {}, f"0.4.23 worker failed (exit {proc.returncode}): {proc.stderr[-800:]}", ""
    result = json.loads(lines[0][len(RESULT):])
    return ({(j["key"], j["mp"]): (j["rules"], j["specs"]) for j in result["jobs"]}, None,
            result["redco"])


# ---- the measurement ------------------------------------------------------------------------
def spec_of(entries):
    from jax.sharding import PartitionSpec as P
    return P(*[tuple(e) if isinstance(e, list) else e for e in entries])


class Bench:
    def __init__(self, args):
        import optax
        self.args = args
        self.optimizer = optax.adamw(1e-3, weight_decay=0.01)
        self.reference_cache: dict = {}

    def step(self, loss_fn):
        """``(params, opt_state, batch) -> (params, opt_state, loss)``: Trainer's own step
        (``redco.train_step``), one micro-batch, step 0."""
        import jax
        import jax.numpy as jnp

        from redco.train_step import TrainState, make_train_step, step_loss
        step = make_train_step(step_loss(lambda rng, state, params, batch, is_training:
                                         loss_fn(params, batch)), self.optimizer)

        def plain(params, opt_state, batch):
            state = TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state,
                               rng=jax.random.PRNGKey(0), apply_fn=None)
            state, metrics = step(state, jax.tree.map(lambda x: x[None], batch))
            return state.params, state.opt_state, metrics["loss"]
        return plain

    def compile(self, model, mesh, specs, rows: int):
        import jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from redco.sharding import opt_state_shardings, shardings_from_specs
        params_abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                       model.params)
        params_shardings = shardings_from_specs(specs, mesh)
        replicated = NamedSharding(mesh, P())
        opt_abstract = jax.eval_shape(self.optimizer.init, params_abstract)
        opt_shardings = opt_state_shardings(self.optimizer, params_abstract, params_shardings, mesh)
        batch_abstract = model.abstract_batch(rows)
        batch_shardings = jax.tree.map(lambda _: NamedSharding(mesh, P("dp")), batch_abstract)
        t0 = time.perf_counter()
        compiled = jax.jit(
            self.step(model.loss_fn),
            in_shardings=(params_shardings, opt_shardings, batch_shardings),
            out_shardings=(params_shardings, opt_shardings, replicated),
            donate_argnums=(0, 1)).lower(params_abstract, opt_abstract,
                                         batch_abstract).compile()
        compile_s = time.perf_counter() - t0
        leaves = (jax.tree.leaves(params_abstract) + jax.tree.leaves(opt_abstract))
        shardings = jax.tree.leaves(params_shardings) + jax.tree.leaves(opt_shardings)
        assert len(leaves) == len(shardings)
        per_device = sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
                         for x, s in zip(leaves, shardings))
        total = sum(math.prod(x.shape) * x.dtype.itemsize for x in leaves)
        return (compiled, params_shardings, opt_shardings, batch_shardings, per_device, total,
                compile_s)

    def run_steps(self, compiled, model, params_shardings, opt_shardings, batch_shardings,
                  rows: int) -> list[float]:
        import jax
        import numpy as np
        params = jax.device_put(model.params, params_shardings)
        opt_state = jax.device_put(jax.jit(self.optimizer.init)(model.params), opt_shardings)
        full = model.batch(rows * self.args.steps)
        losses = []
        for i in range(self.args.steps):
            batch = {k: np.asarray(v[i * rows:(i + 1) * rows]) for k, v in full.items()}
            params, opt_state, loss = compiled(params, opt_state,
                                               jax.device_put(batch, batch_shardings))
            losses.append(float(loss))
        return losses

    def reference(self, key, model, rows: int) -> list[float]:
        """Losses of the same steps on a 1-device mesh."""
        import jax
        from jax.sharding import PartitionSpec as P

        from redco_planner.measure import make_mesh
        if (key, rows) not in self.reference_cache:
            mesh = make_mesh(1, 1)
            specs = jax.tree.map(lambda _: P(), model.params)
            compiled, ps, os_, bs, *_ = self.compile(model, mesh, specs, rows)
            self.reference_cache[key, rows] = self.run_steps(compiled, model, ps, os_, bs,
                                                             rows)
        return self.reference_cache[key, rows]

    def cell(self, key, model, mp: int, source: str, rules) -> dict:
        """Compile, parse and run one (model, layout, rule source)."""
        from redco.sharding import named_leaves, specs_from_rules
        from redco_planner.measure import make_mesh
        mesh = make_mesh(N_DEVICES, mp)
        dp = N_DEVICES // mp
        rows = self.args.global_batch
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            specs = specs_from_rules(model.params, rules, mesh)
        fallbacks = [str(w.message) for w in caught if "replicated instead" in str(w.message)]
        (compiled, ps, os_, bs, per_device, total,
         compile_s) = self.compile(model, mesh, specs, rows)
        coll = parse_collectives(compiled.as_text(), N_DEVICES)
        losses = self.run_steps(compiled, model, ps, os_, bs, rows)
        ref = self.reference(key, model, rows)
        import jax
        from jax.sharding import PartitionSpec as P
        spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
        spec_list = {p: list(s) for (p, _), s in zip(named_leaves(model.params), spec_leaves)}
        return {"model": key, "source": source, "dp": dp, "mp": mp, "rows": rows,
                "per_device_bytes": per_device, "total_bytes": total,
                "ratio_ideal": per_device / (total / N_DEVICES),
                "ratio_mp": per_device / (total / mp),
                "coll_bytes": sum(coll["bytes"].values()),
                "ring_bytes": sum(coll["ring"].values()), "collectives": coll,
                "losses": losses, "reference": ref,
                "loss_diff": max(abs(a - b) for a, b in zip(losses, ref)),
                "compile_s": compile_s, "fallbacks": fallbacks,
                "specs": spec_list}


# ---- printing -------------------------------------------------------------------------------
MIB = 2 ** 20


def counts_text(coll: dict) -> str:
    c = coll["count"]
    other = sum(v for k, v in c.items() if k not in ("all-reduce", "all-gather",
                                                     "reduce-scatter"))
    return (f"{c.get('all-reduce', 0)}/{c.get('all-gather', 0)}/"
            f"{c.get('reduce-scatter', 0)}/{other}")


def row_text(label: str, r: dict) -> str:
    return (f"| {label} | {r['dp']}x{r['mp']} | {r['per_device_bytes'] / MIB:.3f} | "
            f"{r['ratio_ideal']:.2f} | {r['ratio_mp']:.3f} | {r['coll_bytes'] / MIB:.3f} | "
            f"{r['ring_bytes'] / MIB:.3f} | {counts_text(r['collectives'])} | "
            f"{r['loss_diff']:.1e} |")


HEADER = ("| {first} | dp x mp | param+opt MiB/dev | / ideal (total/8) | / (total/mp) | "
          "coll MiB/step | ring MiB/step | #AR/#AG/#RS/#other | max abs loss diff |\n"
          "|---|---|---:|---:|---:|---:|---:|---|---:|")


def print_family_table(family: str, results: list[dict], notes: list[str], total_params: int):
    total = results[0]["total_bytes"] if results else 0
    print(f"\n### {family} ({total_params:,} params; params + AdamW state "
          f"{total / MIB:.2f} MiB in all)\n")
    print(HEADER.format(first="rules"))
    for r in results:
        print(row_text(r["source"], r))
    for note in notes:
        print(f"\n{note}")


def compact(message: str) -> str:
    """A "replicated instead" warning with layer numbers folded and repeats dropped."""
    head, _, items = message.partition("instead: ")
    folded = dict.fromkeys(re.sub(r"/\d+/", "/N/", x) for x in items.split("; "))
    return f"{head}instead: {'; '.join(folded)}"


def diff_specs(a: dict, b: dict) -> list[str]:
    """Params whose specs differ between two results, layer numbers folded."""
    out = {}
    for path, spec in a["specs"].items():
        other = b["specs"].get(path)
        if other != spec:
            folded = re.sub(r"/\d+/", "/N/", path)
            out[folded] = f"{folded}: {tuple(spec)} vs {tuple(other)}"
    return sorted(out.values())


def diff_sites(a: dict, b: dict, top: int = 8) -> list[str]:
    sa, sb = a["collectives"]["by_site"], b["collectives"]["by_site"]
    delta = {k: sa.get(k, 0) - sb.get(k, 0) for k in set(sa) | set(sb)}
    items = sorted((kv for kv in delta.items() if kv[1]), key=lambda kv: -abs(kv[1]))[:top]
    return [f"{d / 1024:+.1f} KiB  {k}" for k, d in items]


def explain(auto: dict, other: dict) -> list[str]:
    lines = [f"  auto vs {other['source']} on {auto['model']} {auto['dp']}x{auto['mp']}: "
             f"{auto['coll_bytes'] / MIB:.3f} vs {other['coll_bytes'] / MIB:.3f} MiB"]
    lines += ["    specs differ (auto vs other): " + s for s in diff_specs(auto, other)[:12]]
    lines += ["    bytes auto - other by op site: " + s for s in diff_sites(auto, other)]
    return lines


# ---- table 3: the paper's call, with the layout decided by a real Trainer ------------------------
PAPER_ARCHS = "gpt2,bert,vit,gpt_neo"


def paper_call_rules(model, mp: int, rows: int, optimizer) -> tuple[list, list, dict]:
    """The paper's Appendix A pattern with a real ``redco.Deployer`` and ``redco.Trainer``:
    ``params_sharding_rules=deployer.get_sharding_rules(params=params)``, then the layout
    decided at the first batch (``trainer.eval_loss`` on one global batch of ``rows`` per dp
    shard). Returns ``(final, names, checks)``: the trainer's final ``params_sharding_rules``,
    the call's rules forced to a plain list, and what was checked on the way."""
    import tempfile

    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import redco
    from redco.sharding import specs_from_rules

    def collate_fn(examples):
        return {k: np.stack([e[k] for e in examples]) for k in examples[0]}

    def loss_fn(train_rng, state, params, batch, is_training):  # the paper's signature
        return model.loss_fn(params, batch)

    with tempfile.TemporaryDirectory() as workdir:
        deployer = redco.Deployer(jax_seed=0, n_model_shards=mp, workdir=workdir, loggers=(),
                                  verbose=False)
        rules = deployer.get_sharding_rules(params=model.params)
        names = list(rules)  # a plain list: used as given, the behaviour before b7b8229
        trainer = redco.Trainer(deployer=deployer, collate_fn=collate_fn,
                                apply_fn=model.apply_fn, loss_fn=loss_fn, params=model.params,
                                optimizer=optimizer, params_sharding_rules=rules)
        full = model.batch(rows * deployer.dp_size)
        examples = [{k: v[i] for k, v in full.items()} for i in range(rows * deployer.dp_size)]
        loss = trainer.eval_loss(examples, per_device_batch_size=rows)
        final = trainer.params_sharding_rules
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fallbacks are reported by the bench's own cell
            specs = specs_from_rules(model.params, final, deployer.mesh)
        placed = jax.tree.leaves(trainer.state_shardings.params)
        wanted = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
        leaves = jax.tree.leaves(model.params)
        checks = {"call_type": type(rules).__name__, "final_type": type(final).__name__,
                  "deployer_final": deployer.params_sharding_rules == final,
                  "placed_as_rules": all(
                      s.is_equivalent_to(NamedSharding(deployer.mesh, w), np.ndim(x))
                      for s, w, x in zip(placed, wanted, leaves, strict=True)),
                  "eval_loss": loss}
    return list(final), names, checks


def trainer_ok(checks: dict) -> bool:
    """The call gave ``RuleSetRules``; the trainer ended with a plain list (the deployer's too)
    and placed its params by exactly those rules."""
    return (checks["call_type"] == "RuleSetRules" and checks["final_type"] == "list"
            and checks["deployer_final"] and checks["placed_as_rules"])


def mib_pair(r: dict | None) -> str:
    return (f"{r['coll_bytes'] / MIB:.3f} | {r['ring_bytes'] / MIB:.3f}" if r is not None
            else "n/a | n/a")


def paper_ratio(a: dict, b: dict, key: str) -> str:
    return f"{a[key] / b[key]:.2f}" if b[key] else ("1.00" if not a[key] else "inf")


def paper_call_table(args, bench, archs: list[str], layouts, build, auto_rules,
                     rule_warnings: dict) -> list[dict]:
    """Table 3: paper-call vs auto(trace_fn) vs names vs megatron, per arch and layout."""
    print("\n### the paper's call `get_sharding_rules(params=params)`, layout decided by a "
          f"Trainer at its first batch (tiny configs, seq 16, {args.archs_heads or 'default'} "
          "heads)\n")
    print("| arch | dp x mp | paper-call coll MiB | paper-call ring MiB | auto(trace_fn) coll MiB "
          "| auto(trace_fn) ring MiB | names coll MiB | names ring MiB | megatron coll MiB | "
          "megatron ring MiB | paper-call / auto coll | paper-call / auto ring | names / auto "
          "coll | specs paper-call = auto |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    out, notes = [], []
    for arch in archs:
        model = build(arch, **head_overrides(arch, args.archs_heads))
        key = f"{arch}-tiny"
        for dp, mp in layouts:
            t0 = time.perf_counter()
            rows = max(1, args.global_batch // dp)  # one dp shard's rows, as auto_rules traces
            final, names, checks = paper_call_rules(model, mp, rows, bench.optimizer)
            cells = {"paper-call": bench.cell(key, model, mp, "paper-call", final),
                     "auto": bench.cell(key, model, mp, "auto", auto_rules(model, mp)),
                     "names": bench.cell(key, model, mp, "names", names)}
            cells["auto"]["fallbacks"] += rule_warnings.pop((id(model), mp), [])
            if arch in MEGATRON:
                cells["megatron"] = bench.cell(key, model, mp, "megatron", [
                    (pattern, spec_of(spec)) for pattern, spec in MEGATRON[arch]])
            paper, auto = cells["paper-call"], cells["auto"]
            same_specs = paper["specs"] == auto["specs"]
            print(f"| {arch} | {dp}x{mp} | {mib_pair(paper)} | {mib_pair(auto)} | "
                  f"{mib_pair(cells['names'])} | {mib_pair(cells.get('megatron'))} | "
                  f"{paper_ratio(paper, auto, 'coll_bytes')} | "
                  f"{paper_ratio(paper, auto, 'ring_bytes')} | "
                  f"{paper_ratio(cells['names'], auto, 'coll_bytes')} | "
                  f"{'yes' if same_specs else 'NO'} |", flush=True)
            print(f"  {arch} {dp}x{mp}: {checks}, cell {time.perf_counter() - t0:.1f}s",
                  file=sys.stderr, flush=True)
            if not trainer_ok(checks):
                notes.append(f"{arch} {dp}x{mp}: unexpected trainer checks {checks}")
            if not same_specs or paper["coll_bytes"] != auto["coll_bytes"]:
                notes.append("\n".join(explain(auto, paper)))
            for source, r in cells.items():
                notes += [f"{source} {arch} {dp}x{mp}: {compact(fb)}" for fb in r["fallbacks"]]
                if r["loss_diff"] > 1e-5:
                    notes.append(f"{source} {arch} {dp}x{mp}: loss differs from one device by "
                                 f"{r['loss_diff']:.1e}")
            out.append({"arch": arch, "layout": f"{dp}x{mp}", "checks": checks,
                        "cells": cells})
    equal = sum(r["cells"]["paper-call"]["coll_bytes"] == r["cells"]["auto"]["coll_bytes"]
                and r["cells"]["paper-call"]["specs"] == r["cells"]["auto"]["specs"] for r in out)
    ok = sum(trainer_ok(r["checks"]) for r in out)
    print(f"\npaper-call == auto(trace_fn), same specs and collective bytes: {equal}/{len(out)}; "
          f"the call gave RuleSetRules, the trainer's final rules a plain list, its state placed "
          f"by them: {ok}/{len(out)}")
    for note in notes:
        print(f"\n{note}")
    return out


# ---- main -----------------------------------------------------------------------------------
def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old_python", default=os.environ.get(
        "REDCO0423_PYTHON", "/tmp/redco0423-venv/bin/python"),
        help="python of a venv holding redco==0.4.23 (or $REDCO0423_PYTHON)")
    parser.add_argument("--layouts", default="4x2,2x4,1x8", help="dp x mp, comma-separated")
    parser.add_argument("--families", default="gpt2,llama,t5")
    parser.add_argument("--sources", default="auto,megatron,redco-0.4.23,auto+fsdp",
                        help="rule sources of table 1 (auto+fsdp: auto over mp plus ZeRO-3 "
                             "over dp, for the memory column)")
    parser.add_argument("--archs", default="all",
                        help="table 2: hf_archs architectures for `auto` ('all', 'none', or "
                             "a comma-separated list)")
    parser.add_argument("--archs_heads", type=int, default=8,
                        help="table 2: attention (and KV) heads of every tiny config "
                             "(0: hf_archs' own, 4 heads, LLaMA/Mistral 2 KV heads)")
    parser.add_argument("--paper_call", nargs="?", const=PAPER_ARCHS, default="",
                        help="table 3: the paper's get_sharding_rules(params=params) through a "
                             "real Trainer vs auto(trace_fn) vs names vs megatron, on these "
                             f"hf_archs architectures (alone: {PAPER_ARCHS})")
    parser.add_argument("--steps", type=int, default=3, help="real steps for the loss check")
    parser.add_argument("--global_batch", type=int, default=8,
                        help="rows per step in every layout, split over dp (8: 2 per dp shard "
                             "at dp=4, 8 at dp=1)")
    parser.add_argument("--seq_len", type=int, default=64, help="table 1 sequence length")
    parser.add_argument("--json", help="write every measurement here")
    parser.add_argument("--explain", action="store_true",
                        help="always print the spec / collective-site diffs, not only where "
                             "auto moves more bytes")
    parser.add_argument("--old_side", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.old_side:
        old_side_worker()
        return

    start = time.perf_counter()
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests", "sharding_hf"))
    import flax
    import hf_archs
    import jax
    import numpy as np
    import optax
    import transformers

    import redco
    from redco import plugins
    from redco.sharding import dataflow_trace, named_leaves
    from redco_planner.measure import make_mesh

    layouts = [tuple(int(x) for x in lay.split("x")) for lay in args.layouts.split(",")]
    families = [f for f in args.families.split(",") if f]
    sources = [s for s in args.sources.split(",") if s]
    archs = (hf_archs.ARCHS if args.archs == "all" else
             [] if args.archs == "none" else args.archs.split(","))
    print(f"redco {redco.__version__}, jax {jax.__version__}, flax {flax.__version__}, "
          f"optax {optax.__version__}, transformers {transformers.__version__}; "
          f"{jax.device_count()} {jax.devices()[0].platform} devices, {os.cpu_count()} CPU "
          f"cores; global batch {args.global_batch} rows in every layout, {args.steps} steps, "
          "optax.adamw(1e-3, weight_decay=0.01), float32", flush=True)
    bench = Bench(args)

    rule_warnings: dict = {}  # (model, mp) -> the rule set's "replicated instead" warnings

    def auto_rules(model, mp, name="auto"):
        mesh = make_mesh(N_DEVICES, mp)
        trace_fn = dataflow_trace(model.loss_fn, model.abstract_batch(
            max(1, args.global_batch // (N_DEVICES // mp))))  # one dp shard's rows
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rules = plugins.lookup("sharding_rules", name)(model.params, mesh, trace_fn)
        rule_warnings[id(model), mp] = [str(w.message) for w in caught
                                        if "replicated instead" in str(w.message)]
        return rules

    def build(arch, **kwargs):
        model = hf_archs.build(arch, **kwargs)
        # host copies: every run device_puts fresh buffers (the step donates them)
        model.params = jax.tree.map(np.asarray, model.params)
        return model

    models = {f: build(f, seq_len=args.seq_len, **FAMILIES[f]) for f in families}

    # Redco 0.4.23's rules for every family and mp, in one subprocess
    old, old_error, old_version = {}, None, ""
    if "redco-0.4.23" in sources and families:
        jobs = [{"key": f, "mp": mp, "shapes": {p: list(x.shape) for p, x in
                                                named_leaves(models[f].params)}}
                for f in families for _, mp in layouts]
        old, old_error, old_version = fetch_old_rules(args.old_python, jobs)
        if old_error:
            print(f"redco-0.4.23 rules unavailable: {old_error}", flush=True)

    all_results, summary, explanations = [], [], []
    for family in families:
        model = models[family]
        n_params = int(sum(np.size(x) for x in jax.tree.leaves(model.params)))
        results, notes = [], []
        for dp, mp in layouts:
            by_source = {}
            for source in sources:
                if source in ("auto", "auto+fsdp"):
                    rules = auto_rules(model, mp, source)
                elif source == "megatron":
                    rules = [(pattern, spec_of(spec)) for pattern, spec in MEGATRON[family]]
                elif source == "redco-0.4.23":
                    if (family, mp) not in old:
                        notes.append(f"redco-0.4.23 {dp}x{mp}: not measured ({old_error})")
                        continue
                    old_rules, old_specs = old[family, mp]
                    rules = [(old_rule_regex(keys), spec_of(spec)) for keys, spec in old_rules]
                else:
                    raise SystemExit(f"unknown source {source!r}")
                t0 = time.perf_counter()
                r = bench.cell(family, model, mp, source, rules)
                if source in ("auto", "auto+fsdp"):
                    r["fallbacks"] += rule_warnings.pop((id(model), mp), [])
                if source == "redco-0.4.23":  # the converted rules must give 0.4.23's specs
                    bad = [p for p, s in old_specs.items()
                           if tuple(spec_of(s)) != tuple(spec_of(r["specs"][p]))]
                    r["conversion_mismatches"] = bad
                    if bad:
                        notes.append(f"redco-0.4.23 {dp}x{mp}: converted rules disagree with "
                                     f"0.4.23's own specs on {bad}")
                for fb in r["fallbacks"]:
                    notes.append(f"{source} {dp}x{mp}: {compact(fb)}")
                print(f"  {family} {source} {dp}x{mp}: coll {r['coll_bytes'] / MIB:.3f} MiB, "
                      f"mem x{r['ratio_mp']:.3f} of total/mp, loss diff {r['loss_diff']:.1e}, "
                      f"compiled in {r['compile_s']:.1f}s, cell {time.perf_counter() - t0:.1f}s",
                      file=sys.stderr, flush=True)
                results.append(r)
                by_source[source] = r
            auto = by_source.get("auto")
            row = {"family": family, "layout": f"{dp}x{mp}"}
            for source, r in by_source.items():
                row[source] = r["coll_bytes"]
                if auto is not None and source not in ("auto", "auto+fsdp") and (
                        args.explain or auto["coll_bytes"] > r["coll_bytes"]):
                    explanations += explain(auto, r)
            summary.append(row)
        all_results += results
        print_family_table(family, results, notes, n_params)

    if summary:
        print("\n### collective bytes per step: auto against the others\n")
        print("| family | dp x mp | auto MiB | megatron MiB | redco-0.4.23 MiB | "
              "auto / megatron | auto / redco-0.4.23 |\n|---|---|---:|---:|---:|---:|---:|")
        for row in summary:
            def mib(s):
                return f"{row[s] / MIB:.3f}" if s in row else "n/a"

            def ratio(s):
                return (f"{row['auto'] / row[s]:.3f}" if s in row and "auto" in row
                        and row[s] else "n/a")
            print(f"| {row['family']} | {row['layout']} | {mib('auto')} | {mib('megatron')} | "
                  f"{mib('redco-0.4.23')} | {ratio('megatron')} | {ratio('redco-0.4.23')} |")
    if explanations:
        print("\nwhere auto moves more bytes (or --explain):")
        print("\n".join(explanations))
    if old_version:
        print(f"\nredco-0.4.23 rules from redco {old_version} via {args.old_python}")

    # table 2: every architecture, auto only, tiny configs
    broad = []
    if archs:
        print("\n### every hf_archs architecture, `auto` rules (tiny configs, seq 16, "
              f"{args.archs_heads or 'default'} heads)\n")
        print(HEADER.format(first="arch"))
        for arch in archs:
            model = build(arch, **head_overrides(arch, args.archs_heads))
            for dp, mp in layouts:
                t0 = time.perf_counter()
                try:
                    r = bench.cell(f"{arch}-tiny", model, mp, "auto", auto_rules(model, mp))
                    r["fallbacks"] += rule_warnings.pop((id(model), mp), [])
                except Exception as e:  # noqa: BLE001 - report and go on
                    print(f"| {arch} | {dp}x{mp} | failed: {type(e).__name__}: "
                          f"{str(e)[:200]} |", flush=True)
                    continue
                print(row_text(arch, r), flush=True)
                print(f"  {arch} {dp}x{mp}: cell {time.perf_counter() - t0:.1f}s",
                      file=sys.stderr, flush=True)
                broad.append(r)
        notes = [f"{r['model']} {r['dp']}x{r['mp']}: {compact(fb)}" for r in broad
                 for fb in r["fallbacks"]]
        for note in notes:
            print(f"\n{note}")
        worst = [r for r in broad if r["loss_diff"] > 1e-5]
        print(f"\nloss within 1e-5 of one device: {len(broad) - len(worst)}/{len(broad)}")

    paper = []
    if args.paper_call:
        paper = paper_call_table(args, bench, args.paper_call.split(","), layouts, build,
                                 auto_rules, rule_warnings)

    print(f"\ntotal {time.perf_counter() - start:.0f}s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"families": all_results, "archs": broad, "summary": summary,
                       "paper_call": paper}, f, indent=1, default=str)


if __name__ == "__main__":
    from provenance import print_provenance
    print_provenance()
    main()
