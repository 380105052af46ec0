"""A token file on disk, its documents packed into rows: every token once, rows deterministic
for a seed, little padding, resident memory that does not grow with the file, and a model
trained on the rows through ``fit``."""
import json
import os
import pydoc_data.topics
import shutil
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import redco
from redco import Deployer, Trainer, checkpointing
from redco.cli import main
from redco.protocols import UsageError
from redco_zoo_lm import packing
from redco_zoo_lm.corpus import TokenFile, write_token_file
from redco_zoo_lm.packing import PackedRows, hold_out
from redco_zoo_lm.pipeline import collate_fn, loss_fn
from redco_zoo_models import LlamaConfig, LlamaForCausalLM, split_model
from redco_zoo_models.toy import save_model_dir

EOS = 0


def documents(n, low, high, vocab=1000, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, size) for size in rng.integers(low, high + 1, n)]


@pytest.mark.parametrize("dtype", [np.uint16, np.uint32])
def test_a_token_file_gives_back_its_documents(tmp_path, dtype):
    docs = documents(50, 1, 300, vocab=70000 if dtype == np.uint32 else 1000)
    corpus = TokenFile(write_token_file(str(tmp_path / "c.bin"), docs, EOS, dtype), EOS, dtype)
    assert len(corpus) == 50
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(corpus.document(i), np.append(doc, EOS))


def test_a_last_document_without_eos_is_kept(tmp_path):
    path = tmp_path / "c.bin"
    np.array([5, 6, EOS, 7, 8, 9], np.uint16).tofile(path)
    assert [d.tolist() for d in map(TokenFile(str(path), EOS).document, range(2))] == \
        [[5, 6, EOS], [7, 8, 9]]


def test_a_truncated_file_or_an_id_beyond_the_vocabulary_is_named(tmp_path):
    path = str(tmp_path / "c.bin")
    write_token_file(path, [[1, 2, 3], [4, 999, 5]], EOS)
    with pytest.raises(UsageError, match=r"c.bin: token 5 is id 999, beyond the model's "
                                         r"vocabulary of 500"):
        TokenFile(path, EOS, vocab_size=500)
    with open(path, "ab") as f:
        f.write(b"\x01")
    with pytest.raises(UsageError, match=r"c.bin is 17 bytes, not a whole number of uint16"):
        TokenFile(path, EOS)


def test_packed_rows_hold_every_token_once_with_little_padding(tmp_path):
    docs = documents(600, 10, 3000)  # mixed lengths, some longer than a row
    corpus = TokenFile(write_token_file(str(tmp_path / "c.bin"), docs, EOS), EOS)
    rows = PackedRows(corpus, seq_len=2047, seed=0)
    assert rows.padding_share < 0.02  # >= 98% of every row is tokens
    width = 2048
    seen = np.zeros(corpus.n_tokens, np.int64)  # tokens of each piece, traced by the plan
    for start, length in zip(rows.start[:], rows.length[:]):  # (the plan, read whole)
        seen[start:start + length] += 1
    assert (seen == 1).all()
    tokens = np.concatenate([np.append(d, EOS) for d in docs])
    for i in np.random.default_rng(0).choice(len(rows), 20, replace=False):
        row = rows[int(i)]
        assert row["token_ids"].shape == row["segment_ids"].shape == (width,)
        segments = row["segment_ids"]
        used = segments > 0
        assert used[:used.sum()].all()  # tokens first, padding after
        for segment in range(1, segments.max() + 1):  # each segment a run of the file
            piece = row["token_ids"][segments == segment]
            assert any(np.array_equal(tokens[s:s + len(piece)], piece)
                       for s in rows.start[:][rows.length[:] == len(piece)])


