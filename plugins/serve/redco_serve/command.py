"""``redco serve --model DIR``: load a zoo model directory (``config.json``, safetensors, a
transformers tokenizer), place it on the devices (``--n_model_shards``: tensor parallel over
that many, replicas over the rest, so decoding never gathers weights), start the engine and
serve it with uvicorn. The socket listens before the line ``serving NAME on URL`` is printed
(``--port 0`` picks a free port and the line names it). SIGTERM or Ctrl-C stops taking
connections and finishes the requests in flight before the process exits."""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket

from redco.protocols import Command, UsageError


class ServeCommand(Command):
    description = "serve a zoo model directory over an OpenAI-compatible HTTP API"

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--model", required=True, help="a model directory (config.json, "
                            "model.safetensors, tokenizer files), e.g. a zoo run's workdir/model")
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=8000, help="0: any free port")
        parser.add_argument("--served_model_name", help="the model's name in requests "
                            "(default: the directory's name)")
        parser.add_argument("--max_seqs", default="16", help="sequences decoded at once (rows "
                            "of the key/value cache), or auto: as many as the device memory "
                            "holds beside the params, less the planner's 10%% headroom")
        parser.add_argument("--device_memory", help="one device's memory for --max_seqs auto, "
                            "e.g. 80GB (default: what the device reports; CPUs report none)")
        parser.add_argument("--max_len", type=int, default=1024,
                            help="prompt plus completion tokens per sequence")
        parser.add_argument("--n_model_shards", type=int, default=1,
                            help="devices each replica's weights are split over (tensor parallel)")
        parser.add_argument("--cache_dtype", choices=["float32", "bfloat16"], default="float32")
        parser.add_argument("--prefill_chunk", type=int, help="read a longer prompt this many "
                            "tokens a step (a power of two >= 16), the running sequences "
                            "decoding between chunks (default: a prompt at once)")
        parser.add_argument("--prefix_caching", action="store_true", help="a prompt that starts "
                            "with a cached prompt's blocks of 16 tokens copies their keys and "
                            "values instead of reading them (counters: /health); not on "
                            "recurrent models")
        parser.add_argument("--quantize_base", choices=["nf4", "int8", "fp8"], help="hold the "
                            "attention and MLP projections quantised, as read (NF4, int8 or "
                            "fp8: QLoRA's base), dequantised inside each prefill and decode step")
        parser.add_argument("--adapter", help="a PEFT adapter directory (a zoo run's "
                            "workdir/adapter) whose LoRA adapters are added to --model's "
                            "projections, unmerged: with --quantize_base, the base a QLoRA run "
                            "trained over and its adapters")
        parser.add_argument("--page_size", type=int, help="a paged key/value cache: one pool "
                            "of pages of this many tokens (e.g. 16), taken as sequences grow "
                            "and admitted by free pages, a cached prefix's pages shared "
                            "(default: --max_seqs rows of --max_len slots; a recurrent "
                            "layer's state stays a row's own); not on image models")
        parser.add_argument("--n_pages", type=int, help="the pool's pages, with --page_size "
                            "(default: the memory of --max_seqs x --max_len slots)")
        parser.add_argument("--scan_layers", action="store_true", default=None, help="a "
                            "decoder's layers stored stacked and run under jax.lax.scan, the "
                            "key/value cache too: start-up (the warm-up's compiles) flat in "
                            "depth, but a copy of the cache in and out of its stack each step "
                            "(unrolled, the serving default, decodes faster)")
        parser.add_argument("--max_images", type=int, default=1, help="images a chat request "
                            "may hold, for an image + text model (LLaVA, Gemma 3/4, Qwen-VL; "
                            "Idefics3/SmolVLM: tiles, an image's split tiles and its global "
                            "one): each prefill carries this many image slots a prompt")
        parser.add_argument("--max_image_patches", type=int, default=1024, help="Qwen-VL: "
                            "the patches of a request's images (a 448 x 448 image at patch 14: "
                            "1024), to which each prefill pads a prompt's; Gemma 4: an image's "
                            "(9 a soft token), to which each prefill pads each image's: one "
                            "shape whatever the images' sizes; more are refused")

    def run(self, args: argparse.Namespace) -> None:
        import uvicorn

        from redco_serve.app import build_app
        if not (args.max_seqs == "auto" or args.max_seqs.isdigit() and int(args.max_seqs) >= 1) \
                or args.max_len < 2:
            raise UsageError(f"--max_seqs {args.max_seqs} --max_len {args.max_len}: give "
                             "--max_seqs auto or a number >= 1, and --max_len >= 2.")
        engine, scorer, tokenizer, eos, processor = start_engine(args)
        name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((args.host, args.port))
        except OSError as e:
            raise UsageError(f"--host {args.host} --port {args.port}: cannot listen there ({e}); "
                             "pick another port, or --port 0 for any free one.") from e
        sock.listen(2048)  # (uvicorn's backlog) connections wait from the printed line on,
        host, port = sock.getsockname()[:2]  # not refused until uvicorn starts accepting
        config = uvicorn.Config(build_app(engine, tokenizer, name, eos, scorer, processor),
                                log_level="warning",
                                timeout_graceful_shutdown=None)
        print(f"redco serve: serving {name} on http://{host}:{port}/v1", flush=True)
        signals = []  # uvicorn drains on SIGTERM/SIGINT, then raises the signal again: to here
        for each in (signal.SIGTERM, signal.SIGINT):
            signal.signal(each, lambda number, frame: signals.append(number))
        try:
            uvicorn.Server(config).run(sockets=[sock])
        finally:
            engine.stop()
        if engine.prefix is not None:
            print(f"redco serve: prefix cache {engine.prefix_stats}", flush=True)
        how = f" on {signal.Signals(signals[0]).name}" if signals else ""
        print(f"redco serve: stopped{how} after finishing the requests in flight", flush=True)


