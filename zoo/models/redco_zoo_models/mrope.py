"""M-RoPE's positions (Qwen2.5-VL, Qwen3-VL): three per token (temporal, height, width), from
the prompt and its images' grids, as transformers' ``get_rope_index`` makes them.

In each row, left padding skipped (its positions 0), a text token's three positions are equal
and one past the previous token's largest; a run of image tokens (one image: ``frames x rows
x columns`` merged tokens, ``image_grid_thw`` divided by ``spatial_merge_size`` on its
sides) starts at the next position ``p``: its token at (frame, row, column) is at ``(p + frame,
p + row, p + column)``, and the text after it resumes at ``p + max(rows, columns)``. A row's
``delta``, its largest position + 1 minus its number of tokens, places generated tokens: the
token in slot ``s`` (left padding not counted) is at ``s + delta`` on all three axes. How each
pair of a head's features reads the three: ``redco_zoo_models.rope``.

Made on the host (numpy) from concrete ids: a jitted step takes them as an input.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from redco_zoo_models.attention import decoder_inputs


def image_positions(start: int, grid, merge: int) -> np.ndarray:
    """(3, tokens) positions of one image's run of tokens starting at ``start``."""
    t, h, w = int(grid[0]), int(grid[1]) // merge, int(grid[2]) // merge
    return start + np.stack(np.meshgrid(np.arange(t), np.arange(h), np.arange(w),
                                        indexing="ij")).reshape(3, -1)


def row_positions(ids: np.ndarray, image_token: int, grids, merge: int) -> np.ndarray:
    """(3, len(ids)) positions of one row's real tokens; ``grids`` an iterator over the batch's
    image grids, the next ones taken by this row's images in order."""
    out, i, next_pos = [], 0, 0
    while i < len(ids):
        if ids[i] != image_token:
            out.append(np.full((3, 1), next_pos))
            i, next_pos = i + 1, next_pos + 1
            continue
        grid = next(grids, None)
        n = 0 if grid is None else int(np.prod(grid)) // merge ** 2
        if grid is None or not np.all(ids[i:i + n] == image_token):
            raise ValueError("input_ids' image tokens do not match image_grid_thw: each image "
                             "needs frames x rows x columns / spatial_merge_size^2 image tokens "
                             "in a run; build the prompt with the model's processor.")
        out.append(image_positions(next_pos, grid, merge))
        i, next_pos = i + n, next_pos + max(int(grid[1]), int(grid[2])) // merge
    return np.concatenate(out, 1) if out else np.zeros((3, 0), np.int64)


def rope_index(input_ids, attention_mask, image_grid_thw, image_token: int,
               merge: int) -> tuple[np.ndarray, np.ndarray]:
    """``(positions (3, B, T), deltas (B,))`` of a batch (module docstring)."""
    ids = np.asarray(input_ids)
    valid = np.ones(ids.shape, bool) if attention_mask is None else np.asarray(attention_mask) > 0
    grids = iter(np.zeros((0, 3)) if image_grid_thw is None else np.asarray(image_grid_thw))
    positions, deltas = np.zeros((3, *ids.shape), np.int32), np.zeros(len(ids), np.int32)
    for b, (row, keep) in enumerate(zip(ids, valid)):
        got = row_positions(row[keep], image_token, grids, merge)
        positions[:, b, keep] = got
        deltas[b] = (got.max() + 1 if got.size else 0) - keep.sum()
    if next(grids, None) is not None:
        raise ValueError("image_grid_thw has more images than input_ids has runs of image "
                         "tokens; build the prompt with the model's processor.")
    return positions, deltas


def decode_positions(key_valid, cache_index, n: int, deltas):
    """(3, B, n): the positions of ``n`` tokens written at ``cache_index`` into a cache whose
    valid slots are ``key_valid`` (B, slots): their place in the row plus the row's delta."""
    places, _ = decoder_inputs(key_valid.shape[0], n, key_valid, True, cache_index)
    return jnp.broadcast_to(places + deltas[:, None], (3, *places.shape))