def test_unpacked_rows_hold_a_document_each_in_order(tmp_path):
    docs = documents(50, 10, 600)  # some longer than a row of 256: cut into pieces
    corpus = TokenFile(write_token_file(str(tmp_path / "c.bin"), docs, EOS), EOS)
    rows = PackedRows(corpus, 255, packed=False)
    assert len(rows) == sum(-(-(len(d) + 1) // 256) for d in docs)  # a piece a row
    assert rows.padding_share > PackedRows(corpus, 255).padding_share
    tokens = np.concatenate([np.append(d, EOS) for d in docs])
    at = 0
    for i in range(len(rows)):  # the file's tokens, a piece a row, in order
        row = rows[i]
        n = int((row["segment_ids"] == 1).sum())
        assert row["segment_ids"].max() == 1
        np.testing.assert_array_equal(row["token_ids"][:n], tokens[at:at + n])
        at += n
    assert at == len(tokens) and "unpacked" in rows.fingerprint


def test_packed_rows_are_fixed_by_their_seed(tmp_path):
    corpus = TokenFile(write_token_file(str(tmp_path / "c.bin"), documents(300, 5, 200), EOS),
                       EOS)
    a, b, c = (PackedRows(corpus, 255, seed) for seed in (0, 0, 1))
    assert len(a) == len(b)
    for i in range(len(a)):
        np.testing.assert_array_equal(a[i]["token_ids"], b[i]["token_ids"])
    assert any(not np.array_equal(a[i]["token_ids"], c[i]["token_ids"])
               for i in range(min(len(a), len(c))))


MEMORY = """
import json, resource, sys
import numpy as np
from redco_zoo_lm.corpus import TokenFile
from redco_zoo_lm.packing import PackedRows
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
rows = PackedRows(TokenFile(sys.argv[1], 0), seq_len=2047)
for i in np.random.default_rng(0).choice(len(rows), 500):
    rows[int(i)]
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"grew_kb": after - before, "rows": len(rows)}))
"""


def test_resident_memory_does_not_grow_with_the_file(tmp_path):
    path = tmp_path / "big.bin"
    rng = np.random.default_rng(0)
    with open(path, "wb") as f:  # 100 MB: 50M tokens, documents of ~2,000
        for _ in range(50):
            block = rng.integers(1, 50000, 1_000_000).astype(np.uint16)
            block[rng.integers(0, 1_000_000, 500)] = EOS
            block.tofile(f)
    out = subprocess.run([sys.executable, "-c", MEMORY, str(path)], capture_output=True,
                         text=True, check=True)
    measured = json.loads(out.stdout.strip().splitlines()[-1])
    assert measured["grew_kb"] < 30_000, (  # the file is 97,656 kB
        f"reading a 100 MB token file raised resident memory by {measured['grew_kb']} kB")


def test_a_model_learns_from_packed_rows_through_fit(tmp_path):
    rng = np.random.default_rng(0)
    docs = [np.arange(start, start + n) % 31 + 1 for start, n in  # counting, mod 31
            zip(rng.integers(0, 31, 200), rng.integers(4, 40, 200))]
    corpus = TokenFile(write_token_file(str(tmp_path / "c.bin"), docs, EOS), EOS)
    rows = PackedRows(corpus, seq_len=63)
    config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    apply_fn, params = split_model(LlamaForCausalLM(config, rngs=nnx.Rngs(0)))
    deployer = Deployer(jax_seed=0, workdir=str(tmp_path / "run"), verbose=False)
    trainer = Trainer(deployer, collate_fn, apply_fn, loss_fn, params, optax.adam(3e-3))
    before = trainer.eval_loss(rows, per_device_batch_size=2)
    trainer.fit(rows, per_device_batch_size=2, n_epochs=8)
    after = trainer.eval_loss(rows, per_device_batch_size=2)
    assert after < 0.5 * before, (before, after)
    assert os.path.exists(os.path.join(deployer.workdir, "metrics.jsonl"))


def test_redco_zoo_run_lm_trains_on_a_token_file(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    texts = [pydoc_data.topics.topics[name] for name in ("assert", "if", "while", "for")]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300,
                                                             special_tokens=["<eos>"]))
    eos = tokenizer.token_to_id("<eos>")
    paragraphs = [p for text in texts for p in text.split("\n\n") if p.strip()] * 3
    path = write_token_file(str(tmp_path / "train.bin"),
                            [tokenizer.encode(p).ids for p in paragraphs], eos)
    cfg = LlamaConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=32,
                      intermediate_size=64, num_hidden_layers=2)
    save_model_dir(LlamaForCausalLM(cfg, nnx.Rngs(0)), tokenizer, str(tmp_path / "model"))
    workdir = tmp_path / "workdir"
    main(["zoo", "run", "lm", "--model", str(tmp_path / "model"), "--train", path,
          "--eos_id", str(eos), "--workdir", str(workdir), "--per_device_batch_size", "2",
          "--n_epochs", "25", "--learning_rate", "3e-3", "--block_size", "63"])
    printed = capsys.readouterr().out
    assert f"{len(paragraphs)} documents" in printed and "% padding" in printed
    perplexity = float(open(workdir / "log.txt").read().split("eval perplexity ")[1].split()[0])
    assert perplexity < cfg.vocab_size / 3  # an untrained model is near the vocabulary size
    with pytest.raises(SystemExit):
        main(["zoo", "run", "lm", "--model", str(tmp_path / "model"), "--train", path,
              "--workdir", str(tmp_path / "other")])
    assert "--eos_id: give the id that ends each document" in capsys.readouterr().err


