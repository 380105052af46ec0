"""Offline stand-ins for what the paper's Appendix A script fetches from the Hugging Face hub.

Everything is made at test time in a temporary directory: a tiny random BART (saved by
PyTorch's ``save_pretrained``, so the script's ``from_pt=True`` path is exercised), a byte-level
BPE tokenizer trained on the toy corpus, a toy summarization data set that
``datasets.load_dataset(<dir>)`` reads, and a ``rouge/rouge.py`` metric module, built on the
``rouge_score`` package, that ``evaluate.load('rouge')`` finds in the working directory before
it would try the hub.
"""
from __future__ import annotations

import atexit
import json
import os
import random
import shutil
import tempfile

# Before jax (or anything importing it) is imported: 8 simulated CPU devices, no hub, and a
# private HF cache so evaluate's dynamic modules never land in the user's ~/.cache.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ["HF_EVALUATE_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "HF_HOME" not in os.environ:
    _hf_home = tempfile.mkdtemp(prefix="redco-paper-hf-")
    atexit.register(shutil.rmtree, _hf_home, ignore_errors=True)
    os.environ["HF_HOME"] = _hf_home

import pytest  # noqa: E402

WORDS = ("the model trains fast on many devices while each host reads its own share of "
         "data and the mesh splits every layer across shards so large networks fit in memory "
         "when gradients are summed over micro batches before one optimizer update").split()
LEADS = ("in this run", "on every host", "for each layer")
SPECIAL_TOKENS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]  # BART's ids 0..4

# A real ROUGE metric for evaluate.load('rouge'), the shape of the hub's evaluate-metric/rouge:
# rouge_score computes it; a bootstrap aggregate's mid F-measure is reported per rouge type.
ROUGE_MODULE = '''"""ROUGE, computed by Google's rouge_score package (a local copy of the hub metric)."""
import datasets
import evaluate
from rouge_score import rouge_scorer, scoring


class Rouge(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="ROUGE-N and ROUGE-L F-measures, by rouge_score.",
            citation="Lin, 2004. ROUGE: A Package for Automatic Evaluation of Summaries.",
            inputs_description="predictions: list of str; references: list of str.",
            features=datasets.Features({"predictions": datasets.Value("string"),
                                        "references": datasets.Value("string")}))

    def _compute(self, predictions, references, rouge_types=None, use_aggregator=True,
                 use_stemmer=False):
        rouge_types = rouge_types or ["rouge1", "rouge2", "rougeL", "rougeLsum"]
        scorer = rouge_scorer.RougeScorer(rouge_types=rouge_types, use_stemmer=use_stemmer)
        aggregator = scoring.BootstrapAggregator() if use_aggregator else None
        scores = []
        for ref, pred in zip(references, predictions):
            score = scorer.score(ref, pred)
            if aggregator is not None:
                aggregator.add_scores(score)
            else:
                scores.append(score)
        if aggregator is not None:
            return {key: value.mid.fmeasure for key, value in aggregator.aggregate().items()}
        return {key: [s[key].fmeasure for s in scores] for key in rouge_types}
'''


def toy_examples(n: int, seed: int) -> list[dict]:
    """Summarization where the summary is the source's first four words: a lead phrase (one of
    a few, so a briefly trained model gets some n-grams right) and the next word."""
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        words = rng.choice(LEADS).split() + [rng.choice(WORDS) for _ in range(rng.randint(4, 9))]
        src = " ".join(words)
        examples.append({"src": src, "tgt": " ".join(src.split()[:4])})
    return examples


def write_dataset(path: str, n_train: int, n_validation: int) -> str:
    os.makedirs(path)
    for split, n, seed in (("train", n_train, 0), ("validation", n_validation, 1)):
        with open(os.path.join(path, f"{split}.json"), "w") as f:
            for example in toy_examples(n, seed):
                f.write(json.dumps(example) + "\n")
    return path


def write_tokenizer(path: str):
    from tokenizers import ByteLevelBPETokenizer
    from transformers import BartTokenizerFast

    corpus = [e["src"] for e in toy_examples(400, 2)] + [" ".join(WORDS + list(LEADS))]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus, vocab_size=1000, min_frequency=1,
                            special_tokens=SPECIAL_TOKENS, show_progress=False)
    raw = os.path.join(path, "bpe")
    os.makedirs(raw)
    bpe.save_model(raw)
    tokenizer = BartTokenizerFast(vocab_file=os.path.join(raw, "vocab.json"),
                                  merges_file=os.path.join(raw, "merges.txt"))
    assert [tokenizer.bos_token_id, tokenizer.pad_token_id, tokenizer.eos_token_id,
            tokenizer.unk_token_id] == [0, 1, 2, 3]
    tokenizer.save_pretrained(path)
    shutil.rmtree(raw)
    return tokenizer


def write_model(path: str, vocab_size: int) -> None:
    import torch
    from transformers import BartConfig, BartForConditionalGeneration

    config = BartConfig(
        vocab_size=-(-vocab_size // 8) * 8, d_model=32, encoder_layers=1, decoder_layers=1,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
        forced_bos_token_id=None, forced_eos_token_id=2)
    torch.manual_seed(0)
    BartForConditionalGeneration(config).save_pretrained(path)


@pytest.fixture(scope="session")
def paper_assets(tmp_path_factory):
    """``{'model': dir, 'data': dir, 'cwd': dir holding rouge/rouge.py}``."""
    root = tmp_path_factory.mktemp("paper-assets")
    model_dir = str(root / "tiny-bart")
    tokenizer = write_tokenizer(model_dir)
    write_model(model_dir, len(tokenizer))
    data_dir = write_dataset(str(root / "toy-summarization"), n_train=256, n_validation=8)
    cwd = root / "cwd"
    (cwd / "rouge").mkdir(parents=True)
    (cwd / "rouge" / "rouge.py").write_text(ROUGE_MODULE)
    return {"model": model_dir, "data": data_dir, "cwd": str(cwd)}
