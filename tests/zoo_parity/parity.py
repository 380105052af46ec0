"""What the parity tests share: perturbed random weights, loading, logits, the tolerance, and
greedy and beam-search tokens from both sides."""
import jax
import jax.numpy as jnp
import numpy as np
import torch  # installed by tox -e zoo-parity: missing is an error, not a skip
import transformers  # noqa: F401 - the test modules import it from here
from flax import nnx
from tokenizers import Tokenizer, models, pre_tokenizers

from redco_zoo_models.generation import generate

torch.use_deterministic_algorithms(True)
# One thread: the models here are tiny, and on a loaded box torch's idle threads spin. transformers'
# greedy tokens of the tiny Gemma 4: 0.1-0.16 CPU s with one thread, 4-13 s with two.
torch.set_num_threads(1)


def jiggle_torch(model, seed=0):
    """Perturb every weight (layer norms and biases included) so a misplaced one shows."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def jiggle_ours(model, seed=0):
    params = nnx.state(model, nnx.Param)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    nnx.update(model, jax.tree.unflatten(
        tree, [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]))
    return model


def saved(model, path):
    model.save_pretrained(path)
    return str(path)


def load_hf(cls, path):
    model, info = cls.from_pretrained(path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def word_tokenizer(vocab: dict, **special):
    """A real fast tokenizer built offline: whitespace-split words of ``vocab`` (``<unk>`` for the
    rest), left padding; ``special``: its special tokens (``pad_token="<pad>"``, ...)."""
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>",
                                                padding_side="left", **special)


def torch_logits(model, **inputs):
    with torch.no_grad():
        return model(**{k: torch.tensor(np.asarray(v)) for k, v in inputs.items()}).logits.numpy()


def close(a, b, atol: float = 5e-4):
    """Equal up to float32 summation order: torch's and XLA's CPU kernels differ by up to ~2e-4
    on logits of size ~5 (seen on CI's CPUs); a wrong layer or mask is off by far more."""
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=1e-4)


def hf_greedy(model, first, skip: int, n_new: int, eos: int, pad: int, **inputs) -> np.ndarray:
    """transformers' greedy tokens for ``generate(first, **inputs)`` after its first ``skip``
    (the prompt, or the decoder's start token), padded with ``pad`` to ``n_new``."""
    with torch.no_grad():
        out = model.generate(torch.tensor(np.asarray(first)), max_new_tokens=n_new,
                             do_sample=False, eos_token_id=eos, pad_token_id=pad,
                             **{k: torch.tensor(v) for k, v in inputs.items()}).numpy()[:, skip:]
    return np.pad(out, ((0, 0), (0, n_new - out.shape[1])), constant_values=pad)


def left_padded(rows: int, length: int, high: int, pad: int, seed: int):
    """``rows`` random prompts of ``length`` ids below ``high``, row ``r`` behind ``r % 4`` pads,
    and their mask."""
    mask = (np.arange(length) >= np.arange(rows)[:, None] % 4).astype(np.int64)
    ids = np.random.RandomState(seed).randint(0, high, (rows, length))
    return np.where(mask > 0, ids, pad), mask


def hf_beams(model, first, skip: int, n_new: int, num_beams: int, eos: int, pad: int,
             **inputs) -> np.ndarray:
    """transformers' beam-search tokens for ``generate(first, **inputs)`` after its first
    ``skip``, with its defaults (length penalty 1.0, ``early_stopping=False``); each row cut after
    its first ``eos`` and padded with ``pad`` to ``n_new`` as ours are (transformers fills with
    ``pad_token_id or eos``: with pad 0, EOS)."""
    with torch.no_grad():
        out = model.generate(torch.tensor(np.asarray(first)), max_new_tokens=n_new,
                             num_beams=num_beams, do_sample=False, length_penalty=1.0,
                             eos_token_id=eos, pad_token_id=pad,
                             **{k: torch.tensor(v) for k, v in inputs.items()}).numpy()[:, skip:]
    want = np.full((len(out), n_new), pad, out.dtype)
    for row, tokens in zip(want, out):
        ends = np.flatnonzero(tokens == eos)
        n = ends[0] + 1 if len(ends) else len(tokens)
        row[:n] = tokens[:n]
    return want


