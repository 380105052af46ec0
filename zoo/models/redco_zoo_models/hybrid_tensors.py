"""Granite 4 hybrid's checkpoint tensors under the zoo decoder's names, and back
(``family_tensors`` calls these for a ``hybrid`` family).

* A Mamba2 layer's ``mamba.conv1d.weight`` is PyTorch's depthwise ``Conv1d`` weight
  (channels, 1, K); the zoo keeps (channels, K) (``redco_zoo_models.mamba2``).
* The MLP every token goes through, ``shared_mlp``, fuses its gate and up projections in
  ``input_linear`` (gate the first half of its rows, up the second) and names the down
  projection ``output_linear``. Without experts it is the zoo layer's gated ``mlp``; with
  experts, the MoE block's ``mlp.shared_experts``.
* The experts (``block_sparse_moe``) are stored stacked, as the hub's checkpoints and
  transformers' ``save_pretrained`` write them: ``input_linear`` (experts, 2 x size, hidden),
  gate then up, and ``output_linear`` (experts, hidden, size), both (out, in) per expert; the
  zoo's are (experts, in, out). The router is ``block_sparse_moe.router.layer``, the zoo's
  ``mlp.gate``.
"""
from __future__ import annotations

import numpy as np

from redco_zoo_models.decoder_config import Mixer

CONV = "mamba.conv1d.weight"


def _names(cfg, i: int) -> dict:
    """Layer ``i``'s ``{checkpoint name: the zoo's}`` of the renamed or fused tensors."""
    theirs, ours = f"model.layers.{i}", f"model.layers.{i}.mlp"
    shared = f"{ours}.shared_experts" if cfg.sparse(i) else ours
    names = {f"{theirs}.shared_mlp.input_linear.weight": (f"{shared}.gate_proj.weight",
                                                          f"{shared}.up_proj.weight"),
             f"{theirs}.shared_mlp.output_linear.weight": (f"{shared}.down_proj.weight",)}
    if cfg.sparse(i):
        moe = f"{theirs}.block_sparse_moe"
        names.update({f"{moe}.router.layer.weight": (f"{ours}.gate.weight",),
                      f"{moe}.input_linear.weight": (f"{ours}.experts.gate_proj",
                                                     f"{ours}.experts.up_proj"),
                      f"{moe}.output_linear.weight": (f"{ours}.experts.down_proj",)})
    return names


def take(tensors: dict, name: str, cfg) -> np.ndarray:
    """Pop checkpoint tensor ``name``, or say it is missing (``family_tensors`` takes it too)."""
    if name not in tensors:
        raise KeyError(f"the checkpoint has no tensor {name}; is it a {cfg.family} checkpoint "
                       "of this config.json?")
    return tensors.pop(name)


def tensors_in(cfg, tensors: dict) -> dict:
    """A Granite 4 hybrid checkpoint's tensors under the zoo's names."""
    tensors = dict(tensors)
    for i in range(cfg.num_hidden_layers):
        if cfg.mixer(i) == Mixer.MAMBA2:
            name = f"model.layers.{i}.{CONV}"
            tensors[name] = take(tensors, name, cfg)[:, 0, :]
        for stored, ours in _names(cfg, i).items():
            parts = np.split(take(tensors, stored, cfg), len(ours), axis=-2)
            if ".block_sparse_moe.i" in stored or ".block_sparse_moe.o" in stored:
                parts = [p.transpose(0, 2, 1) for p in parts]
            tensors.update(zip(ours, parts))
    return tensors


def tensors_out(cfg, tensors: dict) -> dict:
    """``tensors_in`` undone: the checkpoint's names and layout."""
    tensors = dict(tensors)
    for i in range(cfg.num_hidden_layers):
        if cfg.mixer(i) == Mixer.MAMBA2:
            name = f"model.layers.{i}.{CONV}"
            tensors[name] = tensors[name][:, None, :]
        for stored, ours in _names(cfg, i).items():
            parts = [tensors.pop(n) for n in ours]
            if ".block_sparse_moe.i" in stored or ".block_sparse_moe.o" in stored:
                parts = [p.transpose(0, 2, 1) for p in parts]
            tensors[stored] = np.concatenate(parts, axis=-2)
    return tensors
