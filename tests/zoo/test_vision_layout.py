"""The vision towers and projectors of the image-text models split as the text decoder does:
under ``auto`` (dp 4 x mp 2) attention q/k/v on their heads (column), o on its input (row), the
MLP column then row, the projector likewise (a patch embedding read by a matmul stays whole:
it starts the tower's residual stream); ``auto+fsdp`` adds ``dp`` on a free dim. A Qwen2.5-VL
step (the planner's own loss: ``redco_planner.vision``) trains as on one device under both. The
planner's plans of the published shapes: BENCHMARKS.md section 44."""
import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from redco import Deployer, Trainer
from redco.sharding import dataflow_trace, named_leaves, specs_from_rules
from redco_zoo_models.gemma3_vision import Gemma3ForConditionalGeneration, Gemma3VisionConfig
from redco_zoo_models.hf import with_changes
from redco_zoo_models.llama4_vision_config import Llama4ImageConfig
from redco_zoo_models.llava import LlavaConfig, LlavaForConditionalGeneration
from redco_zoo_models.presets_vlm import IMAGES, RowImage, vlm_preset
from redco_zoo_models.qwen_vl import QwenVLForConditionalGeneration
from redco_zoo_models.qwen_vl_config import QwenVLConfig

TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8)
TOWER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             image_size=16, patch_size=4)
COL, ROW, WHOLE = P(None, "mp"), P("mp", None), P()
QWEN_IMAGE, SEQ = RowImage(16, 16, 4), 12  # (a 16 x 16 image: 4 x 4 patches, 4 tokens)


def qwen():
    cfg = QwenVLConfig.from_hf({
        "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64,
                          "num_heads": 4, "patch_size": 4, "window_size": 8,
                          "out_hidden_size": 32, "fullatt_block_indexes": [1]},
        "text_config": {**TEXT, "rope_parameters": {"rope_type": "default",
                                                     "mrope_section": [1, 1, 2]}},
        "image_token_id": 60, "vision_start_token_id": 58, "vision_end_token_id": 59})
    return cfg, QwenVLForConditionalGeneration(cfg, nnx.Rngs(0))


def qwen_rows() -> list[dict]:
    """8 rows, each the template (start, 4 image tokens, end) then text, and its patches."""
    rng = np.random.RandomState(0)
    ids = rng.randint(1, 50, (8, SEQ + 1)).astype(np.int32)
    ids[:, 0], ids[:, 1:5], ids[:, 5] = 58, 60, 59
    pixels = rng.randn(8, 16, 96).astype(np.float32)
    return [{"input_ids": i, "pixel_values": p} for i, p in zip(ids, pixels)]


def specs_of(params, **deployer) -> dict:
    return {p: s.spec for p, s in named_leaves(params(**deployer))}


def test_a_qwen_vl_tower_splits_and_trains_as_on_one_device():
    """Spec by spec under ``auto`` and ``auto+fsdp`` at dp 4 x mp 2 (before: the whole tower
    replicated, its patch-embedding matmul taking q/k/v as its row partner), and two SGD steps
    of each give one device's params to 1e-5."""
    from redco_planner.vision import qwen_loss
    cfg, model = qwen()
    graphdef, params = nnx.split(model, nnx.Param)
    loss = qwen_loss(graphdef, cfg, QWEN_IMAGE, SEQ)
    collate = lambda rows: {k: np.stack([r[k] for r in rows]) for k in rows[0]}  # noqa: E731

    def trained(**deployer):
        trainer = Trainer(Deployer(jax_seed=0, workdir=None, verbose=False, **deployer),
                          collate, None, lambda rng, state, p, b, train: loss(p, b), params,
                          optax.sgd(0.5))
        trainer.train_epoch(qwen_rows() * 2, 8 // trainer.deployer.dp_size, 0)
        specs = {p: s.spec for p, s in named_leaves(trainer.state_shardings.params)}
        return jax.device_get(trainer.params), specs

    one, _ = trained(n_local_devices=1)
    for rules, dp in (("auto", None), ("auto+fsdp", "dp")):
        many, specs = trained(n_model_shards=2, sharding_rules=rules)
        block = {k[len("visual/blocks/0/"):]: v for k, v in specs.items()
                 if k.startswith("visual/blocks/0/")}
        want = {"attn/qkv/kernel": P(dp, "mp"), "attn/qkv/bias": P("mp"),
                "attn/proj/kernel": P("mp", dp), "mlp/gate_proj/kernel": P(dp, "mp"),
                "mlp/up_proj/kernel": P(dp, "mp"), "mlp/down_proj/kernel": P("mp", dp)}
        assert {k: block[k] for k in want} == want, (rules, block)
        assert specs["visual/merger/fc1/kernel"] == P(dp, "mp"), rules
        assert specs["visual/merger/fc2/kernel"] == P("mp", dp), rules
        assert specs["visual/patch_embed/proj/kernel"] == (P(dp, None) if dp else WHOLE)
        for a, b in zip(jax.tree.leaves(many), jax.tree.leaves(one)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def rules_specs(model, batch, call, rules: str) -> dict:
    """The specs a ``Deployer`` at dp 4 x mp 2 gives ``model``, read off ``call``'s dataflow."""
    graphdef, params = nnx.split(model, nnx.Param)
    loss = lambda p, b: call(nnx.merge(graphdef, p), b)  # noqa: E731
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), batch)
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=None, verbose=False,
                        sharding_rules=rules)
    found = deployer.get_sharding_rules(params, trace_fn=dataflow_trace(loss, abstract))
    return dict(named_leaves(specs_from_rules(params, found, deployer.mesh)))


