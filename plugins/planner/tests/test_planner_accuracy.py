"""The planner's pick really fits: the layout it chooses for a tight budget, trained for real,
peaks below that budget. Measured as the peak RSS of a fresh process (``peak_rss_worker.py``)
whose simulated CPU devices all live in host memory, so with n devices the process's peak is
compared with n budgets."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("peak_rss_worker.py")
# One layer, a 4096-token vocabulary, 4 x 256 tokens per device: the logits and their gradients
# (temporaries) outweigh the 1.2M params, so a planner that drops activations picks wrong.
MODEL = {"vocab_size": 4096, "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2}
# Measured on CPU, real / planned was 1.01 to 1.03 (see the report in the assertion messages);
# an estimate more than 1 / 0.9 = 1.11x the real peak would make the planner shard models that
# fit, so the real peak must be at least this fraction of the planned one.
FLOOR = 0.9


def run_worker(**args) -> dict:
    """``peak_rss_worker.py`` in its own process (its memory is the measurement; it sets the
    device count before jax is imported); its JSON line. The suite's other XLA flags (cheap
    code generation) stay: the plan and the steps measured are compiled alike either way (real
    / planned 1.014 and 1.016 with them, 0.984 without), and the worker costs half the CPU."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    env = {**os.environ, "XLA_FLAGS": flags}
    done = subprocess.run([sys.executable, str(WORKER), json.dumps(args)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def report(m: dict) -> str:
    n = m["n_devices"]
    return (f"{n} devices, mp={m['n_model_shards']}: planned {m['planned'] / 2 ** 20:.2f} MiB per "
            f"device, budget {m['budget'] / 2 ** 20:.2f} MiB; real peak {m['real_total'] / 2 ** 20:.2f} "
            f"MiB in all = {m['real_total'] / (n * m['planned']):.3f} x planned, "
            f"{m['real_total'] / (n * m['budget']):.3f} x budget\n{m['plan']}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak RSS in /proc/self")
def test_the_chosen_layout_peaks_below_the_budget_it_was_planned_for():
    """The budget is the tightest that gets a model-parallel pick (its usable bytes are the
    pick's peak, and mp=1's peak is above them); the three train steps measured after the first
    (compile included) must stay under it. A planner that leaves out temporaries or optimizer
    state, or plans to the last byte when the runtime needs a few percent more, fails; so does one
    that overcounts (FLOOR)."""
    m = run_worker(n_devices=4, config=MODEL, seq_len=256, batch=4, steps=3)
    n = m["n_devices"]
    print(report(m))
    assert m["n_model_shards"] > 1 and m["mp1_planned"] > m["planned"], report(m)
    assert m["real_total"] <= n * m["budget"], report(m)
    assert m["real_total"] >= FLOOR * n * m["planned"], report(m)
