"""The "Does it fit?" block of docs/guides/layouts.md, run as written from the repository root:
its printed output must be the one the page shows (compile times aside), so the two cannot
drift."""
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.join(REPO, "tests"))
from readme_blocks import block  # noqa: E402

PAGE = "docs/guides/layouts.md"


def shown_output() -> str:
    """The ```text block right after the page's "fit" block."""
    with open(os.path.join(REPO, PAGE)) as f:
        readme = f.read()
    found = re.search(r"<!-- block fit: .*? -->\n```bash\n.*?```\n\n```text\n(.*?)```", readme, re.S)
    assert found, f"{PAGE}: the fit block is not followed by its ```text output"
    return found.group(1)


def without_times(text: str) -> str:
    return re.sub(r"compiled in [\d.]+s", "compiled in ...s", text)


def test_the_docs_fit_block_prints_what_the_page_shows():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # a user's shell has none
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env["PATH"]])
    done = subprocess.run(["bash", "-ec", block("fit", "docs/guides/layouts.md")], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert without_times(done.stdout) == without_times(shown_output())
    # the levers in order on the scanned default: remat (full; not dots_saveable), then LoRA
    assert "remat=full peak" in done.stdout and "remat=dots_saveable" not in done.stdout
    assert "remat='none', LoRA rank 8" in done.stdout
