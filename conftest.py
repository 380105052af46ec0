"""Every test run of this repository: tests marked ``slow`` (a pipeline learning its task end to
end, the docs' post-training walk-through, the same property at a bigger size than the fast test that
guards it) run only with ``REDCO_SLOW_TESTS=1`` (``REDCO_SLOW_TESTS=1 tox p``), so that the
default ``tox p`` fits CI's budget; each is listed as deselected.

Python's cyclic garbage collector runs far less often in test processes: tracing a jax program
allocates millions of short-lived objects, and at Python's default thresholds (700, 10, 10) a
test process with jax, flax and transformers imported spent 6-8% of its CPU in ``gc`` (measured
with ``gc.callbacks`` over tests/zoo/test_moe.py, test_context_parallel.py and test_lora.py: 7.3-8.7
CPU s of 105-127, 2.6-3.7 s at the thresholds below; peak memory 3-8% higher)."""
import gc
import os

gc.set_threshold(100_000, 50, 1_000)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: runs only with REDCO_SLOW_TESTS=1 (conftest.py)")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("REDCO_SLOW_TESTS") == "1":
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]