@pytest.mark.parametrize("family", ["llava", "gemma3"])
def test_clip_and_siglip_towers_and_projectors_split_by_heads_and_hidden(family):
    """LLaVA's CLIP tower and two-layer projector, Gemma 3's SigLIP tower and its projection
    matrix (column: its features are gathered where they are placed); the patch embedding (a
    conv) whole under ``auto``, split over ``dp`` by ``auto+fsdp``. Gemma 3's with
    ``scan_layers``: its two tower layers one stack (``layers/0:2``, the same Layer class as
    LLaVA's unrolled ones), each spec one layer's behind the unsplit layer axis."""
    vision = {"model_type": "clip_vision_model" if family == "llava" else
              "siglip_vision_model", **TOWER}
    if family == "llava":
        cfg = LlavaConfig.from_hf(dict(vision_config={**vision, "num_hidden_layers": 2},
                                       image_token_index=60, image_seq_length=16,
                                       text_config=dict(model_type="llama", **TEXT)))
        model, tokens = LlavaForConditionalGeneration(cfg, nnx.Rngs(0)), 16
    else:
        cfg = with_changes(Gemma3VisionConfig.from_hf(dict(
            vision_config={**vision, "num_hidden_layers": 2}, mm_tokens_per_image=4,
            image_token_index=60, boi_token_index=58, eoi_token_index=59,
            text_config=dict(model_type="gemma3_text", **TEXT))), {"scan_layers": True})
        model, tokens = Gemma3ForConditionalGeneration(cfg, nnx.Rngs(0)), 4
    ids = np.ones((8, 24), np.int32)
    ids[:, 2:2 + tokens] = 60
    batch = {"input_ids": ids, "pixel_values": np.zeros((8, 1, 3, 16, 16), np.float32)}
    call = lambda m, b: m(b["input_ids"], pixel_values=b["pixel_values"],  # noqa: E731
                          labels=b["input_ids"])
    for rules, dp in (("auto", None), ("auto+fsdp", "dp")):
        specs = rules_specs(model, batch, call, rules)
        layer, axis = "vision_tower/encoder/layers/0:2/", (None,)  # (stacked: the layer axis whole)
        for name in ("q_proj", "k_proj", "v_proj"):
            assert specs[f"{layer}self_attn/{name}/kernel"] == P(*axis, dp, "mp"), (rules, name)
        assert specs[f"{layer}self_attn/out_proj/kernel"] == P(*axis, "mp", dp), rules
        assert specs[f"{layer}mlp/fc1/kernel"] == P(*axis, dp, "mp"), rules
        assert specs[f"{layer}mlp/fc2/kernel"] == P(*axis, "mp", dp), rules
        patch = specs["vision_tower/embeddings/patch_embedding/kernel"]
        assert patch == (P(None, None, None, "dp") if dp else WHOLE), rules
        if family == "llava":
            assert specs["multi_modal_projector/linear_1/kernel"] == P(dp, "mp"), rules
            assert specs["multi_modal_projector/linear_2/kernel"] == P("mp", dp), rules
        else:
            want = P(dp, "mp")
            assert specs["multi_modal_projector/mm_input_projection_weight"] == want, rules


