"""The seq2seq pipeline learns to reverse strings and the captioning pipeline to name coloured
shapes, on 8 devices with 2 model shards; beam search gives the same text sharded and on one
device; ``redco zoo run`` trains both from local files (seq2seq with ``--lora_rank``: the merged
model and the PEFT-layout adapters it saves)."""
import json
import os
from functools import partial

import jax
import numpy as np
import optax
import pytest
from PIL import Image
from safetensors.numpy import load_file
from tasks import COLOURS, LETTERS, SHAPES, reversal_examples, shape_examples

from redco import Deployer, Trainer
from redco.cli import main
from redco_zoo_captioning import pipeline as captioning
from redco_zoo_models import T5ForConditionalGeneration, from_pretrained, runner, split_model
from redco_zoo_models.toy import save_model_dir, tiny_t5, tiny_vit_gpt2, word_tokenizer
from redco_zoo_seq2seq import pipeline as seq2seq


def train_and_predict(workdir, model, collate_fn, loss_fn, pred_fn, output_fn, train, test,
                      batch_size, n_epochs, learning_rate):
    """Fit on dp4 x mp2, then predict ``test``; also return one batch's ids from one device."""
    apply_fn, params = split_model(model)
    deployer = Deployer(jax_seed=0, n_model_shards=2, workdir=workdir, verbose=False)
    lr = deployer.get_lr_schedule_fn(len(train), batch_size, n_epochs, learning_rate,
                                     warmup_rate=0.05)
    trainer = Trainer(deployer, collate_fn, apply_fn, loss_fn, params, optax.adamw(lr),
                      lr_schedule_fn=lr)
    trainer.fit(train, batch_size, n_epochs)
    predictor = trainer.get_default_predictor(pred_fn)
    sharded_ids = predictor.predict(test, batch_size, params=trainer.params)
    batch = collate_fn(test[:8])
    one_device = jax.jit(pred_fn)(jax.random.PRNGKey(0), jax.device_get(trainer.params), batch)
    np.testing.assert_array_equal(np.asarray(one_device), np.stack(sharded_ids[:8]))
    return output_fn(np.stack(sharded_ids))


@pytest.mark.slow  # REDCO_SLOW_TESTS=1 (conftest.py)
def test_seq2seq_learns_to_reverse_strings(workdir):
    tokenizer = word_tokenizer(LETTERS)
    ids = dict(pad_id=0, eos_id=1)
    model = tiny_t5(tokenizer.get_vocab_size())
    test = reversal_examples(256, seed=2)
    preds = train_and_predict(
        workdir, model, partial(seq2seq.collate_fn, tokenizer=tokenizer, max_src_len=9, max_tgt_len=9,
                                **ids), seq2seq.loss_fn,
        partial(seq2seq.pred_fn, model=model, max_new_tokens=9, num_beams=3, **ids),
        partial(runner.detokenize, tokenizer=tokenizer, eos_id=1),
        reversal_examples(4096, seed=1), test, batch_size=16, n_epochs=8, learning_rate=3e-3)
    scores = seq2seq.metric_fn(test, preds)
    print(f"string reversal: {scores}")
    assert scores["exact_match"] >= 0.95, (scores, preds[:4])


@pytest.mark.slow  # REDCO_SLOW_TESTS=1 (conftest.py)
def test_captioning_learns_coloured_shapes(workdir):
    tokenizer = word_tokenizer(list(COLOURS) + list(SHAPES), ("<pad>", "<bos>", "<eos>", "<unk>"))
    ids = dict(bos_id=1, eos_id=2, pad_id=0)
    model = tiny_vit_gpt2(tokenizer.get_vocab_size())
    test = shape_examples(256, seed=2)
    preds = train_and_predict(
        workdir, model, partial(captioning.collate_fn, tokenizer=tokenizer, image_size=32,
                                max_len=4, **ids), captioning.loss_fn,
        partial(captioning.pred_fn, model=model, max_new_tokens=4, num_beams=2, **ids),
        partial(runner.detokenize, tokenizer=tokenizer, eos_id=2),
        shape_examples(3072, seed=1), test, batch_size=8, n_epochs=16, learning_rate=2e-3)
    scores = captioning.metric_fn(test, preds)
    print(f"coloured shapes: {scores}")
    assert scores["exact_match"] >= 0.9, (scores, preds[:4])


