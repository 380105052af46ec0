"""What the checkpoint tests of tests/core (orbax, the directory machinery) and tests/formats (the
same checks for every format) share: a tiny LM trainer, host copies of trees, damaging files,
and driving kill_worker.py, the training command the kill tests kill and rerun."""
import json
import os
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import optax
from helpers import lm_collate, lm_examples, lm_loss, lm_model

from redco import Deployer, Trainer, checkpointing
from redco.sharding import named_leaves

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def lm_trainer(workdir, n_model_shards=2, fmt="orbax", model=None) -> Trainer:
    deployer = Deployer(jax_seed=0, n_model_shards=n_model_shards, workdir=workdir,
                        verbose=False, checkpoint_format=fmt)
    apply_fn, params = model or lm_model()
    return Trainer(deployer, lm_collate, apply_fn, lm_loss, params, optax.adamw(1e-3))


def placed(trainer: Trainer) -> Trainer:
    """``trainer`` with its layout decided and its state placed, as at ``fit``'s first batch, so
    that ``trainer.ckpt_tree()`` is the tree a checkpoint of it holds."""
    trainer.prepare(lm_examples(32), 1)
    return trainer


def host(tree) -> dict:
    """``{path: numpy array}`` of a pytree of (possibly sharded) arrays."""
    return {path: np.asarray(x) for path, x in named_leaves(jax.device_get(tree))}


def assert_bit_equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
        assert got[name].dtype == want[name].dtype, name


def state_files(ckpt: str) -> list[str]:
    return [os.path.join(d, f) for d, _, names in os.walk(os.path.join(ckpt, "state"))
            for f in names]


def biggest_file(ckpt: str) -> str:
    return max(state_files(ckpt), key=os.path.getsize)


def copy_ckpt(path, tmp_path) -> str:
    copy = str(tmp_path / os.path.basename(path))
    shutil.copytree(path, copy)
    return copy


def forge(ckpt: str, name: str, data: bytes) -> None:
    """Replace ``state/name`` with ``data``, updating meta.json's sizes and hashes as an attacker
    who controls the directory would."""
    with open(os.path.join(ckpt, "state", name), "wb") as f:
        f.write(data)
    meta_path = os.path.join(ckpt, "meta.json")
    with open(meta_path) as f:
        meta = json.load(f)
    meta["files"][name] = {"bytes": len(data),
                           "sha256": checkpointing.sha256(os.path.join(ckpt, "state", name))}
    with open(meta_path, "w") as f:
        json.dump(meta, f)


# ---- the kill tests: kill_worker.py started, killed, rerun -------------------------------------
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kill_worker.py")
TIMEOUT = 300


def half_the_biggest_file(ckpt_dir: str) -> int:
    """Half the size of the biggest file of the newest complete checkpoint in ``ckpt_dir`` (its
    meta.json records every file's size). The checkpoint written next holds the same arrays, so
    it has a file of about that size (orbax's compressed files vary by a few percent), and its
    writer passes this many bytes part way through that file."""
    with open(os.path.join(checkpointing.step_ckpts(ckpt_dir)[-1], "meta.json")) as f:
        return max(file["bytes"] for file in json.load(f)["files"].values()) // 2


# kill_worker.py's points where the kernel stops the format's writer at a file-size limit (bytes,
# from the checkpoint directory), with SIGXFSZ; at the others (step, saved) it SIGKILLs itself.
WRITE_LIMITS = {"create": lambda ckpt_dir: 0, "write": half_the_biggest_file}
# Formats whose writer sizes each file to its full length (ftruncate) before writing into it
# (safetensors 0.8: a temp file, set_len, write, rename): a limit below a file's size stops the
# writer there, that file still empty, rather than part way through its data.
PREALLOCATING = {"safetensors"}


def worker_env(fmt: str) -> dict:
    """Only the format's own plugin loads (through its entry point), beside redco's built-ins."""
    env = dict(os.environ)
    env.update(XLA_FLAGS=os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8",
               HF_HUB_OFFLINE="1",
               REDCO_PLUGINS=fmt, JAX_PLATFORMS="cpu",
               REDCO_GOODPUT_EVERY_S="0")  # goodput.json after every update: a kill loses none
    env.pop("REDCO_DISABLE_PLUGIN_AUTOLOAD", None)
    return env


def start(workdir, kill=None, fmt="orbax", data="list") -> subprocess.Popen:
    """The worker's command, started; its output goes to a file (a pipe nobody reads while it
    runs could fill up and stall it)."""
    cmd = [sys.executable, WORKER, workdir, "--format", fmt, "--data", data] + \
        (["--kill", kill] if kill else [])
    log = open(f"{workdir}.{(kill or 'done').replace(':', '_')}.out", "w+")
    proc = subprocess.Popen(cmd, env=worker_env(fmt), stdout=log, stderr=subprocess.STDOUT)
    proc.log = log
    return proc