def test_llama4_tower_adapter_and_projector_split_in_the_planners_step(monkeypatch):
    """Llama 4 with images (``llama4_vision``) as the planner builds a preset (a tiny one
    registered): under ``auto`` at dp 4 x mp 2 the tower's q/k/v column, o row, its MLP and the
    pixel-shuffle adapter column then row, the projector column, the patch embedding (a
    matmul) whole; ``auto+fsdp`` adds ``dp`` on a free dim. The published preset reads with
    its card's shapes and 109B parameters (108.64B: the text preset's 107.77B, the tower's
    0.85B, the projector's 0.02B), its one 336 x 336 tile a row 144 tokens."""
    from redco_planner.vision import zoo_vlm
    from redco_zoo_models import presets_vlm
    tiny = {"vision_config": {**TOWER, "intermediate_size": 128, "vision_output_dim": 32,
                              "projector_input_dim": 32, "projector_output_dim": 32},
            "text_config": {**TEXT, "model_type": "llama4_text", "interleave_moe_layer_step": 0,
                            "intermediate_size_mlp": 64},
            "image_token_index": 60, "boi_token_index": 58, "eoi_token_index": 59}
    monkeypatch.setitem(presets_vlm.VLM_PRESETS, "tiny-llama4", Llama4ImageConfig.from_hf(
        tiny).to_hf())
    monkeypatch.setitem(presets_vlm.IMAGES, "tiny-llama4", RowImage(16, 16, 4))
    model = zoo_vlm("tiny-llama4", SEQ)
    for rules, dp in (("auto", None), ("auto+fsdp", "dp")):
        deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=None, verbose=False,
                            sharding_rules=rules)
        found = deployer.get_sharding_rules(model.params, trace_fn=dataflow_trace(
            model.loss_fn, model.batch(8)))
        specs = dict(named_leaves(specs_from_rules(model.params, found, deployer.mesh)))
        layer = "vision_model/model/layers/0/"
        want = {"self_attn/q_proj": COL, "self_attn/k_proj": COL, "self_attn/v_proj": COL,
                "self_attn/o_proj": ROW, "mlp/fc1": COL, "mlp/fc2": ROW}
        for name, spec in want.items():
            assert specs[f"{layer}{name}/kernel"] == with_dp(spec, dp), (rules, name)
        adapter = "vision_model/vision_adapter/mlp/"
        assert specs[f"{adapter}fc1/kernel"] == with_dp(COL, dp), rules
        assert specs[f"{adapter}fc2/kernel"] == with_dp(ROW, dp), rules
        assert specs["multi_modal_projector/linear_1/kernel"] == with_dp(COL, dp), rules
        patch = specs["vision_model/patch_embedding/linear/kernel"]
        assert patch == (P("dp", None) if dp else WHOLE), rules
    check_scout_vision_preset()


def with_dp(spec, dp):
    """``spec`` (one ``mp`` dim of two) with ``dp`` on the other."""
    return P(*(dp if axis is None else axis for axis in spec))


def check_scout_vision_preset():
    """The shapes of Llama-4-Scout-17B-16E-Instruct's card, its one-tile row, its count (the
    layers' parameters from abstract builds of one and two layers of each part)."""
    from redco_zoo_models.llama4_vision import Llama4ForConditionalGeneration
    config = vlm_preset("llama-4-scout-vision")
    cfg = Llama4ImageConfig.from_hf(config)
    tower = cfg.vision
    assert (tower.num_hidden_layers, tower.hidden_size, tower.num_attention_heads,
            tower.image_size, tower.patch_size, tower.pixel_shuffle_ratio) == \
        (34, 1408, 16, 336, 14, 0.5)
    assert (cfg.text.hidden_size, cfg.text.num_hidden_layers, cfg.image_token_index) == \
        (5120, 48, 200092)
    assert IMAGES["llama-4-scout-vision"] == RowImage(336, 24 * 24, cfg.features_per_image())

    def count(text: int, vision: int) -> int:
        part = {**config, "text_config": {**config["text_config"], "num_hidden_layers": text},
                "vision_config": {**config["vision_config"], "num_hidden_layers": vision}}
        small = Llama4ImageConfig.from_hf(part)
        model = nnx.eval_shape(lambda: Llama4ForConditionalGeneration(small, nnx.Rngs(0)))
        return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    one = count(1, 1)
    total = one + 47 * (count(2, 1) - one) + 33 * (count(1, 2) - one)
    assert abs(total / 109e9 - 1) < 0.02, total


def test_redco_plan_takes_an_image_text_preset(monkeypatch, capsys):
    """``redco plan --preset`` builds an image-text preset whole (tower, projector, language
    model; here a tiny Qwen2.5-VL registered as one) and walks its layouts, each measured by
    its state alone (16 KB devices: nothing fits, nothing compiles); the published ones:
    BENCHMARKS.md section 44 (bench/family_table.py)."""
    from redco.cli import main
    from redco_zoo_models import presets_vlm
    monkeypatch.setitem(presets_vlm.VLM_PRESETS, "tiny-qwen-vl", qwen()[0].to_hf())
    monkeypatch.setitem(presets_vlm.IMAGES, "tiny-qwen-vl", QWEN_IMAGE)
    with pytest.raises(SystemExit, match="No layout fits 16.00 KiB per device"):
        main(["plan", "--preset", "tiny-qwen-vl", "--devices", "8", "--device_memory", "16KB",
              "--seq_len", str(SEQ), "--scan_layers", "--n_context_shards", "1"])
    out = capsys.readouterr().out
    states = [float(line.split("alone are ")[1].split()[0]) for line in out.splitlines()
              if "state alone" in line]
    assert "tiny-qwen-vl (layers stacked and scanned): 8 devices x 16KB" in out, out
    # mp=2 auto holds 0.53 of mp=1's state: the tower (most of this model) is split too (0.85
    # with the tower replicated)
    assert len(states) == 8 and states[2] < 0.6 * states[0], out
