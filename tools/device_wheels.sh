#!/usr/bin/env bash
# Wheels for a lent GPU machine (no registry there; its own jax, flax, optax, orbax-checkpoint,
# transformers and tokenizers are used): redco's distributions that the benches import, built
# from this tree, and what the serving bench needs beyond that image (the `openai` client and
# the server's HTTP stack), pinned by constraints.txt, for CPython 3.12 on x86-64 Linux.
# Writes .whl/ (ignored by git through .git/info/exclude). On the device, before a bench:
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
# (no preallocation: a bench's parent process and its worker or server share the GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
rm -rf .whl && mkdir .whl
python3 -m venv /tmp/device-wheels-venv
/tmp/device-wheels-venv/bin/pip install -q -c constraints.txt hatchling wheel
for dist in core plugins/ip plugins/safetensors plugins/planner plugins/serve zoo/models; do
    /tmp/device-wheels-venv/bin/pip wheel -q --no-deps --no-build-isolation -w .whl "./$dist"
done
pinned() { grep -i "^$1==" constraints.txt; }
# the image lacks these (its package list: the device tool's KINDS.md)
extra=(openai httpx2 httpcore2 truststore pydantic pydantic-core annotated-types
       typing-inspection jiter distro sniffio anyio idna typing-extensions starlette uvicorn
       httptools)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
    $(for p in "${extra[@]}"; do pinned "$p"; done)
du -sh .whl
