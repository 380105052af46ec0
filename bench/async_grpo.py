"""Asynchronous GRPO rollouts against synchronous ones on 8 simulated CPU devices: the
post-training tutorial's task (``tests/zoo/test_post_training.write_task``: a tiny chat model
after its SFT warm-up), ``--rounds`` rounds of 16 prompts x 16 samples each, run as

* ``sync``: rollouts on the 8 training devices (``--rollout_devices 0``), today's GRPO;
* ``N=4 K=0``: rollouts on 4 devices of their own, on-policy;
* ``N=4 K=1`` and ``N=4 K=2``: the same, running 1 and 2 rounds ahead of the updates.

Prints each run's mean round time (the logged rounds' spacing, the first two left out: they
compile) and completion tokens per second; for the rollout-mesh runs, from ``timeline.jsonl``,
the seconds each round's update overlapped a rollout (``[start, ready]`` on the worker against
``[dispatch, ready]`` of the update) and the share of update time that was. Two CPU cores run
all 8 simulated devices, so overlap shows in the timeline before it shows in round times.

    python bench/async_grpo.py [--rounds 12] [--workdir /tmp/async_grpo]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "zoo"))
from provenance import print_provenance  # noqa: E402
from test_post_training import write_task  # noqa: E402

SAMPLES = 16 * 16  # a round's: 16 prompts x 16 samples
RUNS = {"sync": [], "N=4 K=0": ["--rollout_devices", "4"],
        "N=4 K=1": ["--rollout_devices", "4", "--max_off_policy_steps", "1"],
        "N=4 K=2": ["--rollout_devices", "4", "--max_off_policy_steps", "2"]}


def redco(*args: str) -> None:
    env = dict(os.environ, XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
               + " --xla_force_host_platform_device_count=8")
    subprocess.run([sys.executable, "-m", "redco.cli", *args], check=True, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def overlap(timeline: list[dict]) -> tuple[float, float]:
    """Seconds of updates during which a rollout ran, and all updates' seconds (rounds 2 on)."""
    rollouts = [(t["rollout_start"], t["rollout_ready"]) for t in timeline if "rollout_start" in t]
    shared = total = 0.0
    for t in timeline[1:]:
        a, b = t["update_dispatch"], t["update_ready"]
        total += b - a
        shared += sum(max(0.0, min(b, end) - max(a, start)) for start, end in rollouts)
    return shared, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--workdir", default="/tmp/async_grpo")
    args = parser.parse_args()
    print_provenance()
    os.makedirs(args.workdir, exist_ok=True)
    root = args.workdir
    if not os.path.isdir(os.path.join(root, "sft", "model")):
        write_task(__import__("pathlib").Path(root), seed=0)
        redco("zoo", "run", "sft", "--model", f"{root}/tiny-chat", "--train",
              f"{root}/chats.jsonl", "--workdir", f"{root}/sft", "--max_len", "16",
              "--per_device_batch_size", "2", "--n_epochs", "4", "--learning_rate", "3e-3")
    print(f"{'run':10s} {'round s':>8s} {'tokens/s':>9s} {'update s overlapped':>22s}")
    for name, flags in RUNS.items():
        workdir = os.path.join(root, name.replace(" ", "_").replace("=", ""))
        subprocess.run(["rm", "-rf", workdir], check=True)
        redco("zoo", "run", "grpo", "--model", f"{root}/sft/model", "--train",
              f"{root}/prompts.jsonl", "--workdir", workdir, "--n_rounds", str(args.rounds),
              "--prompts_per_round", "16", "--n_samples", "16", "--max_new_tokens", "4",
              "--max_prompt_len", "16", "--per_device_batch_size", "8",
              "--eval_every_n_rounds", str(args.rounds), "--learning_rate", "5e-4", *flags)
        logged = [r for r in rows(os.path.join(workdir, "metrics.jsonl"))
                  if "rollout/reward" in r]
        round_s = float(np.mean(np.diff([r["time"] for r in logged[2:]])))
        tokens = np.mean([r["rollout/completion_tokens"] * SAMPLES for r in logged[2:]])
        shown = ""
        if flags:
            shared, total = overlap(rows(os.path.join(workdir, "timeline.jsonl")))
            shown = f"{shared:.2f} of {total:.2f} ({shared / total:.0%})"
        print(f"{name:10s} {round_s:8.3f} {tokens / round_s:9.0f} {shown:>22s}", flush=True)


if __name__ == "__main__":
    main()
