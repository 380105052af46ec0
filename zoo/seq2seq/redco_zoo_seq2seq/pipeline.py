"""Text-to-text (translation, summarisation, ...) through the three functions, and
``redco zoo run seq2seq``. The model is an encoder-decoder such as T5 or flan-T5."""
from __future__ import annotations

import dataclasses
from functools import partial

import jax.numpy as jnp
import numpy as np

from redco_zoo_models import flags, generate, runner
from redco_zoo_models.metrics import text_scores, token_cross_entropy
from redco_zoo_models.settings import RunConfig
from redco_zoo_seq2seq.plugin import DESCRIPTION


def collate_fn(examples: list[dict], tokenizer, max_src_len: int, max_tgt_len: int, pad_id: int,
               eos_id: int) -> dict:
    """``src`` and ``tgt`` strings -> encoder ids, decoder inputs (the pad id starts them, as in
    T5) and labels (the target then EOS), right-padded with masks."""
    def ids(text):  # add_special_tokens=False: T5's own tokenizer.json would add EOS too
        return tokenizer.encode(text, add_special_tokens=False).ids + [eos_id]
    src, tgt = [ids(e["src"]) for e in examples], [ids(e["tgt"]) for e in examples]
    input_ids, attention_mask = runner.pad_ids(src, max_src_len, pad_id)
    labels, label_mask = runner.pad_ids(tgt, max_tgt_len, pad_id)
    decoder_input_ids = np.concatenate([np.full((len(tgt), 1), pad_id, np.int32),
                                        labels[:, :-1]], 1)
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "decoder_input_ids": decoder_input_ids, "labels": labels, "label_mask": label_mask}


def loss_fn(rng, state, params, batch, is_training):
    """Cross-entropy of the target tokens (padding excluded)."""
    logits = state.apply_fn(params, batch["input_ids"], batch["attention_mask"],
                            batch["decoder_input_ids"])
    return token_cross_entropy(logits, batch["labels"], batch["label_mask"])


def pred_fn(rng, params, batch, model, max_new_tokens: int, num_beams: int, pad_id: int,
            eos_id: int):
    """Beam-search output ids (B, max_new_tokens) for each source."""
    start = jnp.full((batch["input_ids"].shape[0], 1), pad_id, jnp.int32)
    return generate(model, params, start, max_new_tokens, num_beams=num_beams,
                    eos_token_id=eos_id, pad_token_id=pad_id, encoder_inputs={
                        "input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]})


def metric_fn(examples: list[dict], preds: list[str]) -> dict:
    """ROUGE-1/2/L and exact match of the predicted texts against ``tgt``."""
    return text_scores(preds, [e["tgt"] for e in examples])


@dataclasses.dataclass(frozen=True)
class TextPairs:
    """A seq2seq run's own settings (``RunConfig.task``): each row's source and target text
    (``src_column``, ``tgt_column``), cut to ``max_src_len`` and ``max_tgt_len`` tokens; the
    targets decoded with ``num_beams`` beams."""
    src_column: str = "src"
    tgt_column: str = "tgt"
    max_src_len: int = 128
    max_tgt_len: int = 64
    num_beams: int = 4


class Seq2SeqPipeline:
    description = DESCRIPTION

    def add_arguments(self, parser) -> None:
        flags.add_arguments(parser)
        flags.add_training_levers(parser)
        parser.add_argument("--src_column", default=TextPairs.src_column)
        parser.add_argument("--tgt_column", default=TextPairs.tgt_column)
        parser.add_argument("--max_src_len", type=int, default=TextPairs.max_src_len)
        parser.add_argument("--max_tgt_len", type=int, default=TextPairs.max_tgt_len)
        parser.add_argument("--num_beams", type=int, default=TextPairs.num_beams)

    def run(self, args):
        return train_seq2seq(RunConfig.of_flags(args, TextPairs))


def train_seq2seq(config: RunConfig[TextPairs]):
    """The whole seq2seq run of ``config``; returns the trainer."""
    pairs, source = config.task, config.source
    tokenizer = runner.load_tokenizer(source.model)
    model, hf = runner.load_source(source, config.jax_seed)
    ids = dict(pad_id=hf["pad_token_id"], eos_id=hf["eos_token_id"])
    train, evaluate = ([{"src": r[pairs.src_column], "tgt": r[pairs.tgt_column]} for r in part]
                       for part in runner.split_eval(config.data, {
                           "--src_column": pairs.src_column, "--tgt_column": pairs.tgt_column}))
    return runner.train_and_eval(
        config, model, (train, evaluate),
        partial(collate_fn, tokenizer=tokenizer, max_src_len=pairs.max_src_len,
                max_tgt_len=pairs.max_tgt_len, **ids), loss_fn,
        pred_fn=partial(pred_fn, model=model, max_new_tokens=pairs.max_tgt_len,
                        num_beams=pairs.num_beams, **ids),
        output_fn=partial(runner.detokenize, tokenizer=tokenizer, eos_id=ids["eos_id"]),
        metric_fn=metric_fn, best_metric="rougeL")
