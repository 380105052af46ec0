"""``redco tokenize``: text files streamed into a token file that reads back as the tokenizer
encodes each document, with its manifest; an interrupted run, rerun, writes the same bytes."""
import json
import os
import pydoc_data.topics

import numpy as np
import pytest

from redco.cli import main
from redco_zoo_lm import tokenizing
from redco_zoo_lm.corpus import TokenFile


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel()
    tokenizer.train_from_iterator(list(pydoc_data.topics.topics.values())[:50],
                                  trainers.BpeTrainer(vocab_size=400, special_tokens=["</s>"]))
    path = tmp_path_factory.mktemp("tok")
    tokenizer.save(str(path / "tokenizer.json"))
    return path


def paragraphs(n: int) -> list[str]:
    texts = [p.strip() for t in pydoc_data.topics.topics.values() for p in t.split("\n\n")]
    return [p.replace("\n", " ") for p in texts if p.strip()][:n]


def test_text_files_become_a_token_file_of_their_documents(tmp_path, tokenizer_dir):
    from tokenizers import Tokenizer
    docs = paragraphs(300)
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"body": d}) + "\n" for d in docs[:200]))
    (tmp_path / "b.txt").write_text("\n".join(docs[200:]) + "\n")
    main(["tokenize", str(tmp_path / "a.jsonl"), str(tmp_path / "b.txt"), "--tokenizer",
          str(tokenizer_dir), "--out", str(tmp_path / "corpus.bin"), "--text_column", "body"])
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = tokenizer.token_to_id("</s>")
    corpus = TokenFile(str(tmp_path / "corpus.bin"), eos, vocab_size=400)
    assert len(corpus) == 300
    for i in (0, 199, 200, 299):
        assert corpus.document(i).tolist() == tokenizer.encode(docs[i]).ids + [eos]
    manifest = json.loads((tmp_path / "corpus.json").read_text())
    assert manifest["documents"] == 300 and manifest["tokens"] == corpus.n_tokens
    assert (manifest["eos_id"], manifest["dtype"], manifest["vocab_size"]) == (eos, "uint16", 400)
    assert sorted(os.listdir(tmp_path)) == ["a.jsonl", "b.txt", "corpus.bin",  # no leftovers
                                            "corpus.bin.index", "corpus.json"]  # (TokenFile's)


def test_an_interrupted_run_rerun_writes_the_same_bytes(tmp_path, tokenizer_dir, capsys,
                                                       monkeypatch):
    from tokenizers import Tokenizer
    monkeypatch.setattr(tokenizing, "BATCH", 100)
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    docs, manifest = paragraphs(450), {"inputs": ["docs"]}

    def failing():
        yield from docs[:250]
        raise OSError("the input went away")
    with pytest.raises(OSError):
        tokenizing.tokenize(tokenizer, failing(), str(tmp_path / "x.bin"), 1, manifest)
    assert not (tmp_path / "x.bin").exists()  # only x.bin.tmp and its progress record
    tokenizing.tokenize(tokenizer, iter(docs), str(tmp_path / "x.bin"), 1, manifest)
    assert "resuming after 200 documents" in capsys.readouterr().out
    tokenizing.tokenize(tokenizer, iter(docs), str(tmp_path / "clean.bin"), 1, manifest)
    assert (tmp_path / "x.bin").read_bytes() == (tmp_path / "clean.bin").read_bytes()
    assert np.fromfile(tmp_path / "x.bin", np.uint16).tolist().count(1) >= 450


def test_a_missing_column_or_eos_token_is_named(tmp_path, tokenizer_dir, capsys):
    (tmp_path / "a.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    for flags, message in ((["--text_column", "text"], "--text_column 'text': "),
                           (["--eos_token", "<nope>"], "--eos_token: ")):
        with pytest.raises(SystemExit):
            main(["tokenize", str(tmp_path / "a.jsonl"), "--tokenizer", str(tokenizer_dir),
                  "--out", str(tmp_path / "c.bin"), *flags])
        assert message in capsys.readouterr().err