def start_engine(args: argparse.Namespace):
    """``(engine, scorer, tokenizer, eos ids, processor)`` for ``args.model`` (the processor:
    an image + text model's, else None), the engine compiled and warmed up (the scorer
    compiles a shape when first asked for it)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from transformers import AutoTokenizer

    from redco import Deployer
    from redco_planner.layouts import usable_bytes
    from redco_zoo_models.engine import Engine
    from redco_zoo_models.engine_memory import rows_that_fit
    from redco_zoo_models.quantized_linear import sharding_rules
    from redco_zoo_models.scoring import Scorer
    model, config = load_served(args.model, args.quantize_base, args.adapter, args.scan_layers)
    if getattr(getattr(model, "cfg", None), "scan_layers", False):
        print(f"redco serve: the {model.cfg.num_hidden_layers} layers stored stacked and run "
              "under a scan", flush=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    except (OSError, ValueError) as e:
        raise UsageError(f"--model {args.model}: no tokenizer there that transformers reads "
                         f"(tokenizer.json, tokenizer_config.json): {e}") from e
    deployer = Deployer(jax_seed=0, n_model_shards=args.n_model_shards, workdir=None,
                        verbose=False, device_memory=args.device_memory)
    params = nnx.state(model, nnx.Param)
    rules = list(deployer.get_sharding_rules(  # by parameter names: tensor parallel (a
        params, rules=sharding_rules(model, deployer)))  # quantised kernel's scales with it)
    params = jax.device_put(params, deployer.get_params_shardings(params, rules))
    eos = eos_ids(args.model, config, tokenizer)
    cache_dtype = getattr(jnp, args.cache_dtype)
    max_seqs = int(args.max_seqs) if args.max_seqs != "auto" else rows_that_fit(
        model, params, args.max_len, usable_bytes(memory_of(deployer)), cache_dtype,
        deployer.mesh)
    print(f"redco serve: {max_seqs} sequences of {args.max_len} tokens at once", flush=True)
    try:
        engine = Engine(model, params, max_seqs=max_seqs, max_len=args.max_len,
                        eos_token_ids=eos, cache_dtype=cache_dtype, mesh=deployer.mesh,
                        prefill_chunk=args.prefill_chunk, prefix_caching=args.prefix_caching,
                        max_images=args.max_images, page_size=args.page_size,
                        n_pages=args.n_pages, max_image_patches=args.max_image_patches)
    except ValueError as e:  # (a chunk that is no power of two; prefixes on a recurrent model)
        raise UsageError("--prefill_chunk / --prefix_caching / --max_images / --page_size: "
                         f"{e}") from e
    if engine.pages is not None:
        print(f"redco serve: keys and values in {engine.pages.n_pages} pages of "
              f"{engine.pages.size} tokens", flush=True)
    shapes = engine.warm_up()  # every shape compiled before serving: no request waits on one
    print(f"redco serve: compiled {shapes} step shapes", flush=True)
    processor = None if engine.images is None else image_processor(args.model)
    return engine.start(), Scorer(model, params, args.max_len), tokenizer, eos, processor


def load_served(model_dir: str, quantize: str | None, adapter: str | None,
                scan_layers: bool | None = None):
    """``(model, config.json)`` of ``model_dir``, its projections quantised as read
    (``quantize``) and the PEFT adapters of the directory ``adapter`` added; ``scan_layers``:
    a decoder's layers stacked and scanned (``redco_zoo_models.layer_scan``; None: unrolled,
    ``runner.decoding``)."""
    from redco_zoo_models.lora import load_peft_adapters
    from redco_zoo_models.runner import decoding, load_model
    from redco_zoo_models.settings import ModelSource
    source = decoding(ModelSource(model_dir, scan_layers=scan_layers))
    model, config = load_model(model_dir, quantize=quantize, scan_layers=source.scan_layers)
    if adapter is not None:
        try:
            load_peft_adapters(model, adapter)
        except ValueError as e:
            raise UsageError(f"--adapter {adapter}: {e}") from e
    return model, config


def image_processor(model_dir: str):
    """An image + text model's transformers processor (its image processor and placeholder;
    Qwen's without its video processor where this install cannot make one)."""
    from redco_zoo_models.image_collate import load_processor
    try:
        return load_processor(model_dir)
    except UsageError as e:
        raise UsageError(f"--model {e}") from e


def memory_of(deployer) -> int:
    """One device's memory for ``--max_seqs auto`` (``--device_memory``, else the device's)."""
    from redco_planner.planner import device_memory_bytes
    try:
        return device_memory_bytes(deployer)
    except ValueError as e:
        raise UsageError("--max_seqs auto sizes the key/value cache to one device's memory, "
                         f"and {deployer.devices[0].platform} devices do not report it: add "
                         "--device_memory (e.g. 80GB), or give --max_seqs a number.") from e


def eos_ids(model_dir: str, config: dict, tokenizer) -> tuple[int, ...]:
    """The ids that end a completion: ``config.json``'s and ``generation_config.json``'s
    ``eos_token_id`` (an id or a list) and the tokenizer's EOS."""
    found = [config.get("eos_token_id"), tokenizer.eos_token_id]
    path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            found.append(json.load(f).get("eos_token_id"))
    flat = [i for item in found for i in (item if isinstance(item, list) else [item])]
    return tuple(dict.fromkeys(i for i in flat if i is not None))