def finish(proc, expected_rc) -> str:
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


def expected_rc(kill) -> int:
    if kill is None:
        return 0
    if kill.startswith("term"):
        return 128 + signal.SIGTERM  # a clean stop, saying why
    if kill.startswith("int:"):
        return 128 + signal.SIGINT
    if kill.startswith("int2:"):
        return -signal.SIGINT  # an uncaught KeyboardInterrupt: Python dies of SIGINT
    return -signal.SIGXFSZ if kill.split(":")[0] in WRITE_LIMITS else -signal.SIGKILL


def run(workdir, kill=None, fmt="orbax", data="list") -> str:
    return finish(start(workdir, kill, fmt, data), expected_rc(kill))


class Uninterrupted:
    """kill_worker.py's orbax run on its list data, never interrupted: started once (conftest.py's
    session fixture ``uninterrupted``), beside the first kill test's runs, and read by every
    kill test that compares with it; ``workdir()`` waits for it to end."""

    def __init__(self, workdir: str):
        self.path, self.proc = workdir, start(workdir)

    def workdir(self) -> str:
        if self.proc is not None:
            finish(self.proc, 0)
            self.proc = None
        return self.path


def files_under(path) -> dict[str, int]:
    """``{relative path: bytes}`` of every file under ``path``."""
    return {os.path.relpath(os.path.join(d, f), path): os.path.getsize(os.path.join(d, f))
            for d, _, names in os.walk(path) for f in names}


def run_killed_mid_save(workdir, kill, previous, fmt="orbax") -> dict[str, int]:
    """Run the worker with ``kill`` (``create:N`` or ``write:N``) and check that the kernel
    stopped the format's writer part way through saving ``step_N``: the process died of SIGXFSZ
    (a write went past the limit, so the writer had more to write), ``step_N.tmp`` holds the
    files the writer had begun, none past the limit and no meta.json, and the newest complete
    checkpoint, the one a rerun resumes from, is ``previous``. Returns ``{file: bytes}`` of
    what the kill left in ``step_N.tmp``."""
    point, n = kill.split(":")
    out = run(workdir, kill, fmt)
    assert latest(workdir) == previous, f"newest complete checkpoint {latest(workdir)}, not {previous}"
    names = ckpt_names(workdir)
    assert f"step_{n}.tmp" in names and f"step_{n}" not in names, names
    limit = WRITE_LIMITS[point](os.path.join(workdir, "ckpts"))  # as the worker computed it
    assert f"step_{n}.tmp/state with files limited to {limit} bytes" in out, out[-2000:]
    left = files_under(os.path.join(workdir, "ckpts", f"step_{n}.tmp"))
    assert left and "meta.json" not in left, left  # the format had begun; redco had not finished
    cut = 0 if point == "create" or fmt in PREALLOCATING else limit
    assert max(left.values()) == cut, (left, limit)  # and nothing went past the limit
    return left


def ckpt_names(workdir) -> list[str]:
    return sorted(os.listdir(os.path.join(workdir, "ckpts")))


def latest(workdir) -> str | None:
    found = checkpointing.step_ckpts(os.path.join(workdir, "ckpts"))
    return os.path.basename(found[-1]) if found else None


def goodput_runs(workdir) -> list[dict]:
    with open(os.path.join(workdir, "goodput.json")) as f:
        return json.load(f)["runs"]


def starts(workdir) -> list[int]:
    """The step each run of the worker in ``workdir`` started from."""
    with open(os.path.join(workdir, "starts.txt")) as f:
        return [int(line) for line in f]


def metrics(workdir) -> list[dict]:
    """``metrics.jsonl``'s rows without what the clock gives (wall time, throughput)."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [without_clock(json.loads(line)) for line in f]


def without_clock(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "time" and not k.startswith("perf/")}


def assert_same_run(killed, full, killed_ckpts=("step_12", "step_9")) -> None:
    """``killed`` (rerun after kills until done) ended as the uninterrupted ``full``: the same
    checkpoints and nothing half-written left, the same ``metrics.jsonl`` (each resume drops the
    rows past its step, which are logged again: one row per step, the same floats), and the
    final params bitwise equal."""
    assert ckpt_names(full) == ["step_12", "step_9"]
    assert ckpt_names(killed) == sorted(killed_ckpts)  # no .tmp, no .old
    assert [m["step"] for m in metrics(full)] == list(range(1, 13))
    assert metrics(killed) == metrics(full)
    a, b = np.load(os.path.join(full, "final.npz")), np.load(os.path.join(killed, "final.npz"))
    assert sorted(a.files) == sorted(b.files) and len(a.files) > 10
    assert int(a["__step__"]) == int(b["__step__"]) == 12
    for name in a.files:
        np.testing.assert_array_equal(b[name], a[name], err_msg=name)
