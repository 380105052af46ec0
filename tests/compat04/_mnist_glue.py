"""Local stand-ins for what ``examples/classification_regression`` (tanyuqian/redco) downloads,
for test_classification_regression.py: no hub, no ``datasets``.

* ``make_model_dir(path)``: a tiny RoBERTa (1 layer, width 32) as a hub folder would hold it:
  ``config.json`` and a word-level fast tokenizer whose special tokens and ``<s> A </s></s> B </s>``
  pair template are RoBERTa's, so ``AutoTokenizer.from_pretrained(path)`` and
  ``AutoConfig.from_pretrained(path, num_labels=)`` work as they do on ``FacebookAI/roberta-large``.
* ``load_glue(name)``: ``{'train': [...], 'validation': [...]}`` shaped like GLUE's ``sst2``
  (``sentence``, integer ``label``: is the sentence positive) and ``stsb`` (``sentence1``,
  ``sentence2``, float ``label`` in [0, 5]: how many positive words the pair holds, times 1.25).
"""
from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast, RobertaConfig

SPECIALS = ['<s>', '<pad>', '</s>', '<unk>', '<mask>']  # RoBERTa's ids 0..4
POSITIVE = ['good', 'great', 'fine', 'nice', 'happy', 'superb']
NEGATIVE = ['bad', 'awful', 'poor', 'sad', 'ugly', 'dull']
NEUTRAL = ['the', 'movie', 'was', 'a', 'plot', 'and', 'it', 'very', 'film', 'story', 'cast', 'so',
           'music', 'scene', 'acting']  # 32 tokens in all: the embedding splits over mp = 2
MAX_LENGTH = 16


def make_model_dir(path: str) -> str:
    vocab = {word: i for i, word in enumerate(SPECIALS + POSITIVE + NEGATIVE + NEUTRAL)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token='<unk>'))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single='<s> $A </s>', pair='<s> $A </s> </s> $B </s>',
        special_tokens=[('<s>', vocab['<s>']), ('</s>', vocab['</s>'])])
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token='<s>', eos_token='</s>', unk_token='<unk>',
        pad_token='<pad>', mask_token='<mask>', cls_token='<s>', sep_token='</s>',
        model_max_length=MAX_LENGTH, model_input_names=['input_ids', 'attention_mask'],
    ).save_pretrained(path)
    RobertaConfig(
        vocab_size=len(vocab), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=MAX_LENGTH + 4, type_vocab_size=1,
        pad_token_id=1, bos_token_id=0, eos_token_id=2,
    ).save_pretrained(path)
    return path


def _sentence(rng: np.random.Generator, words: list[str], n_neutral: int | None = None) -> str:
    fill = list(rng.choice(NEUTRAL, size=n_neutral or int(rng.integers(2, 5))))
    for word in words:
        fill.insert(int(rng.integers(0, len(fill) + 1)), word)
    return ' '.join(fill)


def _sst2(rng: np.random.Generator, idx: int) -> dict:
    n_pos = int(rng.integers(0, 4))
    words = list(rng.choice(POSITIVE, n_pos)) + list(rng.choice(NEGATIVE, 3 - n_pos))
    return {'sentence': _sentence(rng, words), 'label': int(n_pos >= 2), 'idx': idx}


def _stsb(rng: np.random.Generator, idx: int) -> dict:
    counts = rng.integers(0, 3, size=2)
    sents = [_sentence(rng, list(rng.choice(POSITIVE, c)) + list(rng.choice(NEGATIVE, 2 - c)), 3)
             for c in counts]
    return {'sentence1': sents[0], 'sentence2': sents[1], 'label': 1.25 * float(counts.sum()),
            'idx': idx}


def load_glue(name: str, n_train: int = 512, n_validation: int = 128) -> dict[str, list[dict]]:
    make = {'sst2': _sst2, 'stsb': _stsb}[name]
    rng = np.random.default_rng({'sst2': 0, 'stsb': 1}[name])
    examples = [make(rng, i) for i in range(n_train + n_validation)]
    return {'train': examples[:n_train], 'validation': examples[n_train:]}