def test_a_large_eval_file_is_evaluated_on_its_first_eval_steps_batches_said_in_the_log(
        tmp_path, capsys):
    """``--eval`` of 50 batches, ``--eval_steps 3``: 3 batches of 8 rows each evaluation, and
    the log says so (issue 43: an eval file of 525 batches aborted the run)."""
    from redco_zoo_models import save_pretrained
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    save_pretrained(LlamaForCausalLM(config, nnx.Rngs(0)), str(tmp_path / "config"))
    os.remove(tmp_path / "config" / "model.safetensors")  # a config.json alone
    train = write_token_file(str(tmp_path / "train.bin"), documents(40, 4, 60, vocab=64), EOS)
    evaluate = write_token_file(str(tmp_path / "eval.bin"), documents(700, 4, 60, vocab=64, seed=1),
                                EOS)
    n_eval = len(PackedRows(TokenFile(evaluate, EOS), 31))
    assert n_eval > 50 * 8
    run = ["zoo", "run", "lm", "--model", str(tmp_path / "config"), "--from_scratch", "--train",
           train, "--eval", evaluate, "--eos_id", str(EOS), "--max_steps", "1",
           "--per_device_batch_size", "1", "--block_size", "31"]
    main(run + ["--eval_steps", "3", "--workdir", str(tmp_path / "run")])
    log = open(tmp_path / "run" / "log.txt").read()
    assert f"Evaluating on the first 24 of {n_eval:,} eval examples: 3 batches of 8" in log
    assert "eval perplexity" in log
    with pytest.raises(SystemExit):
        main(run + ["--eval_steps", "-1", "--workdir", str(tmp_path / "other")])
    assert "--eval_steps -1: give the number of batches" in capsys.readouterr().err


def test_a_token_file_written_to_under_a_running_job_stops_it_keeping_its_checkpoints(
        tmp_path):
    """A document appended to the file after update 3 is reported: the next read refuses the
    changed file, naming it, and the step checkpoints written before stay complete."""
    path = write_token_file(str(tmp_path / "c.bin"), documents(200, 4, 40, vocab=32), EOS)
    rows = PackedRows(TokenFile(path, EOS), 63)
    config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)

    class AppendAfter3:
        @redco.hookimpl
        def on_step_end(self, trainer, step, metrics):
            if step == 3:
                with open(path, "ab") as f:
                    np.array([5, 6, EOS], np.uint16).tofile(f)
    apply_fn, params = split_model(LlamaForCausalLM(config, rngs=nnx.Rngs(0)))
    trainer = Trainer(Deployer(jax_seed=0, workdir=str(tmp_path / "run"), verbose=False),
                      collate_fn, apply_fn, loss_fn, params, optax.adam(3e-3),
                      callbacks=[AppendAfter3()])
    with pytest.raises(UsageError, match=r"c\.bin changed while it was being read: it was "
                                         r"[\d,]+ bytes, it is [\d,]+ bytes now.*Put the file "
                                         r"back as it was"):
        trainer.fit(rows, per_device_batch_size=1, n_epochs=2, save_every_n_steps=2)
    # update 4 had read its rows (and was dispatched) before update 3 was reported: its
    # checkpoint, of the file as it was, is the newest, complete
    assert checkpointing.step_ckpts(str(tmp_path / "run" / "ckpts")) == [
        str(tmp_path / "run" / "ckpts" / "step_4")]


