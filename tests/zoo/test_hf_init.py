"""``redco_zoo_models.hf_init`` on params stacked over a leading layer axis (a scanned stack of
layers), and its refusal of a param no rule names. transformers' own statistics per family:
tests/zoo_parity/test_parity_init.py."""
import math

import numpy as np
import pytest
from flax import nnx

from redco.tree_paths import named_leaves
from redco_zoo_models import LlamaConfig
from redco_zoo_models.decoder import DecoderLayer
from redco_zoo_models.hf_init import init_like_hf
from redco_zoo_models.toy import TINY_FAMILIES

LAYERS, STD = 3, 0.05


class Stack(nnx.Module):
    """``model/layers/...``: one ``DecoderLayer`` whose params carry a leading layer axis."""

    def __init__(self, cfg, rngs):
        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return DecoderLayer(cfg, 0, rngs)
        self.layers = make(rngs)


@pytest.mark.parametrize("family", ["llama-3.1", "gemma2"])
def test_stacked_layers_draw_as_unstacked_ones(family):
    """Kernels ``N(0, initializer_range)`` (std within 5 standard errors, ``s/sqrt(2n)``), over
    every layer's slice; norm scales 1, Gemma's 0 (it scales by ``1 + w``)."""
    cfg = LlamaConfig.from_hf(dict(TINY_FAMILIES[family], initializer_range=STD))
    stack = Stack(cfg, nnx.Rngs(0))
    init_like_hf(stack, cfg, nnx.Rngs(1))
    leaves = named_leaves(nnx.state(stack, nnx.Param))
    assert leaves and all(leaf.shape[0] == LAYERS for _, leaf in leaves)
    for path, leaf in leaves:
        for layer in np.asarray(leaf):
            if path.endswith("norm/weight"):
                assert np.all(layer == 1.0 - cfg.norm_offset), path
            else:
                assert abs(layer.std() - STD) < 5 * STD / math.sqrt(2 * layer.size), path


def test_a_param_without_a_rule_is_refused_by_name():
    class Odd(nnx.Module):
        def __init__(self):
            self.mystery = nnx.Param(np.zeros(3, np.float32))
    cfg = LlamaConfig.from_hf(TINY_FAMILIES["llama-3.1"])
    with pytest.raises(ValueError, match="mystery.*hf_init.RULES"):
        init_like_hf(Odd(), cfg, nnx.Rngs(0))
