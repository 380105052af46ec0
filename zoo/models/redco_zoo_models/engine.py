"""An inference engine with continuous batching: requests join and leave the running batch at
every decode step, on any zoo decoder (``model.init_cache`` and ``model.decode``, as
``redco_zoo_models.generation`` uses them), sharded or not.

The engine holds one key/value cache of ``max_seqs`` rows of ``max_len`` slots; each running
sequence owns a row. A ``step``:

1. **admit**: waiting requests take free rows, first come first served, and their prompts
   are read (up to ``MAX_PREFILL`` at a time, more when short: ``engine_admission``; the rest
   wait while the running rows decode):
   together, in one prefill right-padded to powers of two (so that few shapes compile), each
   into its first row from the slot its row already holds (``engine_reading``): a prompt
   longer than ``prefill_chunk`` is read a chunk a step, and with ``prefix_caching`` a prompt
   starts after a cached prefix (``prefix_cache``) copied from another row. A prompt read
   whole is copied to each of its ``n`` samples' rows: G samples of one prompt share its
   prefill.
2. **decode**: every row's next token at once, each at its own slot (the model's ``decode``
   given a (B,) ``cache_index``: ``redco_zoo_models.attention``) and sampled with its own
   request's temperature, top-k, top-p and key (``fold_in(PRNGKey(seed), sample)``, then the
   token's index): a seeded request samples the same tokens whatever else runs beside it.
   ``steps_per_sync`` tokens are decoded per step before the host looks at them (fewer round
   trips; a row that ends on the way computes the rest for nothing), over the fewest leading
   rows that hold every running sequence (rows are taken lowest first; a power of two of them,
   so that few shapes compile).
3. **finish**: a sample ends at an end-of-sequence or stop token, at ``max_tokens``, when its
   ``on_token`` callback says so (a stop string), or when its request is cancelled; its row is
   free for the next admit.

With ``page_size`` the cache is paged instead: one pool of pages in place of the rows' slots,
a page table per row, pages taken as a sequence grows out of what it reserved at admission
(admission is by free pages: ``engine_admission``, ``pages``), each step gathering the running
rows' pages into the slots the same model code reads (``engine_paged``); a cached prefix is
pages shared by reference (``page_prefix``). A recurrent layer's state is not paged: it stays
a row's own beside the pool.

A recurrent layer (Gated DeltaNet, Mamba2) holds a fixed-size state per row in place of slots:
a padded token leaves it as it was (so the right-padded prefill leaves each row's state after
its last real token, and an idle row's is kept while others decode), and the prefill's copy
into a row replaces the row's old state with the new prompt's.

Each token comes with its log-probability under ``softmax(logits / temperature)`` before any
top-k or top-p cut (untempered when greedy), as ``generate(return_logprobs=True)`` and a training
step compute it. Greedy requests give ``generate``'s tokens.

``step`` runs in the caller's thread (``generate`` steps until its requests end); ``start`` runs
it in a background thread that requests from other threads feed (``redco serve``). What a
request is: ``requests.py``; how many rows fit a device and where the cache lives:
``engine_memory.py``; how each row samples: ``generation.pick_rows``.
"""
from __future__ import annotations

import itertools
import threading
from collections import deque
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from redco_zoo_models.engine_admission import Admission, prompts_per_prefill
from redco_zoo_models.engine_images import check_images, image_context, image_slots
from redco_zoo_models.engine_memory import cache_sharding, on_devices, rows_sharding, vocab_size
from redco_zoo_models.engine_paged import paged_decode, paged_prefill, pool_of
from redco_zoo_models.engine_reading import (
    Reading,
    check_reading,
    chunk_batch,
    prefill_width,
)
from redco_zoo_models.engine_steps import decode_rows, prefill_rows, slotted_leaves
from redco_zoo_models.page_prefix import PagePrefixCache
from redco_zoo_models.pages import paging
from redco_zoo_models.prefix_cache import PrefixCache
from redco_zoo_models.requests import Request, Sampling

