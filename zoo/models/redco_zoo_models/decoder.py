"""One decoder for the LLaMA-like families: switches for what differs, not a copy per family.

Every family here is a stack of layers ``attention -> MLP`` with RMSNorm, RoPE, grouped-query
attention (or DeepSeek-V3's latent attention, or in a hybrid's Mamba2 layers a state-space
mixer: ``redco_zoo_models.mamba2``) and a gated MLP (or a Mixture-of-Experts block);
what differs is data, ``DecoderConfig`` (``redco_zoo_models.decoder_config`` says each switch).

Module names follow HuggingFace's (``model/layers/0/self_attn/q_proj/kernel``), so checkpoints
map by name (``redco_zoo_models.hf``); a family's own tensor names and config keys live in
``redco_zoo_models.families``. With ``scan_layers`` the layers are stored stacked
(``model/layers/0:32/self_attn/q_proj/kernel``, layers on the first axis) and run under
``jax.lax.scan``, with a KV cache too (one cache a layer at this interface, stacked inside a
scanned run; Qwen3-VL's ``deepstack`` keeps the unrolled loop): ``redco_zoo_models.layer_scan``.
"""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from redco import remat, sequence_split
from redco.tree_paths import named_leaves
from redco_zoo_models import (
    falcon_h1,
    family_tensors,
    gemma4,
    layer_scan,
    llama4_attention,
    mamba2,
    nemotron_h,
)
from redco_zoo_models.attention import init_cache, with_blocks
from redco_zoo_models.chunked_loss import next_token_loss
from redco_zoo_models.context_parallel import (
    SplitSequence,
    decoder_layout,
    in_order,
    on_split,
)
from redco_zoo_models.decoder_attention import Attention
from redco_zoo_models.decoder_config import DecoderConfig, Mixer
from redco_zoo_models.expert_parallel import as_laid_out
from redco_zoo_models.gated_deltanet import GatedDeltaNet, init_state
from redco_zoo_models.hf_init import init_like_hf
from redco_zoo_models.layers import MLP, GatedMLP, RMSNorm, document_runs, embed
from redco_zoo_models.mamba2 import Mamba2, token_mask
from redco_zoo_models.mla import LatentAttention, latent_width
from redco_zoo_models.moe import MoE
from redco_zoo_models.recurrent_split import mixer_inputs
from redco_zoo_models.rope import depends_on_length, segment_lengths

