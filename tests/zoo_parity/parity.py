"""What the parity tests share: perturbed random weights, loading, logits, the tolerance."""
import jax
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
torch.use_deterministic_algorithms(True)


def jiggle_torch(model, seed=0):
    """Perturb every weight (layer norms and biases included) so a misplaced one shows."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def jiggle_ours(model, seed=0):
    params = nnx.state(model, nnx.Param)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    nnx.update(model, jax.tree.unflatten(
        tree, [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]))
    return model


def saved(model, path):
    model.save_pretrained(path)
    return str(path)


def load_hf(cls, path):
    model, info = cls.from_pretrained(path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


def torch_logits(model, **inputs):
    with torch.no_grad():
        return model(**{k: torch.tensor(np.asarray(v)) for k, v in inputs.items()}).logits.numpy()


def close(a, b):
    """Equal up to float32 summation order: torch's and XLA's CPU kernels differ by up to ~2e-4
    on logits of size ~5 (seen on CI's CPUs); a wrong layer or mask is off by far more."""
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=5e-4, rtol=1e-4)


def hf_greedy(model, first, skip: int, n_new: int, eos: int, pad: int, **inputs) -> np.ndarray:
    """transformers' greedy tokens for ``generate(first, **inputs)`` after its first ``skip``
    (the prompt, or the decoder's start token), padded with ``pad`` to ``n_new``."""
    with torch.no_grad():
        out = model.generate(torch.tensor(np.asarray(first)), max_new_tokens=n_new,
                             do_sample=False, eos_token_id=eos, pad_token_id=pad,
                             **{k: torch.tensor(v) for k, v in inputs.items()}).numpy()[:, skip:]
    return np.pad(out, ((0, 0), (0, n_new - out.shape[1])), constant_values=pad)