MIN_SPAN = 16  # the fewest slots a decode step reads; then x4 (few shapes) up to max_len


class Engine(Admission):
    """Continuous batching over ``model`` with weights ``params`` (``nnx.split``'s params, placed
    as they are: on one device or sharded over ``mesh``, whose ``dp`` axis then splits the
    cache's rows and ``mp`` its key/value heads where they divide). ``prefill_chunk`` (a power
    of two >= 16): prompt tokens read a step at most (None: a prompt at once);
    ``prefix_caching``: prompts start after the longest cached prefix (``prefix_stats``). An
    image + text model's prompts carry up to ``max_images`` images each (``engine_images``;
    Qwen-VL's: their patches padded to ``max_image_patches`` a prompt; Gemma 4's: each image's;
    Idefics3's ``max_images`` counts tiles).
    ``page_size``: the cache is a pool of ``n_pages`` pages of that many slots (default: as many
    slots as ``max_seqs x max_len``), taken as sequences grow (``pages``, ``engine_paged``)."""

    def __init__(self, model: nnx.Module, params: Any, *, max_seqs: int = 8,
                 max_len: int = 256, eos_token_ids: tuple[int, ...] = (),
                 cache_dtype=jnp.float32, mesh=None, steps_per_sync: int = 4,
                 prefill_chunk: int | None = None, prefix_caching: bool = False,
                 max_images: int = 1, page_size: int | None = None, n_pages: int | None = None,
                 max_image_patches: int = 1024):
        if unserved := getattr(model, "unserved", lambda: None)():  # (its reason, named)
            raise NotImplementedError(unserved)
        self.images = image_slots(model, max_images, prefill_chunk, prefix_caching,
                                  max_image_patches)
        at = getattr(model, "rereads_at", lambda: None)()
        if at is not None and at < max_len:
            raise ValueError(f"max_len={max_len} passes slot {at}, where this model's RoPE "
                             "factors switch and generation reads the sequence again; the engine "
                             f"does not: use max_len <= {at}, or generate().")
        slotted = slotted_leaves(model, max_len, cache_dtype)
        check_reading(slotted, prefill_chunk, prefix_caching)
        self.pages = paging(slotted, page_size, n_pages, max_seqs, max_len, self.images)
        self.prefix = None if not prefix_caching else \
            PrefixCache() if self.pages is None else PagePrefixCache(self.pages)
        self.mesh = mesh
        self.graphdef, self.params = nnx.graphdef(model), params
        self.chunk = min(prefill_chunk or max_len, max_len)  # prompt tokens read a step at most
        self.max_seqs, self.max_len, self.eos = max_seqs, max_len, set(eos_token_ids)
        self.cache_dtype, self.steps_per_sync = cache_dtype, steps_per_sync
        cache = model.init_cache(max_seqs, max_len, cache_dtype) if self.pages is None else \
            pool_of(model, slotted, self.pages.n_pages, self.pages.size, max_seqs, cache_dtype)
        self.cache = jax.device_put(cache, cache_sharding(mesh, cache))
        self.key_valid = self._on_rows(jnp.zeros((max_seqs, max_len), bool))
        vocab = vocab_size(model, max_len, cache_dtype)
        self.logits = self._on_rows(jnp.zeros((max_seqs, vocab), jnp.float32))
        self.rows: list[tuple[Request, int] | None] = [None] * max_seqs
        self.slot = np.zeros(max_seqs, np.int32)  # where each row's next token goes
        self.row_keys = np.zeros((max_seqs, 2), np.uint32)
        self.waiting: deque[Request] = deque()
        self.reading: list[Reading] = []  # prompts admitted, not yet read whole
        self.freed = np.zeros(max_seqs, np.int64)  # when each row was freed (prefix caching: LRU)
        self._ticks = itertools.count(1)
        self._lock, self._wake = threading.Lock(), threading.Condition()
        self._thread, self._closing = None, False
        self._seeds = itertools.count(int(np.random.SeedSequence().entropy % 2 ** 31))
        decode = partial(decode_rows if self.pages is None else paged_decode, slotted=slotted)
        self._decode = jax.jit(partial(decode, self.graphdef, steps_per_sync, mesh),
                               donate_argnums=(1, 2, 3), static_argnames=("span",))
        fresh_only = self.chunk == max_len and self.prefix is None  # (every prompt from slot 0)
        self._prefill = jax.jit(partial(prefill_rows, self.graphdef, slotted, fresh_only=fresh_only)
                                if self.pages is None else
                                partial(paged_prefill, self.graphdef, slotted=slotted),
                                donate_argnums=(1, 2, 3))
        self._keys = jax.jit(jax.vmap(lambda seed, sample: jax.random.fold_in(
            jax.random.PRNGKey(seed), sample)))  # each sample's key, for all rows at once

    @property
    def params(self) -> Any:
        """The weights the engine runs."""
        return self._params

    @params.setter
    def params(self, params: Any) -> None:
        """New weights (GRPO lends each round's): the prefixes cached so far hold keys and values
        of the old ones, so they are forgotten. Host (numpy) leaves are put on the devices here,
        once, not copied there again by every step."""
        self._params = on_devices(params, self.mesh)
        if self.prefix is not None:
            self.prefix.clear()

    @property
    def prefix_stats(self) -> dict[str, int]:
        """Prefix caching's counters (``PrefixCache.stats``); empty when it is off."""
        return {} if self.prefix is None else dict(self.prefix.stats)

    # ---- requests ------------------------------------------------------------------------------
    def submit(self, prompt: list[int], sampling: Sampling = Sampling(),
               on_token: Callable[..., bool | None] | None = None,
               on_end: Callable[..., None] | None = None, images=None) -> Request:
        """Queue ``prompt`` (token ids; an image model's: with its ``images``' pixels (n, 3, H,
        W) from the model's processor); refused at once when it cannot fit."""
        if not prompt:
            raise ValueError("The prompt is empty: give at least one token.")
        vocab = self.logits.shape[-1]
        if not all(0 <= t < vocab for t in prompt):
            raise ValueError(f"The prompt holds token ids outside this model's vocabulary "
                             f"(0 to {vocab - 1}): {[t for t in prompt if not 0 <= t < vocab][:5]}.")
        if len(prompt) + sampling.max_tokens > self.max_len:
            raise ValueError(f"The prompt ({len(prompt)} tokens) and max_tokens "
                             f"({sampling.max_tokens}) take {len(prompt) + sampling.max_tokens} "
                             f"slots; this engine's sequences hold {self.max_len}: shorten "
                             "either, or start the engine with a larger max_len.")
        if sampling.n > self.max_seqs:
            raise ValueError(f"n={sampling.n} samples need as many rows; this engine runs "
                             f"{self.max_seqs}: lower n, or raise max_seqs.")
        check_images(self.images, prompt, images)
        self._check_pages(len(prompt), sampling.max_tokens, sampling.n)
        request = Request(prompt, sampling, on_token, on_end, images)
        with self._wake:
            self.waiting.append(request)
            self._wake.notify()
        return request

    def generate(self, prompts: list[list[int]], sampling: Sampling = Sampling()) -> list[Request]:
        """Each prompt run to its end, stepping in this thread (no background thread)."""
        requests = [self.submit(prompt, sampling) for prompt in prompts]
        self.run_until_done(requests)
        return requests

    def run_until_done(self, requests: list[Request]) -> None:
        """Step in this thread until ``requests`` have ended."""
        while not all(r.done.is_set() for r in requests):
            if not self.step():
                raise RuntimeError("The engine has nothing to run but requests have not ended: "
                                   "is it also stepping in a background thread (start)?")

    def warm_up(self) -> int:
        """Compile every prefill and decode shape this engine can meet (prompts read at once x
        padded width; leading rows decoded), by running each on empty rows, so that no request
        waits on a compile. Before the first request only. Returns how many shapes ran."""
        if any(self.rows) or self.waiting:
            raise RuntimeError("warm_up runs on an idle engine, before the first request.")
        reads = self._prefill_shapes()
        for count, width in reads:  # (rows past the last: no writes)
            ids = np.zeros((count, width), np.int32)
            self.cache, self.key_valid, self.logits = self._prefill(
                self.params, self.cache, self.key_valid, self.logits, ids, np.ones(count, np.int32),
                np.zeros(count, np.int32), np.full(count, self.max_seqs, np.int32),
                np.zeros((4, self.max_seqs), np.int32), np.zeros(2, np.int32),
                *self._page_copies([]), *self._pixels([], ids))
        buckets = sorted({self._bucket(row) for row in range(self.max_seqs)})
        spans = sorted({self._span(end) for end in range(self.max_len + 1)})
        for bucket, span in itertools.product(buckets, spans):
            *_, self.logits, self.cache, self.key_valid = self._decode(
                self.params, self.cache, self.key_valid, self.logits,
                np.zeros(bucket, np.int32), np.zeros(bucket, bool),
                np.zeros((3, bucket), np.float32), self.row_keys[:bucket].copy(),
                np.zeros(bucket, np.int32), *self._tables(bucket), span=span)
        jax.block_until_ready(self.cache)
        return len(reads) + len(buckets) * len(spans)

    def _prefill_shapes(self) -> list[tuple[int, int]]:
        """Every (prompts read at once, padded width) a prefill can meet: powers of two of at
        most ``prompts_per_prefill(width)`` prompts and no more than the rows."""
        widths = sorted({self._width(n) for n in range(1, self.chunk + 1)})
        return [(count, width) for width in widths for count in sorted({
            1 << (n - 1).bit_length()
            for n in range(1, min(self.max_seqs, prompts_per_prefill(width)) + 1)})]

    # ---- the loop -----------------------------------------------------------------------------
    def step(self) -> bool:
        """Admit what fits, then ``steps_per_sync`` tokens for every running row (a row that
        ends on the way keeps what it took until then). False: nothing ran."""
        with self._lock:
            self._admit()
            if self.reading:
                self._read_prompts()
            reading = {row for r in self.reading for row in r.rows}
            running = [i for i, row in enumerate(self.rows) if row is not None and i not in reading]
            if not running:
                return bool(reading)
            tokens, logprobs = self._decode_running(running)
            for j in range(self.steps_per_sync):
                for i in running:
                    if self.rows[i] is not None:
                        self._take(i, int(tokens[j, i]), float(logprobs[j, i]))
            return True

    def start(self) -> "Engine":
        """Step in a background thread whenever there is work, until ``stop``."""
        self._thread = threading.Thread(target=self._serve, name="redco-engine", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Finish what runs and waits, then end the background thread."""
        with self._wake:
            self._closing = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()

    def _serve(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self.waiting or self._closing or any(self.rows))
                if self._closing and not self.waiting and not any(self.rows):
                    return
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 (ended with every request, then serving on)
                self._fail_all(e)

    def _fail_all(self, error: Exception) -> None:
        """End every running and waiting request with ``"error"`` (``request.error`` says
        what), so that no caller waits forever on a step that raised."""
        with self._wake:
            waiting, self.waiting = list(self.waiting), deque()
        running = {id(row[0]): row[0] for row in self.rows if row is not None}
        for row in range(self.max_seqs):
            self._free_row(row)
        self.reading = []
        if self.prefix is not None:
            self.prefix.clear()  # (a failed step may have left any row half written)
        for request in [*running.values(), *waiting]:
            request.error = error
            for index, sample in enumerate(request.samples):
                if sample.finish_reason is None:
                    sample.finish_reason = "error"
                    self._ended(request, index)

    # ---- rows -----------------------------------------------------------------------------------
    def _read_prompts(self) -> None:
        """The next chunk of every prompt being read, in one prefill (``chunk_batch``); a
        prompt read whole starts decoding, and with prefix caching its rows are held."""
        chunks = [r.request.prompt[r.read:r.read + self.chunk] for r in self.reading]
        *arrays, done = chunk_batch(self.reading, chunks, self._width(max(map(len, chunks))),
                                    self.max_seqs)
        self.cache, self.key_valid, self.logits = self._prefill(
            self.params, self.cache, self.key_valid, self.logits, *arrays, *self._page_copies(done),
            *self._pixels([r.request for r in self.reading], arrays[0]))
        self.reading = [r for r in self.reading if r not in done]
        for r in done if self.prefix is not None else ():
            if self.pages is not None:
                self.prefix.add_pages(r.request.prompt, self.pages.table[r.rows[0]])
            for row in r.rows if self.pages is None else ():
                self.prefix.add(row, r.request.prompt)

    def _decode_running(self, running: list[int]):
        """``(tokens, logprobs)``, (steps_per_sync, rows) each, over the fewest leading rows (a
        power of two) that hold every running one: few rows running, little computed."""
        bucket = self._bucket(max(running))
        active = np.zeros(bucket, bool)
        active[running] = True
        settings = np.zeros((3, bucket), np.float32)
        counts = np.zeros(bucket, np.int32)
        for i in running:
            request, sample = self.rows[i]
            s = request.sampling
            settings[:, i] = s.temperature, s.top_k, s.top_p
            counts[i] = len(request.samples[sample].tokens)
        span = self._span(int(self.slot[running].max()) + self.steps_per_sync)
        tokens, logprobs, self.logits, self.cache, self.key_valid = self._decode(
            self.params, self.cache, self.key_valid, self.logits, self.slot[:bucket].copy(),
            active, settings, self.row_keys[:bucket].copy(), counts, *self._grow(running, bucket),
            span=span)
        return np.asarray(tokens), np.asarray(logprobs)

    def _pixels(self, requests: list[Request], ids) -> tuple:
        """The prefill's last argument for an image model: its prompts' images (read as
        ``ids``), ``engine_images.image_context``; () else."""
        return () if self.images is None else (image_context(self.images, requests, ids),)

    def _width(self, longest: int) -> int:
        """The padded width of a prefill whose longest prompt is ``longest`` tokens."""
        return prefill_width(longest, self.max_len)

    def _bucket(self, last_row: int) -> int:
        """The leading rows decoded when ``last_row`` is the last one running."""
        return min(self.max_seqs, 1 << last_row.bit_length())

    def _span(self, end: int) -> int:
        """The slots a decode step reads when the running rows' tokens end before ``end``."""
        span = MIN_SPAN
        while span < end:
            span *= 4
        return min(span, self.max_len)

    def _take(self, row: int, token: int, logprob: float) -> None:
        request, index = self.rows[row]
        sample = request.samples[index]
        sample.tokens.append(token)
        sample.logprobs.append(logprob)
        self.slot[row] += 1
        stopped = request.on_token is not None and request.on_token(request, index, token,
                                                                    logprob)
        if request.cancelled:
            sample.finish_reason = "cancelled"
        elif stopped or token in request.sampling.stop_token_ids or \
                token in self.eos and not request.sampling.ignore_eos:
            sample.finish_reason = "stop"
        elif len(sample.tokens) == request.sampling.max_tokens:
            sample.finish_reason = "length"
        if sample.finish_reason is not None:
            self._free_row(row)
            self._ended(request, index)

    def _end(self, request: Request, reason: str) -> None:
        for index, sample in enumerate(request.samples):
            sample.finish_reason = reason
            self._ended(request, index)

    @staticmethod
    def _ended(request: Request, index: int) -> None:
        if request.on_end is not None:
            request.on_end(request, index)
        if all(s.finish_reason for s in request.samples):
            request.done.set()

    # ---- what runs on the devices ---------------------------------------------------------------
    def _on_rows(self, x):
        """``x`` (rows, ...) placed as the cache's rows are: on every process of a multi-host
        mesh alike (a value made on one device would not meet the cache there)."""
        if self.mesh is None:
            return x
        return jax.device_put(x, rows_sharding(self.mesh, self.max_seqs))