NORMS = {  # norm_layout -> the layer's norms, by HuggingFace's names
    "pre": ("input_layernorm", "post_attention_layernorm"),
    "sandwich": ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm"),
    "post": ("post_attention_layernorm", "post_feedforward_layernorm"),
}


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: DecoderConfig, layer: int, rngs: nnx.Rngs):
        mixer = cfg.mixer(layer)
        for name in (nemotron_h.one_block_norm(cfg, layer),) if cfg.one_block \
                else NORMS[cfg.norm_layout]:  # (Nemotron-H: one norm, before its block)
            setattr(self, name, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset))
        if mixer in (Mixer.MAMBA2, Mixer.PARALLEL):
            self.mamba = Mamba2(cfg.mamba, rngs)
        if mixer is Mixer.GATED_DELTANET:  # (its token mixer: linear_attn)
            self.linear_attn = GatedDeltaNet(cfg.delta_net(), rngs)
        elif mixer not in (Mixer.MAMBA2, Mixer.NONE):
            self.self_attn = LatentAttention(cfg, rngs) if cfg.kv_lora_rank else \
                Attention(cfg, layer, rngs)
        if cfg.has_mlp(layer):  # (Nemotron-H's mixer layers: none)
            self.mlp = _mlp(cfg, layer, rngs)
        gemma4.add_layer_parts(self, cfg, rngs)
        self.layout, self.residual_multiplier, self.cfg = cfg.norm_layout, cfg.residual_multiplier, cfg

    @remat.layer
    def __call__(self, x, positions, allowed, layer_cache=None, cache_index=0, lengths=None,
                 segment_ids=None, per_layer_input=None):
        keep = lambda h: h  # noqa: E731
        norm = lambda name: getattr(self, name, keep)  # noqa: E731
        before_attn = norm("input_layernorm")
        after_attn = norm("post_attention_layernorm") if self.layout != "pre" else keep
        before_mlp = norm("post_attention_layernorm" if self.layout == "pre"
                          else "pre_feedforward_layernorm")
        after_mlp = norm("post_feedforward_layernorm")
        if hasattr(self, "mamba") and hasattr(self, "self_attn"):  # (Falcon-H1: both)
            h, layer_cache = falcon_h1.mixed(self, before_attn(x), positions, allowed,
                                             layer_cache, cache_index, lengths, segment_ids)
        elif hasattr(self, "mamba") or hasattr(self, "linear_attn"):
            h, layer_cache = self._recurrent(before_attn(x), allowed, layer_cache, cache_index,
                                             segment_ids)
        elif hasattr(self, "self_attn"):
            h, layer_cache = self.self_attn(before_attn(x), positions, allowed, layer_cache,
                                            cache_index, lengths)
        else:  # (Nemotron-H's MLP-only and MoE layers: no mixer)
            h = None
        x = x if h is None else x + self._scaled(after_attn(h))
        x, report = self._feed_forward(x, before_mlp, after_mlp)
        x = gemma4.layer_output(self, self.cfg, x, per_layer_input)
        return (x, layer_cache,
                {k: v for k, v in report.items() if v.ndim == 0})

    def _feed_forward(self, x, before, after):
        """``x`` plus the MLP's (or MoE block's) output on ``before(x)``, put through ``after``,
        and the MoE block's report; ``x`` itself where the layer has no MLP (Nemotron-H's
        mixer layers)."""
        if not hasattr(self, "mlp"):
            return x, {}
        h, report = self.mlp(before(x)), {}
        if isinstance(self.mlp, MoE):
            h, report = h
        if hasattr(self, "moe"):  # (Gemma 4: an MoE block beside the MLP)
            h, report = gemma4.with_moe(self, x, h)
        return x + self._scaled(after(h)), report

    def _recurrent(self, x, allowed, layer_cache, cache_index, segment_ids):
        """A recurrent mixer's ``(out, cache)`` (its cache: a fixed-size state); under a split
        sequence, with the state passed between devices (``recurrent_split``)."""
        split = allowed if isinstance(allowed, SplitSequence) else None
        if split is not None:
            (valid, _), runs = mixer_inputs(split), None
        else:
            valid = token_mask(allowed, cache_index)
            runs = None if segment_ids is None else document_runs(segment_ids)
        mixer = getattr(self, "mamba", None) or self.linear_attn
        return mixer(x, valid, layer_cache, runs=runs, split=split)

    def _scaled(self, h):
        """A block's output as the residual adds it (Granite's ``residual_multiplier``)."""
        m = self.residual_multiplier
        return h if m == 1.0 else h * jnp.asarray(m, h.dtype)


def _mlp(cfg: DecoderConfig, layer: int, rngs: nnx.Rngs) -> nnx.Module:
    """Layer ``layer``'s MLP: an MoE block, a gated MLP or (``gated_mlp`` off) an ungated one."""
    if cfg.sparse(layer) and not cfg.moe_beside_mlp:
        return MoE(cfg.moe(), rngs)
    if not cfg.gated_mlp:
        return MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, rngs)
    wide = 2 if cfg.double_wide_mlp and cfg.kv_source(layer) is not None else 1
    return GatedMLP(cfg.hidden_size, wide * cfg.intermediate_size, cfg.hidden_act, rngs,
                    multipliers=cfg.mlp_multipliers)