def run_seq2seq_with_lora(tmp_path):
    """``redco zoo run seq2seq --lora_rank 8`` on a tiny T5 and 160 reversal pairs (columns
    named by flag): it evaluates, keeps its best checkpoint, exports the merged model (a plain
    T5 directory) and the adapters in PEFT's layout (A as [r, in], under PEFT's names)."""
    tokenizer = word_tokenizer(LETTERS)
    save_model_dir(tiny_t5(tokenizer.get_vocab_size()), tokenizer, str(tmp_path / "t5"))
    with open(tmp_path / "pairs.jsonl", "w") as f:
        for example in reversal_examples(160, seed=3):
            f.write(json.dumps({"question": example["src"], "answer": example["tgt"]}) + "\n")
    workdir = tmp_path / "w1"
    main(["zoo", "run", "seq2seq", "--model", str(tmp_path / "t5"), "--train",
          str(tmp_path / "pairs.jsonl"), "--src_column", "question", "--tgt_column", "answer",
          "--workdir", str(workdir), "--n_model_shards", "2", "--n_epochs", "1",
          "--per_device_batch_size", "4", "--max_src_len", "9", "--max_tgt_len", "9",
          "--lora_rank", "8"])
    log = open(workdir / "log.txt").read()
    assert "exact_match" in log and "rougeL" in log
    assert os.path.isdir(workdir / "ckpts" / "best_rougeL")
    config = json.loads((workdir / "adapter" / "adapter_config.json").read_text())
    assert (config["task_type"], config["r"], sorted(config["target_modules"])) == \
        ("SEQ_2_SEQ_LM", 8, ["k", "o", "q", "v", "wi", "wo"])
    tensors = load_file(str(workdir / "adapter" / "adapter_model.safetensors"))
    assert tensors["base_model.model.decoder.block.1.layer.1.EncDecAttention.q.lora_A.weight"] \
        .shape == (8, 64)
    assert len(tensors) == 2 * (2 * 6 + 2 * 10)  # encoder: attention 4 + MLP 2; decoder: 4+4+2
    assert not [name for name in load_file(str(workdir / "model" / "model.safetensors"))
                if "lora" in name]
    assert isinstance(from_pretrained(T5ForConditionalGeneration, str(workdir / "model")),
                      T5ForConditionalGeneration)


def test_redco_zoo_run_seq2seq_and_captioning_from_local_files(tmp_path):
    """Both pipelines train from local files through ``redco zoo run`` (seq2seq with LoRA
    adapters: ``run_seq2seq_with_lora``; captioning from an image folder's metadata.jsonl) and
    evaluate."""
    run_seq2seq_with_lora(tmp_path)
    tokenizer = word_tokenizer(list(COLOURS) + list(SHAPES), ("<pad>", "<bos>", "<eos>", "<unk>"))
    save_model_dir(tiny_vit_gpt2(tokenizer.get_vocab_size()), tokenizer, str(tmp_path / "ved"))
    images = tmp_path / "images"
    images.mkdir()
    with open(images / "metadata.jsonl", "w") as f:
        for i, example in enumerate(shape_examples(96, seed=4)):
            Image.fromarray(example["image"]).save(images / f"{i}.png")
            f.write(json.dumps({"file_name": f"{i}.png", "caption": example["caption"]}) + "\n")
    main(["zoo", "run", "captioning", "--model", str(tmp_path / "ved"), "--train", str(images),
          "--workdir", str(tmp_path / "w2"), "--n_model_shards", "2", "--n_epochs", "1",
          "--per_device_batch_size", "4", "--max_len", "4", "--num_beams", "2"])
    log = open(tmp_path / "w2" / "log.txt").read()
    assert "exact_match" in log and os.path.isfile(tmp_path / "w2" / "model" / "config.json")


def test_seq2seq_collate_adds_one_eos_when_the_tokenizer_adds_its_own():
    from tokenizers import processors
    tokenizer = word_tokenizer(LETTERS)  # a=3, b=4
    tokenizer.post_processor = processors.TemplateProcessing(  # as T5's tokenizer.json does
        single="$A </s>", special_tokens=[("</s>", 1)])
    assert tokenizer.encode("a b").ids == [3, 4, 1]
    batch = seq2seq.collate_fn([{"src": "a b", "tgt": "b a"}], tokenizer=tokenizer, max_src_len=4,
                               max_tgt_len=4, pad_id=0, eos_id=1)
    assert batch["input_ids"].tolist() == [[3, 4, 1, 0]]
    assert batch["labels"].tolist() == [[4, 3, 1, 0]]
    assert batch["decoder_input_ids"].tolist() == [[0, 4, 3, 1]]
