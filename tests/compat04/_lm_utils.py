"""Shared pieces of the compat04 language-model tests (text_to_text, language_modeling, lora).

Stand-ins for what the 0.4.x examples take from the hub: a word-level tokenizer built here with
``tokenizers`` (no download), small synthetic corpora written as json, a token-level ROUGE (the
examples use ``evaluate.load('rouge')``, which needs the network), and the LoRA split/merge helpers
of ``examples/lora/lora_utils.py`` re-expressed.
"""
import json
import random
import types

import jax
import jax.numpy as jnp
from flax.traverse_util import flatten_dict, unflatten_dict
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

# ---------------------------------------------------------------- environment shim

def patch_flax_t5_clip():
    """Flax T5 of transformers 4.57.6 calls ``jnp.clip(x, a_max=...)``, keywords jax 0.10
    removed (now ``min``/``max``). Hand only that module a ``jnp`` whose ``clip`` takes both;
    ``jax.numpy`` itself is untouched. (Environment only: nothing to do with Redco.)"""
    from transformers.models.t5 import modeling_flax_t5

    if getattr(modeling_flax_t5.jnp, "_lm_clip_shim", False):
        return

    def clip(x, min=None, max=None, *, a_min=None, a_max=None):  # noqa: A002
        return jnp.clip(x, a_min if min is None else min, a_max if max is None else max)

    shim = types.ModuleType("jax.numpy with a_min/a_max clip")
    shim.__dict__.update(jnp.__dict__)
    shim.clip, shim._lm_clip_shim = clip, True
    modeling_flax_t5.jnp = shim


# ---------------------------------------------------------------- tokenizer

T5_SPECIALS = {"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}
BART_SPECIALS = {"bos_token": "<s>", "pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}


def word_tokenizer(words, specials, vocab_multiple=2):
    """A whitespace word-level fast tokenizer over ``words``: special tokens first, in the order
    given (T5: pad 0, eos 1, unk 2; BART: bos 0, pad 1, eos 2, unk 3), an ``</s>`` appended to
    every sequence (and a leading ``<s>`` where ``bos_token`` is given), padded with unused
    ``<extra_i>`` words to a multiple of ``vocab_multiple`` so the vocab splits over model shards."""
    names = list(specials.values()) + sorted(set(words))
    names += [f"<extra_{i}>" for i in range(-len(names) % vocab_multiple)]
    vocab = {name: idx for idx, name in enumerate(names)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=specials["unk_token"]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    eos = specials["eos_token"]
    if "bos_token" in specials:
        bos = specials["bos_token"]
        template, used = f"{bos} $A {eos}", [(bos, vocab[bos]), (eos, vocab[eos])]
    else:
        template, used = f"$A {eos}", [(eos, vocab[eos])]
    backend.post_processor = processors.TemplateProcessing(single=template, special_tokens=used)
    return PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False,
                                   **specials)


# ---------------------------------------------------------------- data

NOUNS = ["apple", "river", "stone", "cloud", "tiger", "lamp", "bread", "chair", "music", "garden",
         "window", "silver"]
KINDS = ["FOOD", "NATURE", "HOME", "OTHER"]
STOPWORDS = ["the", "a", "big", "old", "red", "near", "with", "my", "one", "quiet"]


def noun_summary(noun):
    """The toy 'summary' of a sentence about ``noun``: its kind and its name in capitals."""
    kind = {"apple": "FOOD", "bread": "FOOD", "river": "NATURE", "stone": "NATURE",
            "cloud": "NATURE", "tiger": "NATURE", "lamp": "HOME", "chair": "HOME",
            "window": "HOME"}.get(noun, "OTHER")
    return f"{kind} {noun.upper()}"


def summary_vocab():
    return NOUNS + STOPWORDS + KINDS + [noun.upper() for noun in NOUNS]


def summarization_examples(n, seed, src_key="document", tgt_key="summary"):
    """``n`` examples of a toy summarization task: a 'document' of 3-6 stop words with one noun
    somewhere -> a two-word 'summary' (kind + noun), found by content, not position."""
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        noun = rng.choice(NOUNS)
        words = [rng.choice(STOPWORDS) for _ in range(rng.randint(3, 6))]
        words.insert(rng.randrange(len(words) + 1), noun)
        examples.append({src_key: " ".join(words), tgt_key: noun_summary(noun)})
    return examples


POSITIVE = ["profit"]   # one cue word per class: LoRA on a random base learns it in ~100 updates
NEGATIVE = ["loss"]
FILLER = ["the", "company", "said", "quarter", "sales", "its", "in", "this", "year", "shares",
          "market", "report", "bank", "group", "of"]


def phrasebank_examples(n, seed):
    """A local stand-in for financial_phrasebank: a sentence of 3-5 filler words with at most one
    cue word; label ``positive``/``negative`` by the cue, ``neutral`` without one (balanced)."""
    rng = random.Random(seed)
    examples = []
    for i in range(n):
        label = ["positive", "negative", "neutral"][i % 3]
        words = [rng.choice(FILLER) for _ in range(rng.randint(3, 5))]
        if label != "neutral":
            cue = rng.choice(POSITIVE if label == "positive" else NEGATIVE)
            words.insert(rng.randrange(len(words) + 1), cue)
        examples.append({"sentence": " ".join(words), "text_label": label})
    rng.shuffle(examples)
    return examples


def token_documents(n_docs, seed, vocab_size, bos_token_id=0):
    """Pre-tokenized documents (``{'input_ids': [bos, ...]}``) that count upwards (modulo
    ``vocab_size - 4``) from a random start: after the first word every next token is determined,
    so a causal LM can push its loss far below ``log(vocab_size)``."""
    rng = random.Random(seed)
    first, span = 2, vocab_size - 4
    docs = []
    for _ in range(n_docs):
        start, length = rng.randrange(span), rng.randint(6, 20)
        docs.append({"input_ids": [bos_token_id]
                     + [first + (start + k) % span for k in range(length)]})
    return docs


def write_json(path, examples):
    with open(path, "w") as f:
        json.dump(examples, f)


def read_json(path):
    with open(path) as f:
        return json.load(f)


# ---------------------------------------------------------------- metrics

def _ngrams(tokens, n):
    grams = {}
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i:i + n])
        grams[gram] = grams.get(gram, 0) + 1
    return grams


