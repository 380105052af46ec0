"""Write ``constraints.txt``, the versions CI tests, after a deliberate upgrade:
``python tools/pin_constraints.py`` (needs ``uv``, e.g. the one in ``.venv`` after ``.ci/run``),
then run ``tox`` and commit both.

It resolves ``tools/constraints.in`` (every distribution here and what the tox environments
add) for this Python and keeps every pin except this checkout's own distributions and the
HuggingFace stack tox.ini pins per line ([hf5], [hf4]); a local build's ``+cpu`` tag is dropped so
the pin matches PyPI's wheel as well."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PER_LINE = ("transformers", "tokenizers", "huggingface-hub")  # pinned in tox.ini's [hf5]/[hf4]
HEADER = """\
# What CI tests: every tox environment installs with this file as its constraints
# (UV_CONSTRAINT / PIP_CONSTRAINT in tox.ini), so a run next month tests what this one did.
# Written by tools/pin_constraints.py from tools/constraints.in; regenerate after an upgrade.
# Not here: transformers, tokenizers and huggingface-hub, the one stack tested at two versions
# (transformers 5 for the zoo, 4.x for the paper's script and 0.4-era code); tox.ini pins each
# line exactly in its [hf5] and [hf4] sections.
"""


def pins(resolved: str) -> list[str]:
    """``name==version`` lines of ``uv pip compile`` output, less ours and the per-line stack."""
    out = []
    for line in resolved.splitlines():
        found = re.match(r"^([A-Za-z0-9_.-]+)==([^\s;]+)", line)
        if found and not found.group(1).startswith("redco") and found.group(1) not in PER_LINE:
            out.append(f"{found.group(1)}=={found.group(2).split('+')[0]}")
    return out


if __name__ == "__main__":
    uv = shutil.which("uv") or os.path.join(ROOT, ".venv", "bin", "uv")
    done = subprocess.run([uv, "pip", "compile", "-q", "--no-header", "--no-annotate",
                           os.path.join("tools", "constraints.in")],
                          cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"pin_constraints: uv pip compile failed:\n{done.stderr}")
    with open(os.path.join(ROOT, "constraints.txt"), "w") as f:
        f.write(HEADER + "\n".join(pins(done.stdout)) + "\n")
    print(f"wrote constraints.txt: {len(pins(done.stdout))} pins")
