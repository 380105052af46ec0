"""The serving engine on the recurrent families (Gated DeltaNet: Qwen3.5 dense and MoE; Mamba2:
Granite 4 hybrid; both in every layer: Falcon-H1, its cache the keys and values and the
Mamba2 state; one block a layer: Nemotron-H, whose MLP layers keep no cache), on Llama 4
(whose chunk mask and NoPE temperature count each row's slots) and on Gemma 4 (whose last
layers attend to another layer's cache), against transformers' PyTorch models, from
checkpoints transformers wrote.

Prompts of 3 to 37 tokens are read in one right-padded prefill (to 64 slots: past the
convolutions' widths of 3 and 4 and over several chunks, of 16 for the delta rule and 8 for
Mamba2), so padding must leave each row's recurrent state and conv inputs as its last real token
left them; a later request then takes a row another one left, and must start from a zero state.
Each request's greedy tokens are transformers' own ``generate`` tokens for its prompt alone, and
each token's log-probability is transformers' ``log_softmax`` of the logits there.

Qwen3.5-MoE is a slow-tier repeat of Qwen3.5's recurrent rows (its experts change the MLP, not the
cache): in CI the qwen3.5 case guards the rows, and tests/serve/test_engine.py's
test_sharded_engine_answers_as_one_device (on Qwen3-MoE) the engine over experts."""
import dataclasses

import numpy as np
import pytest
import torch
from flax import nnx
from parity import hf_greedy, transformers

from redco_zoo_models import from_pretrained
from redco_zoo_models.engine import Engine
from redco_zoo_models.hf import auto_class
from redco_zoo_models.requests import Sampling
from redco_zoo_models.toy import TINY_FAMILIES

EOS, PAD, NEW = 63, 0, 8
LENGTHS = (3, 37, 11, 20, 6)  # the first three read in one prefill; the last two reuse rows


@pytest.fixture(scope="module", params=["qwen3.5", pytest.param("qwen3.5-moe", marks=pytest.mark.slow),
                                        "granite-4-h", "llama4", "gemma4", "falcon-h1",
                                        "nemotron-h"])
def pair(request, tmp_path_factory):
    """transformers' model (weights perturbed by 0.1, as test_parity_gated_deltanet's) and ours
    read from the checkpoint it saved; our delta rule in chunks of 16."""
    config = dict(TINY_FAMILIES[request.param], eos_token_id=EOS, pad_token_id=PAD)
    config = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in theirs.parameters():
            p.add_(0.1 * torch.randn_like(p))
    path = str(tmp_path_factory.mktemp(request.param))
    theirs.eval().save_pretrained(path)
    ours = from_pretrained(auto_class(path), path)
    if hasattr(ours.cfg, "delta_chunk_size"):
        small = type(ours)(dataclasses.replace(ours.cfg, delta_chunk_size=16), nnx.Rngs(0))
        nnx.update(small, nnx.state(ours, nnx.Param))
        ours = small
    return theirs, ours


def prompts():
    rng = np.random.RandomState(1)
    return [[int(t) for t in rng.randint(1, EOS, n)] for n in LENGTHS]


def check_against_transformers(theirs, prompt, sample, n_new=NEW):
    """``sample``'s tokens are transformers' ``n_new`` greedy ones after ``prompt`` (up to its
    EOS), and its log-probs transformers' log_softmax at each of them within 1e-5."""
    want = hf_greedy(theirs, [prompt], len(prompt), n_new, EOS, PAD)[0]
    got = np.pad(sample.tokens, (0, n_new - len(sample.tokens)), constant_values=PAD)
    np.testing.assert_array_equal(got, want, err_msg=f"prompt of {len(prompt)}")
    with torch.no_grad():
        logits = theirs(torch.tensor([prompt + sample.tokens])).logits[0].double()
    places = np.arange(len(sample.tokens)) + len(prompt) - 1
    expected = torch.log_softmax(logits, -1).numpy()[places, sample.tokens]
    np.testing.assert_allclose(sample.logprobs, expected, atol=1e-5)


def test_greedy_tokens_and_logprobs_equal_transformers_as_rows_are_reused(pair):
    """Four rows. Three prompts (3, 37 and 11 tokens) prefilled at once into rows 0-2; when the
    first ends (4 new tokens), a fourth prompt's ``n=2`` samples take its row and row 3 (its
    prefill copied to both) while the other two decode on; a fifth then takes the rows they
    leave."""
    theirs, ours = pair
    engine = Engine(ours, nnx.state(ours, nnx.Param), max_seqs=4, max_len=64,
                    eos_token_ids=(EOS,))
    budgets, n = (4, NEW, NEW, NEW, NEW), (1, 1, 1, 2, 1)
    requests = [engine.submit(p, Sampling(max_tokens=b, n=k))
                for p, b, k in zip(prompts(), budgets, n)]
    engine.run_until_done(requests)
    for prompt, request, n_new in zip(prompts(), requests, budgets):
        for sample in request.samples:
            check_against_transformers(theirs, prompt, sample, n_new)