class DecoderModel(nnx.Module):
    """The decoder stack, named as HuggingFace names it (``model.layers.0.self_attn...``)."""

    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, rngs=rngs)
        self.layers = nnx.List([DecoderLayer(cfg, i, rngs) for i in range(cfg.num_hidden_layers)])
        self.runs = None  # stacked by ``stack_layers`` (cfg.scan_layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.cfg = cfg
        if cfg.per_layer_input_size:
            gemma4.add_model_parts(self, cfg, rngs)

    def stack_layers(self) -> None:
        """Store runs of like layers stacked, to run under a scan (``layer_scan``). Called
        once the layers hold their starting weights, so a scanned model starts where the
        unrolled one does."""
        self.layers, self.runs = layer_scan.stacked(list(self.layers))

    def embed(self, input_ids):
        """The input embeddings of ``input_ids``, scaled as the family scales them."""
        x = embed(self.embed_tokens, input_ids)
        if self.cfg.embed_scale:
            x = x * jnp.asarray(self.cfg.hidden_size ** 0.5, x.dtype)
        if self.cfg.embedding_multiplier != 1.0:
            x = x * jnp.asarray(self.cfg.embedding_multiplier, x.dtype)
        return x

    def __call__(self, input_ids, attention_mask=None, cache=None, cache_index=0,
                 segment_ids=None, inputs_embeds=None, blocks=None, positions=None,
                 deepstack=None):
        refuse_for_images(inputs_embeds, blocks, segment_ids, cache_index)
        input_ids, own_positions, allowed = decoder_layout(  # (split sequence: context parallel)
            input_ids, attention_mask, cache is not None, cache_index, segment_ids)
        positions = own_positions if positions is None else positions
        full_allowed = allowed  # (the full layers' mask: Gemma 4's see no image both ways)
        if blocks is not None:
            slots = input_ids.shape[1] if cache is None else attention_mask.shape[1]
            allowed = with_blocks(allowed, blocks, slots)
            full_allowed = full_allowed if gemma4.images_slide_only(self.cfg) else allowed
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        llama4_attention.refuse_split(self.cfg)
        gemma4.refuse_split(self.cfg)
        per_layer = gemma4.per_layer_inputs(self, input_ids, x) \
            if self.cfg.per_layer_input_size else None
        x, new_cache, reports = on_split(x, allowed), [], []
        lengths = self._document_lengths(segment_ids, allowed)
        with as_laid_out(self.moe_weights()):  # experts split over dp: expert parallel
            if self.runs is not None and deepstack is None \
                    and full_allowed is allowed:  # scanned, the cache too

                def step(layer, h, layer_cache):
                    return layer(h, positions, allowed, layer_cache, cache_index, lengths,
                                 segment_ids)
                x, new_cache, reports = layer_scan.run(self.layers, self.runs, step, x, cache,
                                                       self.cfg.scan_unroll)
            else:
                for i, layer in enumerate(self._each_layer()):
                    source = self.cfg.kv_source(i)  # (Gemma 4: its cache, or keys, shared)
                    x, layer_cache, report = layer(
                        x, positions, allowed if self.cfg.sliding(i) else full_allowed,
                        cache and cache[i] if source is None
                        else new_cache[source], cache_index, lengths, segment_ids,
                        None if per_layer is None else per_layer[:, :, i])
                    new_cache.append(layer_cache)
                    reports.append(report)
                    if deepstack is not None and i < len(deepstack):  # (Qwen3-VL's images)
                        x = x + deepstack[i].astype(x.dtype)
        return (in_order(self.norm(x), allowed), new_cache if cache is not None else None,
                experts_report([r for r in reports if r]))

    def _each_layer(self):
        """Every layer in order (a stacked one's slice: ``layer_scan.each_layer``)."""
        return self.layers if self.runs is None else layer_scan.each_layer(self.layers, self.runs)

    def moe_weights(self) -> list:
        """``(path, leaf)`` of the MoE blocks' params (the MLP's, or Gemma 4's beside it; none
        for a dense model; stacked ones for stacked layers)."""
        layers = self.layers.items() if self.runs is not None else enumerate(self.layers)
        return [(f"{i}/{path}", leaf) for i, layer in layers
                for block in (getattr(layer, "mlp", None), getattr(layer, "moe", None))
                if isinstance(block, MoE)
                for path, leaf in named_leaves(nnx.state(block, nnx.Param))]

    def _document_lengths(self, segment_ids, allowed):
        """Each token's document length in packed rows, for a RoPE that depends on the length
        (a document computes what it computes alone); ``None`` otherwise."""
        ropes = [r for r in (self.cfg.rope, self.cfg.local_rope) if r is not None]
        if segment_ids is None or not any(depends_on_length(r) for r in ropes):
            return None
        if isinstance(allowed, SplitSequence):
            raise ValueError(f"Packed rows under context parallelism with {self.cfg.rope.kind} "
                             "RoPE (its frequencies depend on each document's length) are not "
                             "supported: pack without context parallelism, or split unpacked "
                             "rows.")
        return segment_lengths(segment_ids)


