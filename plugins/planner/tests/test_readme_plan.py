"""The "See a plan before you run it" block of docs/guides/layouts.md, run as written from the
repository root: install the planner with its presets, print LLaMA-7B's rules on 8 devices and plan it on 4
devices of 80 GB (AOT compiles on abstract shapes: nothing allocated). At 80 GB the first layout
compiled (mp=1 auto+fsdp; mp=1 auto's params and AdamW state alone are over the budget, so it is
not compiled) fits: one compile of LLaMA-7B's step, where 40 GB took three."""
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.join(REPO, "tests"))
from readme_blocks import block  # noqa: E402


def test_the_readme_plan_block_runs_as_written():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # a user's shell has none
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env["PATH"]])  # this env's pip
    done = subprocess.run(["bash", "-ec", block("plan", "docs/guides/layouts.md")], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    # LLaMA-7B's 6.74e9 fp32 params, split 8 ways by auto+fsdp with nothing replicated
    assert "total: 25.10 GiB (26953662464 bytes)" in out, out[-3000:]
    assert "1.00x ideal" in out and "replicated: 0 B" in out, out[-3000:]
    compiled = re.findall(r"mp=(\d+)\s+(?:cp=(\d+)\s+)?dp=(\d+)\s+(\S+)\s+peak\s+([\d.]+) GiB", out)
    assert compiled and all(int(mp) * int(cp or 1) * int(dp) == 4
                            for mp, cp, dp, _, _ in compiled), out[-3000:]
    pick = re.search(r"pick: n_model_shards=(\d+), n_context_shards=(\d+), sharding_rules='(\S+)' "
                     r"\(peak (\d+)% of", out)
    assert pick and int(pick.group(4)) <= 90, out[-3000:]  # within the planner's 10% headroom
