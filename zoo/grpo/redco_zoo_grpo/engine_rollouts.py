"""GRPO's rollouts on the continuous-batching engine (``redco_zoo_models.engine``), over the
trainer's own params, with no second copy of the weights.

Where they decode: by default on a decode layout of their own
(``redco_zoo_models.decode_layout``: tensor parallelism without FSDP's per-step gathers,
replicas over the other devices), the smallest tensor-parallel degree whose compiled decode
step fits a device (degree 1, all replicas, where the devices report no memory, as CPUs do);
or on a degree given (``decode_model_shards``); or, with ``decode_model_shards=None``, on the
training layout itself (every decode step then gathers FSDP-split weights again). For a
rollout the trainer's params are moved onto the decode layout leaf by leaf, each training leaf
freed once its copy has landed (``decode_layout.to_layout``), and moved back the same way after
it, onto the training shardings the compiled train step expects: the model is never held twice
(one leaf at most), so the memory a rollout adds is the decode layout's share of the weights
less the training layout's. The values make the round trip unchanged (a copy, no arithmetic).

Every prompt's G samples share one prefill, and a completion that ends at its EOS frees its
row for the next at once, where the fixed-batch sampler runs every row to ``max_new_tokens``.
Each prompt samples with a seed of its own, from the run's seed, the round and the prompt's
place in the round, so a resumed run draws what the uninterrupted one drew. An image prompt
(``image_prompts.py``) is submitted with its images (``engine_images``); the engine holds
``max_images`` a prompt (a Qwen-VL one's patches padded to ``max_image_patches``)."""
from __future__ import annotations

import jax
import numpy as np

from redco_zoo_models.decode_layout import DecodeLayout, choose_decode_layout, to_layout
from redco_zoo_models.engine import Engine
from redco_zoo_models.requests import Sampling


def decode_layout_of(trainer, model, rows: int, max_len: int,
                     decode_model_shards: int | str | None,
                     devices: list | None = None) -> DecodeLayout | None:
    """The layout rollouts decode on over ``devices`` (default: the trainer's; module
    docstring); None: the training layout."""
    if decode_model_shards is None:
        return None
    devices = devices or trainer.deployer.devices
    stats = jax.local_devices()[0].memory_stats() or {}  # (another process's: not readable)
    layout = choose_decode_layout(
        model, trainer.params, devices, rows, max_len, stats.get("bytes_limit"),
        degrees=None if decode_model_shards == "auto" else (int(decode_model_shards),))
    trainer.deployer.log_info(f"GRPO rollouts: {layout.describe()}")
    return layout


def image_slots(prompt: dict) -> dict:
    """The engine's image keywords for the run's prompts (``prompt`` one of them; ``{}`` for
    text): its ``max_images`` and, for Qwen-VL's, ``max_image_patches``."""
    if "image_grid_thw" in prompt:
        return {"max_images": len(prompt["image_grid_thw"]),
                "max_image_patches": len(prompt["pixel_values"])}
    return {"max_images": len(prompt["pixel_values"])} if "pixel_values" in prompt else {}


def engine_images(prompt: dict):
    """``prompt``'s images as the engine takes them (None: a text prompt): its pixels
    (n_images, 3, H, W), or Qwen-VL's real patches and grids (``PatchSlots``)."""
    if "pixel_values" not in prompt:
        return None
    n = int(prompt["n_images"])
    if "image_grid_thw" not in prompt:
        return prompt["pixel_values"][:n]
    grids = prompt["image_grid_thw"][:n]
    return {"pixel_values": prompt["pixel_values"][:int(np.prod(grids, -1).sum())],
            "image_grid_thw": grids}


class EngineRollouts:
    def __init__(self, trainer, model, config, eos_id: int, pad_id: int, rows: int,
                 prompt_width: int, seed: int, decode_model_shards: int | str | None = "auto",
                 devices: list | None = None, max_images: int = 1,
                 max_image_patches: int = 1024):
        self.trainer, self.config, self.pad_id, self.seed = trainer, config, pad_id, seed
        max_len = prompt_width + config.max_new_tokens
        self.layout = decode_layout_of(trainer, model, rows, max_len, decode_model_shards,
                                       devices)
        mesh = trainer.deployer.mesh if self.layout is None else self.layout.mesh
        self.engine = Engine(model, None, max_seqs=rows, max_len=max_len,
                             eos_token_ids=(eos_id,), mesh=mesh, max_images=max_images,
                             max_image_patches=max_image_patches)

    def sample(self, prompts: list[dict], round_: int, greedy: bool):
        """``(tokens, logps)``, (len(prompts) * G, max_new_tokens) each (G = 1 when
        ``greedy``), rows ``i * G ... i * G + G - 1`` prompt ``i``'s; after a completion's EOS,
        pad tokens and log-probability 0, as ``generate`` returns them."""
        self._lend_params()
        try:
            return self.generate(prompts, round_, greedy)
        finally:
            self._take_params_back()

    def generate(self, prompts: list[dict], round_: int, greedy: bool):
        """``sample``'s arrays, on the params the engine holds now."""
        c, n_new = self.config, self.config.max_new_tokens
        sampling = dict(max_tokens=n_new, temperature=0.0) if greedy else dict(
            max_tokens=n_new, temperature=c.temperature, top_k=c.top_k, top_p=c.top_p,
            n=c.n_samples)
        requests = [self.engine.submit(
            [int(t) for t in p["prompt_ids"][p["prompt_mask"]]],
            Sampling(seed=self._seed(round_, i), **sampling),
            images=engine_images(p))
            for i, p in enumerate(prompts)]
        self.engine.run_until_done(requests)
        samples = [s for r in requests for s in r.samples]
        tokens = np.full((len(samples), n_new), self.pad_id, np.int32)
        logps = np.zeros((len(samples), n_new), np.float32)
        for row, s in enumerate(samples):
            tokens[row, :len(s.tokens)], logps[row, :len(s.logprobs)] = s.tokens, s.logprobs
        return tokens, logps

    def _lend_params(self) -> None:
        """The trainer's params to the engine: as they are on the training layout, or moved
        onto the decode layout (the training copy freed leaf by leaf)."""
        if self.layout is None:
            self.engine.params = self.trainer.params
        else:
            self.engine.params = to_layout(self.trainer.state.params, self.layout.shardings)

    def _take_params_back(self) -> None:
        """The engine lets the params go (the next update donates them); off the decode layout
        they move back onto the training shardings (the decode copy freed leaf by leaf)."""
        params, self.engine.params = self.engine.params, None
        if self.layout is not None:
            trainer = self.trainer
            trainer.state = trainer.state.replace(
                params=to_layout(params, trainer.state_shardings.params))

    def _seed(self, round_: int, prompt: int) -> int:
        return int(np.random.SeedSequence([self.seed, round_, prompt]).generate_state(1)[0]
                   % 2 ** 31)