def _f1(overlap, n_pred, n_ref):
    if overlap == 0 or n_pred == 0 or n_ref == 0:
        return 0.0
    precision, recall = overlap / n_pred, overlap / n_ref
    return 2 * precision * recall / (precision + recall)


def _lcs(a, b):
    row = [0] * (len(b) + 1)
    for x in a:
        prev_diag = 0
        for j, y in enumerate(b, start=1):
            prev_diag, row[j] = row[j], (prev_diag + 1 if x == y else max(row[j], row[j - 1]))
    return row[-1]


def rouge_scores(predictions, references):
    """Mean F1 of ROUGE-1, ROUGE-2 and ROUGE-L over whitespace tokens (lower-cased), the three
    numbers the examples read from ``evaluate``'s rouge."""
    totals = {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}
    for pred, ref in zip(predictions, references):
        p, r = pred.lower().split(), ref.lower().split()
        for key, n in (("rouge1", 1), ("rouge2", 2)):
            gp, gr = _ngrams(p, n), _ngrams(r, n)
            overlap = sum(min(c, gr.get(g, 0)) for g, c in gp.items())
            totals[key] += _f1(overlap, max(len(p) - n + 1, 0), max(len(r) - n + 1, 0))
        totals["rougeL"] += _f1(_lcs(p, r), len(p), len(r))
    return {key: value / max(len(predictions), 1) for key, value in totals.items()}


# ---------------------------------------------------------------- LoRA (examples/lora/lora_utils.py)

def _is_dense(path, leaf):
    return path[-1] == "kernel" and leaf.ndim == 2


def get_lora(model_params, lora_rank, rng):
    """Low-rank factors for every 2-D ``kernel``: ``a`` (in, rank) He-uniform, ``b`` (rank, out)
    zeros, so the merged model starts equal to the base model."""
    init = jax.nn.initializers.he_uniform()
    factors = {}
    for i, (path, leaf) in enumerate(sorted(flatten_dict(model_params).items())):
        if _is_dense(path, leaf):
            n_in, n_out = leaf.shape
            factors[path[:-1] + ("a",)] = init(jax.random.fold_in(rng, i), (n_in, lora_rank),
                                               jnp.float32)
            factors[path[:-1] + ("b",)] = jnp.zeros((lora_rank, n_out), jnp.float32)
    return unflatten_dict(factors)


def aggregate_params(model_params, lora_params, lora_alpha):
    """The base params with ``lora_alpha * a @ b`` added onto every 2-D kernel."""
    factors = flatten_dict(lora_params)

    def merge(path, leaf):
        if not _is_dense(path, leaf):
            return leaf
        delta = factors[path[:-1] + ("a",)] @ factors[path[:-1] + ("b",)]
        return leaf + (lora_alpha * delta).astype(leaf.dtype)

    return unflatten_dict({path: merge(path, leaf)
                           for path, leaf in flatten_dict(model_params).items()})