def refuse_for_images(inputs_embeds, blocks, segment_ids, cache_index) -> None:
    """What a vision-language model's inputs (``inputs_embeds``; ``blocks`` of tokens that see
    each other both ways) do not support yet, refused before compiling."""
    if (inputs_embeds is not None or blocks is not None) and \
            sequence_split.current() is not None:
        raise ValueError("Input embeddings (a vision-language model's image features) under "
                         "context parallelism are not supported yet: run with "
                         "n_context_shards=1.")
    if blocks is not None and (segment_ids is not None or not isinstance(cache_index, int)
                               or cache_index != 0):
        raise ValueError("Bidirectional image blocks apply to a whole unpacked prompt read from "
                         "slot 0 (or a training row): not with packed rows (segment_ids) or a "
                         "cache past slot 0.")


def experts_report(reports: list[dict]) -> dict:
    """The MoE blocks' reports (``MoE.report``'s scalars, one per block or stacked over a
    scanned run's blocks) as the model's:
    ``moe/aux_loss`` summed over blocks (what the loss adds), the rest averaged over them, and
    the worst block's load imbalance (``moe/load_cv_max``); empty for a dense model."""
    if not reports:
        return {}
    stacked = {k: jnp.concatenate([jnp.reshape(r[k], (-1,)) for r in reports])  # (scanned:
               for k in reports[0]}  # a report's leaves stacked over its layers)
    report = {f"moe/{k}": jnp.mean(v) for k, v in stacked.items() if k != "aux_loss"}
    return {**report, "moe/aux_loss": jnp.sum(stacked["aux_loss"]),
            "moe/load_cv_max": jnp.max(stacked["load_cv"])}


def softcap(x, cap: float | None):
    return x if cap is None else cap * jnp.tanh(x / cap)


