"""Corpora as one sequence of rows: a folder's files one after another, and weighted mixtures,
fixed by their seed; and the LM zoo trained from scratch on them for a number of updates."""
import json
import os
import tracemalloc

import numpy as np
import pytest
from flax import nnx

from redco.cli import main
from redco.protocols import UsageError
from redco_zoo_lm import mixture
from redco_zoo_lm.mixture import Concat, Mixture
from redco_zoo_models import LLAMA_PRESETS, LlamaConfig, LlamaForCausalLM
from redco_zoo_models.hf import save_pretrained


class Named(list):
    """Rows that say where they come from."""

    def __init__(self, name, n):
        super().__init__(f"{name}{i}" for i in range(n))
        self.fingerprint = f"{name} x {n}"


@pytest.fixture(params=["at once", "by blocks"])
def draws(request, monkeypatch):
    """Both ways of drawing: at once (20,000 rows are below ``IN_MEMORY``), and a block at a
    time (as above ``IN_MEMORY`` rows: here with it and the blocks made small)."""
    if request.param == "by blocks":
        monkeypatch.setattr(mixture, "IN_MEMORY", 1000)
        monkeypatch.setattr(mixture, "BLOCK", 256)
    return request.param


def test_a_mixture_draws_by_weight_fixed_by_its_seed_each_source_in_its_order(draws):
    sources = {"a": (Named("a", 50), 3.0), "b": (Named("b", 5000), 1.0)}
    mix = Mixture(sources, seed=0, n_rows=20_000)
    assert ("drawn by blocks of 256" in mix.fingerprint) == (draws == "by blocks")
    shares = mix.shares()
    for name, p in (("a", 0.75), ("b", 0.25)):  # within 4 standard deviations
        assert abs(shares[name] - p) < 4 * np.sqrt(p * (1 - p) / len(mix)), shares
    rows = [mix[i] for i in range(len(mix))]
    from_a = [r for r in rows if r.startswith("a")]
    assert from_a[:120] == [f"a{i % 50}" for i in range(120)]  # in order, round and round
    from_b = [r for r in rows if r.startswith("b")]
    assert from_b[:5000] == [f"b{i}" for i in range(5000)]  # a large source: sampled in order
    again, other_seed = Mixture(sources, seed=0, n_rows=20_000), Mixture(sources, seed=1,
                                                                          n_rows=20_000)
    assert rows == [again[i] for i in range(len(mix))]
    assert rows != [other_seed[i] for i in range(len(mix))]
    assert mix.fingerprint != Mixture({**sources, "a": (sources["a"][0], 2.0)}, seed=0,
                                      n_rows=20_000).fingerprint  # a resume would be refused
    assert len(Mixture(sources)) == 5050  # by default: as many rows as the sources hold
    assert mix[-1] == rows[-1]
    with pytest.raises(IndexError):
        mix[20_000]


@pytest.mark.parametrize("weights, n_rows", [
    ({"a": 1.0, "b": 1.0}, 1), ({"a": 1.0, "b": 1.0}, 777),
    ({"a": 3.0, "b": 1.0, "c": 0.5}, 4099), ({"a": 0.01, "b": 1.0, "c": 7.0}, 20_000)])
def test_a_mixtures_counts_are_its_rows_by_source_and_sum_to_its_length(draws, weights, n_rows):
    """Each source's count (``shares``) is the number of rows read from it, reading every row
    (the reference: rows say where they come from), so they sum to the mixture's length exactly;
    each is its weight's share of the rows within 4 standard deviations of the binomial draw
    (rows are drawn by weight, not apportioned: no rounding to match)."""
    sources = {name: (Named(name, 13 * (i + 1)), w) for i, (name, w) in enumerate(weights.items())}
    mix = Mixture(sources, seed=3, n_rows=n_rows)
    read = {name: 0 for name in weights}
    for i in range(len(mix)):
        read[mix[i][0]] += 1
    counts = {name: round(share * len(mix)) for name, share in mix.shares().items()}
    assert counts == read and sum(counts.values()) == len(mix) == n_rows
    total = sum(weights.values())
    for name, w in weights.items():
        p = w / total
        assert abs(counts[name] - p * n_rows) <= 4 * np.sqrt(n_rows * p * (1 - p)) + 1, counts


def test_a_mixture_of_more_sources_than_a_byte_holds_reads_each_row_from_its_source(draws):
    """300 sources, the last 44 (past 256) given most of the weight: their rows are read from
    them, as many as they were drawn (a source index kept in a byte read them from sources
    0-43 instead)."""
    weights = {f"{k:03d}": 50.0 if k >= 256 else 1.0 for k in range(300)}
    mix = Mixture({name: ([f"{name}:{j}" for j in range(2)], w) for name, w in weights.items()},
                  seed=0, n_rows=3000)
    read = dict.fromkeys(weights, 0)
    for i in range(len(mix)):
        read[mix[i].split(":")[0]] += 1
    assert {name: round(share * len(mix)) for name, share in mix.shares().items()} == read
    heavy = sum(read[name] for name in weights if int(name) >= 256)
    p = 44 * 50 / (44 * 50 + 256)
    assert abs(heavy - p * 3000) <= 4 * np.sqrt(3000 * p * (1 - p)), heavy


