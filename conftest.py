"""Every test run of this repository: tests marked ``slow`` (a pipeline learning its task end to
end, the docs' post-training walk-through, the same property at a bigger size than the fast test that
guards it) run only with ``REDCO_SLOW_TESTS=1`` (``REDCO_SLOW_TESTS=1 tox p``), so that the
default ``tox p`` fits CI's budget; each is listed as deselected."""
import os


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: runs only with REDCO_SLOW_TESTS=1 (conftest.py)")


def pytest_collection_modifyitems(config, items):
    if os.environ.get("REDCO_SLOW_TESTS") == "1":
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if not item.get_closest_marker("slow")]