def zoo_beams(model, first, n_new: int, num_beams: int, pad: int, **inputs):
    """The zoo's beam-search tokens as a function of the EOS id, compiled once (the id is
    traced); ``inputs``: ``prompt_mask`` or ``encoder_inputs``."""
    fn = jax.jit(lambda params, eos: generate(
        model, params, jnp.asarray(first), n_new, num_beams=num_beams, eos_token_id=eos,
        pad_token_id=pad, length_penalty=1.0, **inputs))
    params = nnx.state(model, nnx.Param)
    return lambda eos: np.asarray(fn(params, eos))


def check_beams(ours, theirs, eos: int):
    """``ours(end)`` and ``theirs(end)`` give the same tokens for the config's ``eos`` (random
    weights rarely emit it, so rows mostly run to the end) and for the two tokens ours emits most
    often when nothing ends a beam: those end rows early, fill the ``k`` finished hypotheses and
    bring transformers' early stop into play."""
    values, counts = np.unique(ours(-1), return_counts=True)  # -1: no token ends a beam
    for end in (eos, *(int(v) for v in values[np.argsort(-counts)][:2])):
        got = ours(end)
        np.testing.assert_array_equal(got, theirs(end), err_msg=f"EOS {end}")
        if end != eos:
            assert (got[:, :-1] == end).any(), f"EOS {end} ends no row early: nothing checked"


def scanned_tower(path, tower: str, tmp_path):
    """The image-text checkpoint at ``path`` read with ``scan_layers`` (the language model's
    layers and the vision tower's blocks stacked, ``redco_zoo_models.layer_scan``): ``tower``
    (a path prefix, e.g. ``visual/blocks/``) holds stacked blocks, and the model's export is
    the unrolled model's, tensor for tensor (the stacks cut back into blocks)."""
    from safetensors.numpy import load_file

    from redco.sharding import named_leaves
    from redco_zoo_models.hf import auto_class, from_pretrained, save_pretrained
    unrolled = from_pretrained(auto_class(str(path), images=True), str(path), scan_layers=False)
    scanned = from_pretrained(auto_class(str(path), images=True), str(path), scan_layers=True)
    names = [p for p, _ in named_leaves(nnx.state(scanned, nnx.Param))]
    assert any(p.startswith(tower) and ":" in p.split("/")[len(tower.split("/")) - 1]
               for p in names), names
    tensors = []
    for i, model in enumerate((unrolled, scanned)):
        save_pretrained(model, str(tmp_path / f"export{i}"))
        tensors.append(load_file(str(tmp_path / f"export{i}" / "model.safetensors")))
    assert tensors[0].keys() == tensors[1].keys()
    for name, array in tensors[0].items():
        np.testing.assert_array_equal(tensors[1][name], array, err_msg=name)
    return scanned


def engine_reads_in_one_prefill(engine, prompts: list, images: list, want) -> tuple:
    """Run ``prompts`` (token lists, each with its ``images`` as ``Engine.submit`` takes them)
    through the serving ``engine``, asserting it reads them all in one prefill and its greedy
    tokens are ``want`` (rows, new tokens; 0 past a sample's end). Returns ``(samples, full,
    valid)``: each prompt's sample, and prompt + sample rows right-padded with their mask, for
    the forward pass whose ``log_softmax`` the sampled log-probabilities are checked against
    (``logprobs_match``)."""
    from redco_zoo_models.requests import Sampling
    read, prefill = [], engine._prefill  # (the prompts each prefill reads)
    engine._prefill = lambda *args: read.append(len(args[4])) or prefill(*args)
    requests = [engine.submit(p, Sampling(max_tokens=want.shape[1]), images=i)
                for p, i in zip(prompts, images)]
    engine.run_until_done(requests)
    assert read == [len(prompts)]  # every prompt in one prefill
    samples = [r.samples[0] for r in requests]
    got = [s.tokens + [0] * (want.shape[1] - len(s.tokens)) for s in samples]
    np.testing.assert_array_equal(np.array(got), want)
    rows = [p + s.tokens for p, s in zip(prompts, samples)]
    width = max(map(len, rows))
    full = np.array([r + [0] * (width - len(r)) for r in rows])
    return samples, full, np.arange(width) < np.array([len(r) for r in rows])[:, None]


def logprobs_match(prompts: list, samples: list, logprobs, atol: float = 1e-4) -> None:
    """Each sample's log-probabilities are ``logprobs`` (rows, width, vocab) at its tokens."""
    for row, (prompt, sample) in enumerate(zip(prompts, samples)):
        at = np.arange(len(sample.tokens)) + len(prompt) - 1
        np.testing.assert_allclose(sample.logprobs, logprobs[row, at, sample.tokens], atol=atol)