class DecoderLM(nnx.Module):
    """A causal LM of any family in ``redco_zoo_models.families``."""
    config_class = DecoderConfig

    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.model = DecoderModel(cfg, rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Linear(cfg.hidden_size, cfg.vocab_size, use_bias=False, rngs=rngs)
        init_like_hf(self, cfg, rngs)  # as transformers draws the family from scratch
        if cfg.scan_layers:
            self.model.stack_layers()

    def head(self):
        """The output head's (hidden, vocab) matrix."""
        return self.model.embed_tokens.embedding[...].T if self.cfg.tie_word_embeddings \
            else self.lm_head.kernel[...]

    def __call__(self, input_ids, attention_mask=None, cache=None, cache_index=0,
                 segment_ids=None, labels=None, label_mask=None, return_metrics=False,
                 inputs_embeds=None, blocks=None, positions=None, deepstack=None):
        """Logits ``(B, T, vocab)`` for token ids ``(B, T)``; with a ``cache`` (``init_cache``),
        ``(logits, cache)``. ``attention_mask`` marks real tokens (1) and padding (0) over the
        input, or with a cache over all of its slots; ``segment_ids`` (B, T) pack documents into
        rows, none seeing another (see ``redco_zoo_models.attention``). Given ``labels`` (B, T),
        the mean cross-entropy of predicting them (where ``label_mask``) instead, a chunk of
        tokens at a time: the logits never exist whole (``redco_zoo_models.chunked_loss``);
        an MoE model adds its blocks' weighted load-balancing losses. With ``return_metrics``,
        ``(that, metrics)``: an MoE model's ``experts_report`` (the logits alone carry no
        balancing loss: add ``metrics["moe/aux_loss"]`` to yours), ``{}`` for a dense one.
        ``inputs_embeds`` (B, T, hidden): the inputs' embeddings, read instead of looking
        ``input_ids`` up (a vision-language model's, with image features in them); ``blocks``
        (B, T): tokens of one block (id >= 0; -1: none) also see each other both ways
        (``attention.with_blocks``: Gemma 3's images); ``positions``: the tokens' RoPE positions
        instead of their places in the row (M-RoPE's (3, B, T): Qwen2.5-VL's images);
        ``deepstack``: (B, T, hidden) arrays, the i-th added to the hidden states after layer i
        (Qwen3-VL's image features at its image tokens, zeros elsewhere)."""
        x, cache, metrics = self.model(input_ids, attention_mask, cache, cache_index,
                                       segment_ids, inputs_embeds, blocks, positions, deepstack)
        if self.cfg.logits_scaling != 1.0:  # (Granite: logits / logits_scaling)
            x = x / jnp.asarray(self.cfg.logits_scaling, x.dtype)
        if self.cfg.lm_head_multiplier != 1.0:  # (Falcon-H1: logits times it)
            x = x * jnp.asarray(self.cfg.lm_head_multiplier, x.dtype)
        if labels is not None:
            out = next_token_loss(x, self.head(), labels, label_mask,
                                  softcap=self.cfg.final_softcap)
            if metrics:
                out = out + metrics["moe/aux_loss"].astype(out.dtype)
        else:
            logits = x @ self.head().astype(x.dtype) if self.cfg.tie_word_embeddings \
                else self.lm_head(x)
            logits = softcap(logits, self.cfg.final_softcap)
            out = logits if cache is None else (logits, cache)
        return (out, metrics) if return_metrics else out

    def decode(self, ids, key_valid, cache, cache_index, context=None):
        """One generation step (``redco_zoo_models.generation``)."""
        return self(ids, attention_mask=key_valid, cache=cache, cache_index=cache_index)

    def rereads_at(self) -> int | None:
        """The slot at which generation reads the whole sequence again: a ``longrope`` model's
        factors switch past its original context (transformers' Phi-3 does the same), so the
        cache of every layer is recomputed with the new ones. ``None``: never."""
        ropes = [r for r in (self.cfg.rope, self.cfg.local_rope) if r is not None]
        switching = [r.get("original_max_position_embeddings") for r in ropes
                     if r.kind == "longrope"]
        return min(switching) if switching else None

    def init_cache(self, batch: int, n_slots: int, dtype=jnp.float32) -> list[dict]:
        """An empty cache (``redco_zoo_models.attention``). Latent attention's holds one
        shared key a slot, its latent, and no values (``redco_zoo_models.mla``); a Mamba2
        layer's, its fixed-size state (``redco_zoo_models.mamba2.init_cache``)."""
        cfg = self.cfg
        if cfg.kv_lora_rank:
            return init_cache(cfg.num_hidden_layers, batch, n_slots, 1, latent_width(cfg), dtype,
                              values=False)
        attention = lambda i: {} if cfg.kv_source(i) is not None else init_cache(  # noqa: E731
            1, batch, n_slots, *reversed(cfg.attention_shape(i)), dtype)[0]  # (Gemma 4: shared)
        ssm = lambda i: mamba2.init_cache(batch, cfg.mamba, dtype)  # noqa: E731
        states = {Mixer.MAMBA2: ssm,  # (a linear layer's: a fixed-size state, no slots)
                  Mixer.GATED_DELTANET: lambda i: init_state(cfg.delta_net(), batch, dtype),
                  Mixer.ATTENTION: attention, Mixer.NONE: lambda i: {},  # (Nemotron-H's MLPs)
                  Mixer.PARALLEL: lambda i: {"attention": attention(i), "mamba": ssm(i)}}
        return [states[cfg.mixer(i)](i) for i in range(cfg.num_hidden_layers)]

    def hf_tensors_in(self, tensors: dict) -> dict:
        """A checkpoint's tensors under this model's names (fused ones split)."""
        return family_tensors.tensors_in(self.cfg, tensors)

    def hf_tensors_out(self, tensors: dict) -> dict:
        """This model's tensors under its family's checkpoint names (fused where it fuses)."""
        return family_tensors.tensors_out(self.cfg, tensors)

