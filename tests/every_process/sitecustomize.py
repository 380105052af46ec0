"""Loaded at start by every Python process of a test run: tox.ini puts this folder on
``PYTHONPATH``, so pytest, the CLI runs and worker processes tests start, and pip, all load it.

Python's cyclic garbage collector runs far less often in them. Importing jax, flax and the zoo,
and tracing jax programs, allocate millions of short-lived objects, and at Python's default
thresholds (700, 10, 10) the collector took a large share of the suite's CPU: 7.3-8.7 of 105-127
CPU s over tests/zoo/test_moe.py, test_context_parallel.py and test_lora.py (``gc.callbacks``),
2.6-3.7 s at the thresholds below (peak memory 3-8% higher); ``import redco,
redco_zoo_lm.pipeline`` in a fresh process, 1.48-1.51 -> 1.29-1.33 user s.

With ``$PROCESS_PROFILE_OUT`` set, each process also reports where its CPU went
(``process_profile.py``)."""
import gc
import os

gc.set_threshold(100_000, 50, 1_000)

if os.environ.get("PROCESS_PROFILE_OUT"):
    import process_profile  # noqa: F401 (it registers what it measures)
