"""``redco zoo run ... --scan_layers``: the flag reaches the model (``ModelSource.scan_layers``,
``runner.load_source``), a scanned run trains as the unrolled run of the same settings, and a
model that cannot stack its layers is refused before anything is built."""
import json

import numpy as np
import pytest
from flax import nnx

from redco.cli import main
from redco.protocols import UsageError
from redco.tree_paths import named_leaves
from redco_zoo_models import LlamaForCausalLM, from_pretrained, runner
from redco_zoo_models.settings import ModelSource
from redco_zoo_models.toy import save_model_dir, tiny_llama, word_tokenizer

WORDS = "zero one two three four five six seven eight nine".split()


def losses(workdir) -> list[float]:
    with open(workdir / "metrics.jsonl") as f:
        return [row["train/loss"] for row in map(json.loads, f) if "train/loss" in row]


@pytest.mark.parametrize("lora", [[], ["--lora_rank", "2"]], ids=["full", "lora"])
def test_a_scanned_lm_run_trains_as_the_unrolled_run(lora, tmp_path):
    """The same 3 updates (same seed, same draws: the stacks, and LoRA's stacked adapters,
    start from the unrolled weights), the same losses; the trained model saved per layer (with
    LoRA: merged), as the unrolled run saves it; the model the run loaded was stacked."""
    tokenizer = word_tokenizer(WORDS, ("<pad>", "</s>", "<unk>", "<s>"))
    save_model_dir(tiny_llama(tokenizer.get_vocab_size()), tokenizer, str(tmp_path / "model"))
    starts = np.random.default_rng(0).integers(0, 10, 40)
    (tmp_path / "train.txt").write_text("".join(
        " ".join(WORDS[(s + i) % 10] for i in range(40)) + "\n" for s in starts))
    flags = ["--model", str(tmp_path / "model"), "--train", str(tmp_path / "train.txt"),
             "--max_steps", "3", "--block_size", "16", "--per_device_batch_size", "1",
             "--learning_rate", "0.003", "--eval_steps", "1", *lora]
    for side in ("unrolled", "scanned"):
        main(["zoo", "run", "lm", *flags, "--workdir", str(tmp_path / side),
              "--scan_layers" if side == "scanned" else "--no_scan_layers"])
    want, got = losses(tmp_path / "unrolled"), losses(tmp_path / "scanned")
    assert len(got) == 3 and got[-1] < got[0]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    trained = [from_pretrained(LlamaForCausalLM, str(tmp_path / side / "model"),
                               scan_layers=False) for side in ("unrolled", "scanned")]
    np.testing.assert_allclose(trained[1].model.layers[1].mlp.down_proj.kernel[...],
                               trained[0].model.layers[1].mlp.down_proj.kernel[...],
                               rtol=1e-4, atol=1e-6)
    scanned, _ = runner.load_source(ModelSource(str(tmp_path / "model"), scan_layers=True), 0)
    assert [p for p, _ in named_leaves(nnx.state(scanned))
            if p.startswith("model/layers/0:2/")], "nothing stacked"


def test_a_model_that_is_not_a_decoder_is_refused_scanned(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5"}))
    with pytest.raises(UsageError, match="T5ForConditionalGeneration does not stack its layers"):
        runner.load_model(str(tmp_path), True, 0, scan_layers=True)
