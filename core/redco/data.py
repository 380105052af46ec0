"""The user's functions and data: calling them by argument name, and checking what they return."""
from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Callable, Sequence

import jax
import numpy as np

RNG_NAMES = ("rng", "train_rng", "pred_rng")


def by_name(fn: Callable, arg_names: tuple[str, ...]) -> Callable:
    """Wrap ``fn`` to take ``arg_names`` positionally and pass only those it declares, by name.

    So ``loss_fn(train_rng, state, params, batch, is_training)``, ``loss_fn(rng, params, batch)``
    and the paper's short ``loss_fn(batch, params)`` all work; the rng may be called ``rng``,
    ``train_rng`` or ``pred_rng``. A function whose required arguments have other names is
    called positionally with all of ``arg_names``.
    """
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return fn
    chosen = {}
    for name, p in parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        canonical = "rng" if name in RNG_NAMES else name
        if canonical in arg_names:
            chosen[name] = arg_names.index(canonical)
        elif p.default is p.empty:
            return fn
    if not chosen:
        return fn
    return lambda *args: fn(**{name: args[i] for name, i in chosen.items()})


def check_collated(batch: Any, batch_size: int) -> Any:
    """Refuse a ``collate_fn`` result that is not a pytree of arrays with ``batch_size`` rows.

    Returns the batch, with a mapping jax does not flatten (e.g. transformers' ``BatchEncoding``)
    turned into a plain dict.
    """
    if isinstance(batch, Mapping) and not isinstance(batch, dict):
        batch = dict(batch)
    leaves = jax.tree_util.tree_flatten_with_path(batch, is_leaf=lambda x: isinstance(x, list))[0]
    if not leaves:
        raise ValueError(f"collate_fn returned {type(batch).__name__} with no arrays in it; "
                         "return a dict of numpy arrays whose first dim is the batch.")
    for path, leaf in leaves:
        where = f"collate_fn output{jax.tree_util.keystr(path)}"
        if not isinstance(leaf, (np.ndarray, jax.Array)):
            raise TypeError(f"{where} is a {type(leaf).__name__}, not an array. Return numpy "
                            "arrays, e.g. np.array(values) after padding to one length.")
        if leaf.dtype == object:
            raise TypeError(f"{where} has dtype object (ragged rows?). Pad every row to the "
                            "same length so it is a regular numeric array.")
        if leaf.dtype.kind in "USV":
            raise TypeError(f"{where} holds strings ({leaf.dtype}): return numbers, e.g. token "
                            "ids from a tokenizer, not text.")
    check_batch_leading(batch, batch_size, "collate_fn output")
    return batch


def check_batch_leading(tree: Any, batch_size: int, what: str) -> None:
    """Raise naming the first leaf of ``tree`` whose first dim is not ``batch_size``."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        shape = np.shape(leaf)
        if len(shape) == 0 or shape[0] != batch_size:
            raise ValueError(f"{what}{jax.tree_util.keystr(path)} has shape {tuple(shape)} but "
                             f"the batch has {batch_size} examples: every array's first dim "
                             "must be the batch (one row per example).")


def n_full_batches(examples: Sequence | int, global_batch_size: int, what: str) -> int:
    """How many full global batches ``examples`` (or that many) hold, or a clear error when
    none, naming what they are made of where they have a ``fingerprint`` (a corpus: tokens)."""
    n_examples = examples if isinstance(examples, int) else len(examples)
    if n_examples == 0:
        raise ValueError(f"{what} is empty: pass a non-empty list of examples.")
    if global_batch_size > n_examples:
        source = getattr(examples, "fingerprint", None)
        raise ValueError(f"The global batch ({global_batch_size} examples) is larger than {what} "
                         f"({n_examples} examples{f': {source}' if source else ''}). Lower "
                         "per_device_batch_size or accumulate_grad_batches, or use fewer "
                         "data-parallel devices.")
    return n_examples // global_batch_size


def cast_floats(tree: Any, dtype: Any) -> Any:
    """``tree`` with its floating-point arrays cast to ``dtype`` (``None``: unchanged)."""
    if dtype is None or tree is None:
        return tree
    floating = jax.numpy.floating
    return jax.tree.map(lambda x: x.astype(dtype) if jax.numpy.issubdtype(x.dtype, floating)
                        else x, tree)


def check_number(name: str, value: Any, low: float, high: float | None = None,
                 integer: bool = True, optional: bool = False) -> Any:
    """``value``, or an error naming ``name``, the value and the allowed range, unless it is a
    number (an integer when ``integer``) in ``[low, high]`` (or None when ``optional``)."""
    if value is None and optional:
        return value
    kinds = (int, np.integer) if integer else (int, float, np.integer, np.floating)
    if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= (
            high if high is not None else value):
        allowed = f">= {low}" if high is None else f"from {low} to {high}"
        raise ValueError(f"{name}={value!r}: use {'an integer' if integer else 'a number'} "
                         f"{allowed}" + (" (or None)" if optional else "") + ".")
    return value


def check_array_leaves(tree: Any, what: str) -> None:
    """Raise naming the first leaf of ``tree`` that is not an array (a Python number, a string)."""
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            raise TypeError(f"{what}{jax.tree_util.keystr(path)} is a {type(leaf).__name__}, not "
                            "an array: make it one, e.g. np.asarray(value, np.float32).")