class Crash(Exception):
    pass


class CrashAfter:
    def __init__(self, step: int):
        self.step = step

    @redco.hookimpl
    def on_step_end(self, trainer, step, metrics):
        if step == self.step:
            raise Crash(f"crashed after update {step}")


def test_a_packed_run_that_crashed_mid_epoch_resumes_to_the_same_bits(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(1, 32, n) for n in rng.integers(4, 40, 200)]
    rows = PackedRows(TokenFile(write_token_file(str(tmp_path / "c.bin"), docs, EOS), EOS), 63)
    config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)

    def train(workdir, callbacks=()) -> Trainer:
        apply_fn, params = split_model(LlamaForCausalLM(config, rngs=nnx.Rngs(0)))
        trainer = Trainer(Deployer(jax_seed=0, workdir=str(workdir), verbose=False), collate_fn,
                          apply_fn, loss_fn, params, optax.adam(3e-3), callbacks=callbacks)
        trainer.fit(rows, per_device_batch_size=2, n_epochs=2, save_every_n_steps=3)
        return trainer
    assert len(rows) // 16 == 4  # 4 updates an epoch: the crash comes in the second epoch
    whole = train(tmp_path / "whole")
    with pytest.raises(Crash):
        train(tmp_path / "run", callbacks=[CrashAfter(7)])
    resumed = train(tmp_path / "run")
    assert "Resumed from" in open(tmp_path / "run" / "log.txt").read()
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        steps = [row["step"] for row in map(json.loads, f) if "train/loss" in row]
    assert steps == list(range(1, 9))  # 1-6 kept, 7 logged again after the resume from step 6
    for got, want in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(whole.params)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("held_out", [False, True])
def test_a_resume_against_a_changed_corpus_is_refused(tmp_path, held_out):
    docs = documents(300, 4, 60, vocab=32)
    path = write_token_file(str(tmp_path / "c.bin"), docs, EOS)
    config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)

    def train() -> None:
        rows = PackedRows(TokenFile(path, EOS), 63)
        rows = hold_out(rows)[0] if held_out else rows  # as redco zoo run lm trains
        apply_fn, params = split_model(LlamaForCausalLM(config, rngs=nnx.Rngs(0)))
        trainer = Trainer(Deployer(jax_seed=0, workdir=str(tmp_path / "run"), verbose=False),
                          collate_fn, apply_fn, loss_fn, params, optax.adam(3e-3))
        trainer.fit(rows, per_device_batch_size=2, n_epochs=1, save_every_n_steps=2)
    train()
    saved = sorted(os.listdir(tmp_path / "run" / "ckpts"))
    docs[5] = docs[5][::-1]  # the same lengths, the same number of rows: other tokens
    write_token_file(path, docs, EOS)
    with pytest.raises(ValueError, match=r"Cannot resume from .*step_\d+: source was .*c\.bin: 300 "
                                         r"documents, \d+ tokens \(sha256 \w+\).*, now .*c\.bin"):
        train()
    assert sorted(os.listdir(tmp_path / "run" / "ckpts")) == saved  # nothing overwritten


