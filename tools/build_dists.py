"""Build a wheel of every distribution in this checkout into ``dist/``:
``python tools/build_dists.py``; then ``pip install --find-links dist redco-zoo-maml`` (or any
other) resolves redco and its sibling distributions from there, as from an index.

A distribution is a folder with a ``pyproject.toml``: ``core/``, ``plugins/*/`` and ``zoo/*/``,
found by glob so that a new plugin or zoo package is built with no edit here. Only pip is needed:
it fetches hatchling (every distribution's build backend) once into a temporary folder, and ``pip
wheel --no-build-isolation`` builds each wheel with it from the sources as they are, leaving
nothing behind in the source tree (one isolated build environment per distribution, pip's
default, cost ~3 s of CPU each)."""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATTERNS = ("core", "plugins/*", "zoo/*")
BACKEND = "hatchling>=1.27"  # every pyproject.toml's [build-system] requires (tests/install checks)


def distributions() -> list[str]:
    """The folders under ``ROOT`` matching ``PATTERNS`` that hold a ``pyproject.toml``."""
    return [os.path.dirname(p) for pattern in PATTERNS
            for p in sorted(glob.glob(os.path.join(ROOT, pattern, "pyproject.toml")))]


def pip(args: list[str], env: dict) -> None:
    """Run ``python -m pip ARGS`` with ``env``; exit saying which pip command failed."""
    done = subprocess.run([sys.executable, "-m", "pip", *args], env=env)
    if done.returncode:
        sys.exit(f"build_dists: pip {args[0]} failed (exit {done.returncode}); its error is above.")


def build(dest: str = os.path.join(ROOT, "dist")) -> list[str]:
    """Build every distribution's wheel into ``dest``; return the wheels' paths."""
    start = time.time()
    with tempfile.TemporaryDirectory() as backend:
        pip(["install", "-q", "--target", backend, BACKEND], os.environ)
        path = os.pathsep.join(filter(None, [backend, os.environ.get("PYTHONPATH")]))
        pip(["wheel", "-q", "--no-deps", "--no-build-isolation", "-w", dest, *distributions()],
            {**os.environ, "PYTHONPATH": path})
    wheels = sorted(glob.glob(os.path.join(dest, "*.whl")))
    return [path for path in wheels if os.path.getmtime(path) >= start - 1]


if __name__ == "__main__":
    built = build()
    print(f"built {len(built)} wheels:", *(os.path.relpath(path) for path in built), sep="\n  ")
