"""GRPO under ``redco launch`` with 2 processes on 127.0.0.1 (4 devices each) samples the same
rollouts and ends at the same params as 1 process with 8 devices: every process gets every
completion (the sampler's outputs are gathered), scores them alike, and trains on its rows."""
import json
import subprocess
import sys

import numpy as np
from multihost_helpers import free_port, simulated_devices, worker_env

from redco_zoo_models.toy import save_tiny_chat_model

WORDS = ["system", "user", "assistant"] + [f"x{i}" for i in range(20)] + \
    [f"y{i}" for i in range(20)]


def write_task(root) -> None:
    """A tiny untrained LLaMA and prompts "x_a x_b"; the reward: the completion starts with a
    y word (``regex_match``), which an untrained model's samples do about 40% of the time."""
    save_tiny_chat_model(str(root / "model"), WORDS)
    with open(root / "prompts.jsonl", "w") as f:
        for a, b in np.random.default_rng(0).integers(0, 20, (64, 2)):
            f.write(json.dumps({"prompt": f"x{a} x{b}", "pattern": "y.*"}) + "\n")


def grpo(root, workdir, n_devices: int) -> list[str]:
    return [sys.executable, "-m", "redco.cli", "zoo", "run", "grpo", "--model",
            str(root / "model"), "--train", str(root / "prompts.jsonl"), "--workdir",
            str(workdir), "--reward", "regex_match", "--n_rounds", "3", "--n_model_shards", "2",
            "--per_device_batch_size", str(64 // n_devices), "--prompts_per_round", "8",
            "--n_samples", "8", "--max_new_tokens", "4", "--max_prompt_len", "16",
            "--learning_rate", "1e-3", "--beta", "0.1", "--n_updates", "2",
            "--save_every_n_steps", "4"]  # every round (a checkpoint kill test's reference)


def rollouts_and_params(workdir):
    from safetensors.numpy import load_file
    with open(workdir / "metrics.jsonl") as f:
        rollouts = [{k: v for k, v in row.items() if k.startswith("rollout/")}
                    for row in map(json.loads, f) if "rollout/reward" in row]
    return rollouts, load_file(workdir / "model" / "model.safetensors")


def launched_on_two_processes(root) -> None:
    """``grpo`` under ``redco launch --launcher ip --run`` on 2 processes (4 devices each), in
    ``root/two`` (``conftest.py``'s ``grpo_two_processes``: run once, shared)."""
    two = subprocess.run(
        [sys.executable, "-m", "redco.cli", "launch", "--launcher", "ip", "--hosts",
         "127.0.0.1,127.0.0.1", "--port", str(free_port()), "--run", "--",
         *grpo(root, root / "two", 8)], capture_output=True, text=True,
        env=worker_env(XLA_FLAGS=simulated_devices(4)), timeout=600)
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    assert "processes: 2" in (root / "two" / "log.txt").read_text()


def test_grpo_on_two_processes_samples_and_trains_like_one(grpo_two_processes):
    tmp_path = grpo_two_processes
    one = subprocess.run(grpo(tmp_path, tmp_path / "one", 8), capture_output=True, text=True,
                         env=worker_env(XLA_FLAGS=simulated_devices(8)),
                         timeout=600)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    (one_rollouts, one_params), (two_rollouts, two_params) = (
        rollouts_and_params(tmp_path / name) for name in ("one", "two"))
    assert len(one_rollouts) == 3 and 0 < one_rollouts[0]["rollout/reward"] < 1
    for a, b in zip(one_rollouts, two_rollouts):
        assert a["rollout/reward"] == b["rollout/reward"]
        assert a["rollout/completion_tokens"] == b["rollout/completion_tokens"]
        assert abs(a["rollout/kl"] - b["rollout/kl"]) <= 1e-4 * a["rollout/kl"] + 1e-7
    for name, value in one_params.items():
        np.testing.assert_allclose(two_params[name], value, rtol=1e-4, atol=1e-5, err_msg=name)