def test_a_restart_reads_the_index_and_the_plan_back_and_rescans_a_changed_file(
        tmp_path, monkeypatch):
    docs = documents(200, 1, 300)
    path = write_token_file(str(tmp_path / "c.bin"), docs, EOS)
    first = PackedRows(TokenFile(path, EOS), 255)
    assert sorted(os.listdir(tmp_path)) == ["c.bin", "c.bin.index", "c.bin.rows256-seed0"]

    def no_scan(*args):
        raise AssertionError("scanned or packed again")
    with monkeypatch.context() as m:
        m.setattr(TokenFile, "_scan", no_scan)
        m.setattr(packing, "pack", no_scan)
        again = PackedRows(TokenFile(path, EOS), 255)
        assert again.fingerprint == first.fingerprint and len(again) == len(first)
        for i in (0, len(first) // 2, len(first) - 1):
            np.testing.assert_array_equal(again[i]["token_ids"], first[i]["token_ids"])
        with pytest.raises(UsageError, match=r"token \d+ is id 99\d, beyond"):  # the index's
            TokenFile(path, EOS, vocab_size=500)
    write_token_file(path, docs + [[7, 7, 7]], EOS)  # changed: scanned and packed again
    changed = PackedRows(TokenFile(path, EOS), 255)
    assert len(changed.corpus) == 201 and changed.fingerprint != first.fingerprint
    write_token_file(path, docs, EOS)
    shutil.rmtree(path + ".index")
    open(path + ".index", "w").close()  # the index cannot be written there: kept elsewhere
    assert len(TokenFile(path, EOS)) == 200 and len(TokenFile(path, EOS)) == 200
    assert os.path.getsize(path + ".index") == 0


def test_a_corpus_smaller_than_a_batch_is_refused_naming_its_tokens(tmp_path):
    path = write_token_file(str(tmp_path / "c.bin"), documents(6, 10, 40, vocab=32), EOS)
    rows = PackedRows(TokenFile(path, EOS), 63)  # a few rows; 8 devices need 8
    config = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    apply_fn, params = split_model(LlamaForCausalLM(config, rngs=nnx.Rngs(0)))
    trainer = Trainer(Deployer(jax_seed=0, workdir=str(tmp_path / "run"), verbose=False),
                      collate_fn, apply_fn, loss_fn, params, optax.adam(3e-3))
    with pytest.raises(ValueError, match=rf"global batch \(8 examples\) is larger than "
                                         rf"train_examples \({len(rows)} examples: c\.bin: 6 "
                                         rf"documents, {rows.corpus.n_tokens} tokens .*rows of 64"):
        trainer.fit(rows, per_device_batch_size=1, n_epochs=1)


def test_a_corpus_packed_in_windows_holds_every_token_once(tmp_path, monkeypatch):
    """Packing works on windows of documents (bounded memory on any corpus): with windows of
    at most 64 pieces, 300 documents still give rows holding every token once, each row's
    pieces from one window, little padding, the same plan for the same seed; the fingerprint
    names the windows (a plan made in one window is another plan)."""
    docs = documents(300, 10, 700)
    path = write_token_file(str(tmp_path / "c.bin"), docs, EOS)
    whole = PackedRows(TokenFile(path, EOS), 255)
    monkeypatch.setattr(packing, "WINDOW_PIECES", 64)
    rows = PackedRows(TokenFile(path, EOS, vocab_size=1000), 255, seed=3)
    assert "packed in" in rows.fingerprint and "windows" not in whole.fingerprint
    starts, lengths, bounds = rows.start[:], rows.length[:], rows.bounds[:]
    seen = np.zeros(rows.corpus.n_tokens, np.int64)
    for start, length in zip(starts, lengths):
        seen[start:start + length] += 1
    assert (seen == 1).all() and bounds[0] == 0 and bounds[-1] == len(starts)
    assert (np.diff(bounds) > 0).all() and rows.padding_share < 0.05
    tokens = np.concatenate([np.append(d, EOS) for d in docs])
    for i in (0, len(rows) // 2, len(rows) - 1):
        row = rows[i]
        for segment, (s, n) in enumerate(zip(starts[bounds[i]:bounds[i + 1]],
                                             lengths[bounds[i]:bounds[i + 1]]), start=1):
            np.testing.assert_array_equal(row["token_ids"][row["segment_ids"] == segment],
                                          tokens[s:s + n])
    shutil.rmtree(path + ".rows256-seed3")
    again = PackedRows(TokenFile(path, EOS), 255, seed=3)
    np.testing.assert_array_equal(again.start[:], starts)


@pytest.mark.parametrize("every", [2, 3, 20])
def test_hold_out_keeps_every_nth_row_for_evaluation_and_trains_on_the_rest(every):
    """Found by arithmetic (a corpus of millions of rows holds no index per row): every
    ``every``-th row is held out, at least one (the last, where there are fewer rows), the
    others train, each row in exactly one of the two, in order."""
    for n in [1, 2, every - 1, every, every + 1, 3 * every - 1, 3 * every, 97]:
        if n < 2:
            continue
        train, held = hold_out(list(range(n)), every)
        want_held = [i for i in range(n) if i % every == every - 1] or [n - 1]
        assert [held[i] for i in range(len(held))] == want_held, (n, every)
        assert [train[i] for i in range(len(train))] == \
            [i for i in range(n) if i not in want_held], (n, every)
        assert list(train[1:3]) == [train[i] for i in range(1, min(3, len(train)))]
        assert held.fingerprint == f"every {every}th row ({len(want_held)}) of {n}"


def test_the_first_opening_of_a_large_file_shows_its_progress(tmp_path, monkeypatch, capsys):
    """Indexing and packing say how far they are (on a large corpus: every 10 s); a rerun,
    which reads both back, says nothing."""
    from redco_zoo_lm import corpus as corpus_module
    monkeypatch.setattr(corpus_module, "PROGRESS_EVERY_S", 0.0)  # every step, here
    monkeypatch.setattr(corpus_module, "SCAN_TOKENS", 1000)
    monkeypatch.setattr(packing, "WINDOW_PIECES", 64)
    path = write_token_file(str(tmp_path / "c.bin"), documents(100, 10, 300), EOS)
    PackedRows(TokenFile(path, EOS), 127)
    said = capsys.readouterr().err
    assert f"indexing {path}: 100% of" in said and said.count("indexing") > 3, said
    assert f"packing {path} into rows of 128: 100% of 100 documents" in said, said
    PackedRows(TokenFile(path, EOS), 127)
    assert capsys.readouterr().err == ""


def test_opening_packing_and_reading_hold_no_memory_per_document_or_row(tmp_path, monkeypatch):
    """The index and the plan go to disk as they are made and are read a few entries at a time:
    on 300,000 documents (one int64 each would be 2.4 MB) Python's and numpy's allocations
    peak under 2 MB while the corpus is indexed, packed in windows, held out and read."""
    import tracemalloc

    from redco_zoo_lm import corpus as corpus_module
    monkeypatch.setattr(corpus_module, "SCAN_TOKENS", 1 << 16)
    monkeypatch.setattr(packing, "WINDOW_PIECES", 1 << 12)
    lengths = np.random.default_rng(0).integers(1, 10, 300_000)
    tokens = np.random.default_rng(1).integers(1, 100, int(lengths.sum())).astype(np.uint16)
    tokens[np.cumsum(lengths) - 1] = EOS
    path = str(tmp_path / "c.bin")
    tokens.tofile(path)
    del tokens, lengths
    tracemalloc.start()
    try:
        rows = PackedRows(TokenFile(path, EOS), 15)
        train, held = hold_out(rows)
        read = [train[len(train) - 1], held[0], rows[len(rows) // 2]]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(rows.corpus) == 300_000 and all(r["token_ids"].shape == (16,) for r in read)
    assert peak < 2e6, f"{peak / 1e6:.1f} MB held while opening 300,000 documents"
