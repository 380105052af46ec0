"""Parity with HuggingFace's PyTorch models (needs torch and transformers): JAX on CPU, exact
matmuls, offline hubs."""
import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
