"""Build a wheel of every distribution in this checkout into ``dist/``:
``python tools/build_dists.py``; then ``pip install --find-links dist redco-zoo-maml`` (or any
other) resolves redco and its sibling distributions from there, as from an index.

A distribution is a folder with a ``pyproject.toml``: ``core/``, ``plugins/*/`` and ``zoo/*/``,
found by glob so that a new plugin or zoo package is built with no edit here. Only pip is needed
(``pip wheel`` fetches hatchling into an isolated build environment; it builds from the sources
as they are and leaves nothing behind in the source tree)."""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATTERNS = ("core", "plugins/*", "zoo/*")


def distributions() -> list[str]:
    """The folders under ``ROOT`` matching ``PATTERNS`` that hold a ``pyproject.toml``."""
    return [os.path.dirname(p) for pattern in PATTERNS
            for p in sorted(glob.glob(os.path.join(ROOT, pattern, "pyproject.toml")))]


def build(dest: str = os.path.join(ROOT, "dist")) -> list[str]:
    """Build every distribution's wheel into ``dest``; return the wheels' paths."""
    start = time.time()
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", dest,
                           *distributions()])
    if done.returncode:
        sys.exit(f"build_dists: pip wheel failed (exit {done.returncode}); its error is above.")
    wheels = sorted(glob.glob(os.path.join(dest, "*.whl")))
    return [path for path in wheels if os.path.getmtime(path) >= start - 1]


if __name__ == "__main__":
    built = build()
    print(f"built {len(built)} wheels:", *(os.path.relpath(path) for path in built), sep="\n  ")
