"""The kill test: a training process SIGKILLed at several points (mid-epoch, in the middle of a
checkpoint write, right after a checkpoint, ...) and rerun with the same command each time ends
with params bitwise equal to those of an uninterrupted run."""
import glob
import json
import os
import signal
import subprocess
import sys

import numpy as np

from redco import checkpointing

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kill_worker.py")
TIMEOUT = 300


def worker_env():
    env = dict(os.environ)
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8", HF_HUB_OFFLINE="1",
               REDCO_DISABLE_PLUGIN_AUTOLOAD="1", JAX_PLATFORMS="cpu")
    return env


def start(workdir, kill=None):
    """The worker's command, started; its output goes to a file (a pipe nobody reads while it
    runs could fill up and stall it)."""
    cmd = [sys.executable, WORKER, workdir] + (["--kill", kill] if kill else [])
    log = open(f"{workdir}.{(kill or 'done').replace(':', '_')}.out", "w+")
    proc = subprocess.Popen(cmd, env=worker_env(), stdout=log, stderr=subprocess.STDOUT)
    proc.log = log
    return proc


def finish(proc, expected_rc):
    try:
        proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    proc.log.seek(0)
    out = proc.log.read()
    proc.log.close()
    assert proc.returncode == expected_rc, (
        f"{proc.args} exited with {proc.returncode}, expected {expected_rc} (timeout "
        f"{TIMEOUT} s):\n{out[-4000:]}")
    return out


def run(workdir, kill=None):
    return finish(start(workdir, kill), -signal.SIGKILL if kill else 0)


def ckpt_names(workdir):
    return sorted(os.listdir(os.path.join(workdir, "ckpts")))


def latest(workdir):
    found = checkpointing.step_ckpts(os.path.join(workdir, "ckpts"))
    return os.path.basename(found[-1]) if found else None


def metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_sigkilled_training_rerun_until_done_matches_an_uninterrupted_run(tmp_path):
    # 4 updates an epoch, 3 epochs; checkpoints at steps 3, 4 (epoch end), 6, 8 (epoch end),
    # 9 and 12 (epoch end), the last two kept.
    full, killed = str(tmp_path / "full"), str(tmp_path / "killed")
    uninterrupted = start(full)  # runs beside the killed runs (they are all independent)

    # 1. mid-epoch, between checkpoints: step_3 and step_4 are on disk, step 6 is not reached.
    run(killed, "step:5")
    assert ckpt_names(killed) == ["step_3", "step_4"]

    # 2. in the middle of writing step_6 (resumed from step_4): a half-written step_6.tmp is
    #    left behind, without meta.json, and is not taken for a checkpoint.
    run(killed, "write:6")
    assert ckpt_names(killed) == ["step_3", "step_4", "step_6.tmp"]
    tmp = os.path.join(killed, "ckpts", "step_6.tmp")
    assert os.path.isdir(os.path.join(tmp, "state"))
    assert not os.path.exists(os.path.join(tmp, "meta.json"))
    assert latest(killed) == "step_4"

    # 3. right after step_8 (an epoch's end) is saved and the older ones pruned: the rerun
    #    starts the third epoch from its first update. (The rerun of step 2 rewrote step_6.)
    run(killed, "saved:8")
    assert ckpt_names(killed) == ["step_6", "step_8"]
    assert latest(killed) == "step_8"

    # 4. in the middle of writing the last checkpoint, step_12, at the end of training.
    run(killed, "write:12")
    assert ckpt_names(killed) == ["step_12.tmp", "step_8", "step_9"]
    assert latest(killed) == "step_9"
    assert not os.path.exists(os.path.join(killed, "final.npz"))

    # 5. the same command once more, without a kill, finishes the run.
    run(killed)
    finish(uninterrupted, 0)

    with open(os.path.join(killed, "starts.txt")) as f:  # where each of the 5 runs started
        assert [int(line) for line in f] == [0, 4, 4, 8, 9]
    with open(os.path.join(full, "starts.txt")) as f:
        assert [int(line) for line in f] == [0]
    assert ckpt_names(killed) == ckpt_names(full) == ["step_12", "step_9"]
    leftovers = [p for pattern in ("*.tmp", "*.old")
                 for p in glob.glob(os.path.join(killed, "ckpts", pattern))]
    assert not leftovers, f"left behind after the run finished: {leftovers}"

    # every step's loss and grad norm, also those logged by a run killed later, is the same
    # float as in the uninterrupted run (steps redone after a kill are logged again).
    full_metrics = {m["step"]: m for m in metrics(full)}
    assert sorted(full_metrics) == list(range(1, 13))
    killed_metrics = metrics(killed)
    assert {m["step"] for m in killed_metrics} == set(full_metrics)
    for m in killed_metrics:
        assert m == full_metrics[m["step"]]

    a, b = np.load(os.path.join(full, "final.npz")), np.load(os.path.join(killed, "final.npz"))
    assert sorted(a.files) == sorted(b.files) and len(a.files) > 10
    assert int(a["__step__"]) == int(b["__step__"]) == 12
    for name in a.files:
        np.testing.assert_array_equal(b[name], a[name], err_msg=name)
