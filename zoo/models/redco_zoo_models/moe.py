"""A Mixture-of-Experts feed-forward block: a router picks ``top_k`` of ``n_experts`` gated MLPs
for each token, and the token's output is their outputs weighted by the router.

**Routing.** ``softmax`` (Mixtral, Qwen3-MoE): the router's logits become probabilities and the
``top_k`` largest are taken, renormalised to sum to 1 where ``normalize_top_k`` (Mixtral always,
Qwen3-MoE by its ``norm_topk_prob``; gpt-oss's softmax over the ``top_k`` largest logits is
the same thing). ``sigmoid`` (DeepSeek-V3): each expert scores
``sigmoid(logit)``; the choice is by score plus a per-expert balancing bias, within the token's
best ``topk_group`` of ``n_group`` groups of experts, the weights are the scores alone,
renormalised and multiplied by ``routed_scaling_factor``. The bias is moved in training against
each step's load (an overloaded expert's bias goes down by ``bias_update_rate``, an underloaded
one's up), DeepSeek-V3's auxiliary-loss-free balancing: ``redco_zoo_models.balancing`` says how.
``n_shared_experts`` (DeepSeek-V3, Qwen2-MoE) adds an MLP every token goes through
(``shared_expert_size`` sizes it directly; with ``shared_expert_gate`` (Qwen3-Next, Qwen3.5-MoE)
its output is scaled per token by ``sigmoid`` of a learned linear of the token). gpt-oss
switches on biases (``router_bias`` on the router's linear, ``expert_bias`` on every expert
projection) and its experts' clamped SwiGLU (``swiglu_limit``, ``layers.glu``).
Nemotron-H's experts and shared expert are ungated (``gated`` off: ``up_proj``, ``down_proj``,
``act(up(x))`` between them, its ``relu2``), and with a ``latent_size`` the routed experts read
and write a smaller width: ``fc1_latent_proj`` takes each token down to it before the experts,
``fc2_latent_proj`` their weighted sum back up (router and shared expert read the token itself).
``top_k_sigmoid`` (Llama 4): the ``top_k`` largest logits, each weighted by its ``sigmoid``;
with ``expert_input_scaled`` the weight scales the expert's *input*, ``E(w x)``, not its
output (the experts are not linear: the two differ); a shared expert every token goes through.
Gemma 4's router (``softmax``, renormalised) reads its own input (``router_input``: the
residual stream, where the experts read its norm) RMS-normalised without a weight, times a
learned ``router_scale`` per feature and ``hidden_size ** -0.5`` (``router_norm``); each chosen
expert's weight is then multiplied by its learned ``per_expert_scale``.

**Computing the experts.** Dropless (``capacity_factor=None``): the ``N * top_k`` (token, expert)
pairs are sorted by expert and each expert's rows multiplied by its weights in one grouped
matmul (``jax.lax.ragged_dot``): no token is dropped, whatever the load. With a
``capacity_factor``, each expert takes at most ``ceil(capacity_factor * N * top_k / n_experts)``
pairs (a token's first choice before anyone's second), written by index into an (E, C, H)
buffer of fixed shape and computed in batched matmuls (``redco_zoo_models.slots``); pairs
past an expert's capacity are dropped: that expert adds nothing to the token (the residual
carries it), and the share dropped is reported. Traced inside
``expert_parallel.expert_parallel(mesh)``, the experts are split over the mesh's ``dp`` axis
and the tokens sent to them and back (``redco_zoo_models.expert_parallel``).

**What it reports** (``MoE.__call__`` returns ``(y, aux)``): ``load_balancing_loss`` (Switch and
Mixtral's ``n_experts * sum_e f_e * P_e``, f the share of pairs routed to e, P the mean router
probability of e: 1 when balanced, ``n_experts`` when every token picks one expert),
``router_z_loss`` (the mean squared log-sum-exp of the logits, ST-MoE), their weighted sum
``aux_loss`` to add to the training loss, and per step ``expert_load`` (pairs per expert),
its min / max / coefficient of variation, and ``dropped_share``.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from redco_zoo_models import expert_parallel, slots
from redco_zoo_models.balancing import BalanceBias, sigmoid_choice
from redco_zoo_models.layers import ACTIVATIONS, MLP, GatedMLP, glu, rms_normalized


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    hidden_size: int
    n_experts: int
    top_k: int
    expert_size: int  # each expert's intermediate size
    router: str = "softmax"  # softmax (Mixtral, Qwen3-MoE) | sigmoid (DeepSeek-V3) |
    #                          top_k_sigmoid (Llama 4)
    normalize_top_k: bool = True
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0  # an MLP of n_shared_experts * expert_size every token goes through
    n_group: int = 1  # sigmoid routing: experts in n_group groups, ...
    topk_group: int = 1  # ... a token choosing within its best topk_group of them
    capacity_factor: float | None = None  # None: dropless
    load_balancing_weight: float = 0.01
    z_loss_weight: float = 0.0
    bias_update_rate: float = 1e-3  # sigmoid routing's balancing bias, per step
    hidden_act: str = "silu"
    router_bias: bool = False  # gpt-oss: the router's linear has a bias
    expert_bias: bool = False  # gpt-oss: biases on each expert's projections
    swiglu_limit: float | None = None  # gpt-oss: the experts' clamped SwiGLU (layers.glu)
    swiglu_alpha: float = 1.702
    shared_expert_size: int = 0  # Qwen3-Next: a shared expert of this size (over n_shared_experts)
    shared_expert_gate: bool = False  # ... its output scaled by sigmoid(shared_expert_gate(x))
    expert_input_scaled: bool = False  # Llama 4: the weight scales the expert's input
    router_norm: bool = False  # Gemma 4: the router's input normed, scaled (module docstring) ...
    per_expert_scale: bool = False  # ... and each chosen expert's weight times its own scale
    norm_eps: float = 1e-6  # (the router's norm)
    gated: bool = True  # False: up_proj, down_proj only (Nemotron-H)
    latent_size: int = 0  # Nemotron-H: the routed experts' width (0: hidden_size)

    def __post_init__(self):
        if self.router not in ("softmax", "sigmoid", "top_k_sigmoid"):
            raise ValueError(f"router={self.router!r}: use 'softmax' (Mixtral, Qwen3-MoE), "
                             "'sigmoid' (DeepSeek-V3) or 'top_k_sigmoid' (Llama 4).")
        if self.expert_input_scaled and self.capacity_factor is not None:
            raise ValueError("expert_input_scaled (Llama 4) runs dropless only: set "
                             "capacity_factor=None.")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k} with n_experts={self.n_experts}: each token "
                             "picks between 1 and n_experts experts.")
        if self.n_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"n_group={self.n_group}, topk_group={self.topk_group} with "
                             f"n_experts={self.n_experts}: groups split the experts evenly and "
                             "a token keeps between 1 and n_group of them.")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor={self.capacity_factor}: give a positive factor "
                             "(1.0: an even share each), or None for dropless.")

    def capacity(self, n_tokens: int) -> int:
        """Pairs an expert takes of ``n_tokens`` tokens with ``capacity_factor``."""
        return max(1, math.ceil(self.capacity_factor * n_tokens * self.top_k / self.n_experts))


class Experts(nnx.Module):
    """``n_experts`` gated MLPs, their weights stacked: ``gate_proj`` and ``up_proj`` (E, H, I),
    ``down_proj`` (E, I, H); with ``expert_bias`` (gpt-oss) also ``gate_proj_bias``,
    ``up_proj_bias`` (E, I) and ``down_proj_bias`` (E, H). The unit between them is
    ``layers.glu`` (gpt-oss: clamped by ``swiglu_limit``). Ungated (``gated`` off: Nemotron-H),
    no ``gate_proj`` and ``act(up(x))`` between; H is ``latent_size`` where one is set."""

    def __init__(self, cfg: MoEConfig, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        e, h, i = cfg.n_experts, cfg.latent_size or cfg.hidden_size, cfg.expert_size
        if cfg.gated:
            self.gate_proj = nnx.Param(init(rngs.params(), (e, h, i)))
        self.up_proj = nnx.Param(init(rngs.params(), (e, h, i)))
        self.down_proj = nnx.Param(init(rngs.params(), (e, i, h)))
        if cfg.expert_bias:
            self.gate_proj_bias = nnx.Param(jnp.zeros((e, i), jnp.float32))
            self.up_proj_bias = nnx.Param(jnp.zeros((e, i), jnp.float32))
            self.down_proj_bias = nnx.Param(jnp.zeros((e, h), jnp.float32))
        self.cfg = cfg

    def weights(self) -> tuple:
        """``(gate, up, down)`` and, with ``expert_bias``, their biases: what ``batched`` takes
        (expert parallelism passes each device its share of every one)."""
        names = ("gate_proj", "up_proj", "down_proj")[0 if self.cfg.gated else 1:]
        if self.cfg.expert_bias:
            names += tuple(f"{n}_bias" for n in names)
        return tuple(getattr(self, n)[...] for n in names)

    def weight_in(self, weight, dtype):
        """A weight of ``weights()`` as the experts compute with it: in ``dtype`` (a quantised
        one dequantised there, ``redco_zoo_models.quantized_experts``)."""
        return jnp.asarray(weight, dtype)

    def _mlp(self, x, weights: tuple, project):
        """``down(glu(gate(x), up(x)))`` (ungated: ``down(act(up(x)))``), each
        ``project(x, weight, bias or None)``."""
        cfg, weights = self.cfg, [self.weight_in(w, x.dtype) for w in weights]
        n = 3 if cfg.gated else 2
        mats, biases = weights[:n], weights[n:] or [None] * n
        if not cfg.gated:
            h = ACTIVATIONS[cfg.hidden_act](project(x, mats[0], biases[0]))
        else:
            h = glu(project(x, mats[0], biases[0]), project(x, mats[1], biases[1]),
                    cfg.hidden_act, cfg.swiglu_limit, cfg.swiglu_alpha)
        return project(h, mats[-1], biases[-1])

    def grouped(self, rows, group_sizes):
        """Rows sorted by expert, ``group_sizes[e]`` of them for expert e: each through its own."""
        expert_of = jnp.repeat(jnp.arange(group_sizes.shape[0]), group_sizes,
                               total_repeat_length=rows.shape[0])

        def project(x, w, b):
            y = jax.lax.ragged_dot(x, w, group_sizes)
            return y if b is None else y + b[expert_of]
        return self._mlp(rows, self.weights(), project)

    def batched(self, per_expert, weights: tuple | None = None):
        """``(E, C, H)``: each expert's C rows through it; ``weights`` (``weights()``'s) in place
        of the module's (one device's share of the experts under expert parallelism)."""
        def project(x, w, b):
            y = jnp.einsum("ech,ehi->eci", x, w)
            return y if b is None else y + b[:, None, :]
        return self._mlp(per_expert, weights or self.weights(), project)


class MoE(nnx.Module):
    def __init__(self, cfg: MoEConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.gate = nnx.Linear(cfg.hidden_size, cfg.n_experts, use_bias=cfg.router_bias, rngs=rngs)
        self.experts = Experts(cfg, rngs)
        if cfg.router == "sigmoid":
            self.balance_bias = BalanceBias(jnp.zeros(cfg.n_experts, jnp.float32))
        if shared := cfg.shared_expert_size or cfg.n_shared_experts * cfg.expert_size:
            self.shared_experts = GatedMLP(cfg.hidden_size, shared, cfg.hidden_act, rngs) \
                if cfg.gated else MLP(cfg.hidden_size, shared, cfg.hidden_act, rngs)
        if cfg.latent_size:  # (Nemotron-H: the routed experts' narrower width)
            self.fc1_latent_proj = nnx.Linear(cfg.hidden_size, cfg.latent_size, use_bias=False,
                                              rngs=rngs)
            self.fc2_latent_proj = nnx.Linear(cfg.latent_size, cfg.hidden_size, use_bias=False,
                                              rngs=rngs)
        if cfg.shared_expert_gate:
            self.shared_expert_gate = nnx.Linear(cfg.hidden_size, 1, use_bias=False, rngs=rngs)
        if cfg.router_norm:
            self.router_scale = nnx.Param(jnp.ones(cfg.hidden_size, jnp.float32))
        if cfg.per_expert_scale:
            self.per_expert_scale = nnx.Param(jnp.ones(cfg.n_experts, jnp.float32))

    def route(self, tokens):
        """``(chosen (N, k) expert ids, weights (N, k), probs (N, E), logits (N, E))``."""
        cfg = self.cfg
        if cfg.router_norm:  # (Gemma 4)
            scale = self.router_scale[...] * cfg.hidden_size ** -0.5
            tokens = (rms_normalized(tokens.astype(jnp.float32), cfg.norm_eps) * scale).astype(
                tokens.dtype)
        logits = self.gate(tokens).astype(jnp.float32)
        if cfg.router == "softmax":
            probs = jax.nn.softmax(logits, axis=-1)
            weights, chosen = jax.lax.top_k(probs, cfg.top_k)
        elif cfg.router == "top_k_sigmoid":
            probs = jax.nn.sigmoid(logits)
            top, chosen = jax.lax.top_k(logits, cfg.top_k)
            weights = jax.nn.sigmoid(top)
        else:
            probs = jax.nn.sigmoid(logits)
            weights, chosen = sigmoid_choice(probs, self.balance_bias[...], cfg.top_k,
                                             cfg.n_group, cfg.topk_group)
        if cfg.normalize_top_k:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        if cfg.per_expert_scale:
            weights = weights * self.per_expert_scale[...][chosen]
        return chosen, weights * cfg.routed_scaling_factor, probs, logits

    def __call__(self, x, router_input=None):
        """``(y, aux)`` for ``x`` (..., H), routed on ``router_input`` (x's shape; ``x`` when
        not given): the module docstring says what ``aux`` holds."""
        cfg, shape = self.cfg, x.shape
        tokens = x.reshape(-1, shape[-1])
        chosen, weights, probs, logits = self.route(
            tokens if router_input is None else router_input.reshape(-1, shape[-1]))
        tokens, inputs = self.into_latent(tokens), tokens  # (the experts' width)
        if (mesh := expert_parallel.current()) is not None:  # experts split over dp
            y, dropped = expert_parallel.dispatched(self, tokens, chosen, weights, mesh)
        elif cfg.capacity_factor is None:
            y, dropped = self.dropless(tokens, chosen, weights), jnp.zeros((), jnp.float32)
        else:
            y, dropped = self.with_capacity(tokens, chosen, weights)
        y = self.fc2_latent_proj(y) if cfg.latent_size else y
        if cfg.n_shared_experts or cfg.shared_expert_size:
            shared = self.shared_experts(inputs)
            if cfg.shared_expert_gate:
                shared = jax.nn.sigmoid(self.shared_expert_gate(inputs)) * shared
            y = y + shared
        return y.reshape(shape), self.report(chosen, probs, logits, dropped)

    def into_latent(self, tokens):
        """The tokens at the routed experts' width (``latent_size``: Nemotron-H)."""
        return self.fc1_latent_proj(tokens) if self.cfg.latent_size else tokens

    def dropless(self, tokens, chosen, weights):
        """Every (token, expert) pair computed: sorted by expert, one grouped matmul each."""
        pairs = chosen.reshape(-1)
        order = jnp.argsort(pairs, stable=True)
        token_of = order // self.cfg.top_k
        group_sizes = jnp.bincount(pairs, length=self.cfg.n_experts).astype(jnp.int32)
        scale = weights.reshape(-1)[order][:, None].astype(tokens.dtype)
        into = self.cfg.expert_input_scaled  # (Llama 4: the weight scales the input)
        out = self.experts.grouped(tokens[token_of] * scale if into else tokens[token_of],
                                   group_sizes)
        out = out if into else out * scale
        return jnp.zeros_like(tokens).at[token_of].add(out)

    def with_capacity(self, tokens, chosen, weights):
        """At most ``capacity`` pairs an expert (first choices first); ``(y, share dropped)``."""
        cfg, capacity = self.cfg, self.cfg.capacity(tokens.shape[0])
        places, kept = slots.slots(chosen, cfg.n_experts, capacity)
        out = self.experts.batched(slots.dispatch(tokens, places, cfg.n_experts, capacity))
        dropped = 1 - kept / chosen.size
        return slots.combine(out, places, weights), dropped.astype(jnp.float32)

    def report(self, chosen, probs, logits, dropped) -> dict:
        """The auxiliary losses and the load metrics of one call (module docstring)."""
        cfg = self.cfg
        load = jnp.bincount(chosen.reshape(-1), length=cfg.n_experts).astype(jnp.float32)
        share = load / jnp.sum(load)
        mean_prob = jnp.mean(probs / jnp.sum(probs, axis=-1, keepdims=True), axis=0)
        balancing = cfg.n_experts * jnp.sum(share * mean_prob)
        z_loss = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
        return {"aux_loss": cfg.load_balancing_weight * balancing + cfg.z_loss_weight * z_loss,
                "load_balancing_loss": balancing, "router_z_loss": z_loss,
                "expert_load": load, "load_min": jnp.min(load), "load_max": jnp.max(load),
                "load_cv": jnp.std(load) / jnp.mean(load), "dropped_share": dropped}