def test_a_mixture_drawn_by_blocks_above_in_memory_counts_every_row_once():
    """Above ``IN_MEMORY`` rows (2^20 + 1000: 256 full blocks and one of 1000 rows), the counts
    sum to the length, the last block's rows are read by source as counted, and each source's
    share is its weight's within 4 standard deviations."""
    n_rows = mixture.IN_MEMORY + 1000
    sources = {"a": (Named("a", 5), 2.0), "b": (Named("b", 3), 1.0), "c": (Named("c", 2), 1.0)}
    mix = Mixture(sources, seed=0, n_rows=n_rows)
    assert "drawn by blocks" in mix.fingerprint and len(mix) == n_rows
    counts = {name: round(share * n_rows) for name, share in mix.shares().items()}
    assert sum(counts.values()) == n_rows
    for name, p in (("a", 0.5), ("b", 0.25), ("c", 0.25)):
        assert abs(counts[name] - p * n_rows) <= 4 * np.sqrt(n_rows * p * (1 - p)), counts
    last_block = [mix[i] for i in range(n_rows - 1000, n_rows)]
    assert all(row[0] in "abc" for row in last_block) and mix[-1] == last_block[-1]
    with pytest.raises(IndexError):
        mix[n_rows]


def test_a_mixture_of_twenty_million_rows_holds_under_a_megabyte():
    """Above ``IN_MEMORY`` rows what is kept does not grow with the rows: 100M rows drawn at
    once would hold 100 MB (and make 320 MB of temporaries)."""
    sources = {"a": (Named("a", 7), 1.0), "b": (Named("b", 11), 2.0)}
    tracemalloc.start()
    mix = Mixture(sources, seed=0, n_rows=20_000_000)
    rows = [mix[i] for i in (0, 12_345_678, 19_999_999)]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20, f"{peak / 2**20:.1f} MiB"
    assert all(row[0] in "ab" for row in rows)
    assert abs(mix.shares()["b"] - 2 / 3) < 1e-3, mix.shares()


def test_a_mixture_refuses_a_source_without_weight_or_rows():
    with pytest.raises(UsageError, match=r"Mixture source b: weight 0.0 and 3 rows"):
        Mixture({"a": (Named("a", 3), 1.0), "b": (Named("b", 3), 0.0)})


def test_concat_reads_its_parts_one_after_another():
    rows = Concat([Named("a", 3), Named("b", 2), Named("c", 4)])
    assert [rows[i] for i in range(len(rows))] == ["a0", "a1", "a2", "b0", "b1", "c0", "c1",
                                                   "c2", "c3"]
    assert rows[-1] == "c3" and rows.fingerprint == "a x 3 + b x 2 + c x 4"
    with pytest.raises(IndexError):
        rows[9]


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory):
    """A tokenizer.json and, through redco tokenize, a token file and a folder of two."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tmp = tmp_path_factory.mktemp("tokenized")
    words = [f"w{i}" for i in range(40)]
    rng = np.random.default_rng(0)
    lines = [" ".join(rng.choice(words, rng.integers(3, 30))) for _ in range(600)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    tokenizer.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=120,
                                                             special_tokens=["</s>"]))
    tokenizer.save(str(tmp / "tokenizer.json"))
    (tmp / "text.txt").write_text("\n".join(lines) + "\n")
    os.mkdir(tmp / "shards")
    for name, part in (("web.bin", lines[:300]), ("shards/0.bin", lines[300:450]),
                       ("shards/1.bin", lines[450:])):
        (tmp / "part.txt").write_text("\n".join(part) + "\n")
        main(["tokenize", str(tmp / "part.txt"), "--tokenizer", str(tmp / "tokenizer.json"),
              "--out", str(tmp / name)])
    return tmp


def updates_logged(workdir) -> list[int]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [row["step"] for row in map(json.loads, f) if "train/loss" in row]


def test_redco_zoo_run_lm_from_a_config_on_a_mixture_for_max_steps(tokenized, tmp_path,
                                                                     capsys):
    cfg = LlamaConfig(vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    save_pretrained(LlamaForCausalLM(cfg, nnx.Rngs(0)), str(tmp_path / "config"))
    os.remove(tmp_path / "config" / "model.safetensors")  # a config.json alone
    workdir = str(tmp_path / "run")
    main(["zoo", "run", "lm", "--model", str(tmp_path / "config"), "--from_scratch",
          "--train", f"{tokenized / 'web.bin'}=3,{tokenized / 'shards'}=1", "--max_steps", "12",
          "--per_device_batch_size", "1", "--block_size", "31", "--workdir", workdir])
    printed = capsys.readouterr().out
    assert "a mixture of" in printed and "shards/1.bin:" in printed  # the folder's two files
    assert updates_logged(workdir) == list(range(1, 13))  # 12 updates, across epochs
    assert os.path.isfile(os.path.join(workdir, "model", "model.safetensors"))


def test_redco_zoo_run_lm_from_a_preset_and_a_tokenizer_file(tokenized, tmp_path, monkeypatch):
    monkeypatch.setitem(LLAMA_PRESETS, "llama-test", dict(  # as small as a test needs
        vocab_size=32000, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2))
    workdir = tmp_path / "run"
    main(["zoo", "run", "lm", "--model", "llama-test", "--from_scratch", "--tokenizer",
          str(tokenized / "tokenizer.json"), "--train", str(tokenized / "text.txt"),
          "--max_steps", "5", "--per_device_batch_size", "1", "--block_size", "31",
          "--workdir", str(workdir)])
    assert updates_logged(workdir) == [1, 2, 3, 4, 5]
    from tokenizers import Tokenizer
    vocab = Tokenizer.from_file(str(tokenized / "tokenizer.json")).get_vocab_size()
    with open(workdir / "model" / "config.json") as f:
        assert json.load(f)["vocab_size"] == vocab != 32000  # the tokenizer's, not the preset's
    assert os.path.isfile(workdir / "model" / "tokenizer.json")
    with pytest.raises(SystemExit):
        main(["zoo", "run", "lm", "--model", "llama-nope", "--from_scratch", "--tokenizer",
              str(tokenized / "tokenizer.json"), "--train", str(tokenized / "text.txt"),
              "--workdir", str(tmp_path / "other")])
