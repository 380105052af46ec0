"""The README's main job (``python -m redco_zoo_lm.demo``) trains past what byte frequencies
alone reach, samples text from its trained model, and, SIGKILLed mid-epoch and run again,
resumes from its last step checkpoint and ends with the params of a run never stopped, bit for
bit (that last comparison, a third demo process, runs in the slow tier)."""
import inspect
import json
import os
import re
import signal
import string
import subprocess
import sys
import time

import jax
import numpy as np
import pytest
from ckpt_helpers import TIMEOUT, assert_bit_equal, host, latest, without_clock

from redco import checkpointing
from redco_zoo_lm.demo import byte_sequences, make_model
from redco_zoo_lm.pipeline import pred_fn
from redco_zoo_models import split_model

HIDDEN, LAYERS, SEED, SEQ_LEN, GLOBAL_BATCH = 32, 1, 42, 128, 32  # 8 a device, 4 dp x 2 mp
PROMPT = "The import statement"  # what the demo prompts with


def start_demo(workdir) -> subprocess.Popen:
    """The demo's command for one epoch of a small model; stdout and stderr (the progress bars)
    go to files next to ``workdir``."""
    cmd = [sys.executable, "-m", "redco_zoo_lm.demo", "--workdir", workdir, "--n_epochs", "1",
           "--hidden_size", str(HIDDEN), "--n_layers", str(LAYERS), "--jax_seed", str(SEED),
           "--seq_len", str(SEQ_LEN)]
    out, err = open(f"{workdir}.out", "w+"), open(f"{workdir}.err", "w+")
    proc = subprocess.Popen(cmd, stdout=out, stderr=err)
    proc.files = (out, err)
    return proc


def finish(proc, expected_rc=0) -> tuple[str, str]:
    """``(stdout, stderr)`` of ``proc`` once it exits with ``expected_rc``."""
    try:
        proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    texts = []
    for f in proc.files:
        f.seek(0)
        texts.append(f.read())
        f.close()
    assert proc.returncode == expected_rc, f"{proc.args} exited {proc.returncode}:\n{texts[1][-4000:]}"
    return texts[0], texts[1]


def kill_after_first_step_ckpt(proc, workdir) -> int:
    """SIGKILL ``proc`` as soon as a step checkpoint is complete on disk; the step of the newest
    one left (a later one may have landed before the kill did)."""
    ckpt_dir = os.path.join(workdir, "ckpts")
    deadline = time.monotonic() + TIMEOUT
    while not checkpointing.step_ckpts(ckpt_dir):
        assert proc.poll() is None, "the demo ended before it wrote a step checkpoint"
        assert time.monotonic() < deadline, "no step checkpoint in time"
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    finish(proc, -signal.SIGKILL)
    return int(latest(workdir).removeprefix("step_"))


def final_params(workdir, steps):
    """The params of ``ckpts/step_<steps>``, read onto the demo's model, on one device."""
    apply_fn, params = split_model(make_model(HIDDEN, LAYERS, SEED))
    tree, meta = checkpointing.load(os.path.join(workdir, "ckpts", f"step_{steps}"),
                                    {"params": params})
    assert meta["step"] == steps
    return apply_fn, tree["params"]


def eval_loss(stdout) -> float:
    return float(stdout.split("eval loss ")[1].split(",")[0])


def unigram_entropy(data: np.ndarray) -> float:
    """Nats per byte of a model that knows only how often each byte occurs."""
    p = np.bincount(data.ravel(), minlength=256) / data.size
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def continuation(stdout) -> bytes:
    """The bytes the demo sampled after its prompt (the line is ``sample: <prompt><sample>``,
    the last thing it prints; a sample may hold newlines). The demo shows a byte that is not
    UTF-8 as ``\\xNN``, N >= 8 (ASCII is always UTF-8)."""
    text = stdout.split(f"sample: {PROMPT}", 1)[1].removesuffix("\n")
    parts = re.split(r"\\x([89a-f][0-9a-f])", text)
    return b"".join(bytes([int(p, 16)]) if i % 2 else p.encode() for i, p in enumerate(parts))


def sample_z_score(apply_fn, params, new: bytes, temperature: float) -> float:
    """How far the model's negative log-likelihood of the sampled bytes lies from what sampling
    from ``softmax(logits / temperature)`` at each position gives, in standard deviations.
    Given the bytes before it, each byte's NLL has a known mean and variance under that
    sampling, so the sum over the bytes has mean and variance the sums of those (a martingale):
    |z| stays within a few units for a sampler that draws from the trained model's conditionals
    (-1.8 to 1.3 over 30 seeds), and is far off for one that draws from the untrained params or
    uniformly (26 to 36), off for greedy decoding (-4.6). (A sampler that loses the context, such
    as a cache bug, is too close to this weak model to tell: test_generation.py checks that.)"""
    ids = np.frombuffer(PROMPT.encode() + new, np.uint8).astype(np.int32)
    logits = np.asarray(jax.jit(apply_fn)(params, ids[None, :-1])[0, -len(new):], np.float64)
    log_p = np.asarray(jax.nn.log_softmax(logits))
    q = np.asarray(jax.nn.softmax(logits / temperature))
    nll = -log_p[np.arange(len(new)), ids[-len(new):]]
    mean = (q * -log_p).sum(1)
    var = (q * log_p ** 2).sum(1) - mean ** 2
    return float((nll.sum() - mean.sum()) / np.sqrt(var.sum()))


def killed_and_rerun(killed: str, steps: int) -> tuple[int, str]:
    """The demo SIGKILLed after its first step checkpoint and run again to its end: the step it
    resumed at and the rerun's stdout, once the rerun is checked to resume there."""
    resume_step = kill_after_first_step_ckpt(start_demo(killed), killed)
    print(f"killed after step_{resume_step} of {steps}")
    assert 0 < resume_step < steps  # mid-epoch
    out, err = finish(start_demo(killed))
    ckpt = os.path.join(killed, "ckpts", f"step_{resume_step}")
    assert f"Resumed from {ckpt} (step {resume_step})." in out
    assert f"{resume_step}/{steps} [" in err  # the progress bar starts where the kill left it
    return resume_step, out


def metrics_rows(workdir: str) -> list[dict]:
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [without_clock(json.loads(line)) for line in f]


def test_main_job_trains_samples_and_resumes_a_sigkill(tmp_path):
    """The killed and rerun demo: it resumes from its last step checkpoint, logs each step once,
    learns, and samples from what it learnt. (That it ends with the bits of a run never stopped
    is the slow test below; test_kill_resume.py's kills of Trainer.fit, the loop the demo runs,
    check that property in CI.)"""
    data = np.stack([e["token_ids"] for e in byte_sequences(SEQ_LEN)])
    steps = (len(data) - len(data) // 20) // GLOBAL_BATCH  # one epoch; the demo holds out 1/20
    killed = str(tmp_path / "killed")
    _, out = killed_and_rerun(killed, steps)
    # metrics.jsonl as if never killed: one train row per step, one eval row (the resume
    # dropped the rows logged past the checkpoint, which were logged again)
    rows = metrics_rows(killed)
    assert [r["step"] for r in rows if "train/loss" in r] == list(range(1, steps + 1))
    assert len([r for r in rows if "eval/loss" in r]) == 1
    assert os.listdir(os.path.join(killed, "ckpts")) == [f"step_{steps}"]

    assert "mesh: {'dp': 4, 'mp': 2}" in out
    # Learnt more than byte frequencies (3.26 nats on these docs; uniform would be 5.55).
    assert eval_loss(out) < unigram_entropy(data), (eval_loss(out), unigram_entropy(data))
    check_sample(continuation(out), *final_params(killed, steps))


@pytest.mark.slow  # REDCO_SLOW_TESTS=1 (conftest.py); in CI: the test above, test_kill_resume.py
def test_main_job_resumed_after_a_sigkill_ends_with_the_bits_of_a_run_never_stopped(tmp_path):
    data = np.stack([e["token_ids"] for e in byte_sequences(SEQ_LEN)])
    steps = (len(data) - len(data) // 20) // GLOBAL_BATCH
    full, killed = str(tmp_path / "full"), str(tmp_path / "killed")
    uninterrupted = start_demo(full)  # independent of the killed runs: runs beside them
    _, out = killed_and_rerun(killed, steps)
    full_out, full_err = finish(uninterrupted)
    assert "Resumed" not in full_out and "epoch 1/1" in full_err
    assert os.listdir(os.path.join(full, "ckpts")) == [f"step_{steps}"]
    assert_bit_equal(host(final_params(killed, steps)[1]), host(final_params(full, steps)[1]))
    assert eval_loss(out) == eval_loss(full_out)
    assert metrics_rows(killed) == metrics_rows(full)


def check_sample(new: bytes, apply_fn, params) -> None:
    """The sample is ``pred_fn``'s number of new bytes, reads as text, and was drawn from the
    trained model's conditionals at ``pred_fn``'s temperature."""
    defaults = {k: v.default for k, v in inspect.signature(pred_fn).parameters.items()}
    assert len(new) == defaults["max_new_tokens"], new
    # The docs are 99.6% printable ASCII; uniformly random bytes are 39% printable.
    printable = sum(chr(b) in string.printable for b in new) / len(new)
    assert printable >= 0.9, new
    z = sample_z_score(apply_fn, params, new, defaults["temperature"])
    print(f"sample {new!r}: z = {z:.2f}")
    assert abs(z) < 4, (z, new)  # a right sampler: beyond 4 with probability ~1e-4 (normal)


def trained_a_step(workdir) -> bool:
    try:
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            return '"train/loss"' in f.read()
    except FileNotFoundError:
        return False


def test_main_job_trains_on_one_device_as_on_one_gpu(tmp_path):
    """One device (one GPU, say): the demo's default n_model_shards, 2 on 8 devices, becomes 1
    instead of an error that 2 does not divide 1; it trains a step and is stopped."""
    workdir = str(tmp_path / "one")
    env = {**os.environ, "XLA_FLAGS": (os.environ.get("XLA_FLAGS", "")
                                       + " --xla_force_host_platform_device_count=1")}
    cmd = [sys.executable, "-m", "redco_zoo_lm.demo", "--workdir", workdir, "--n_epochs", "1",
           "--hidden_size", str(HIDDEN), "--n_layers", str(LAYERS)]
    with open(f"{workdir}.err", "w+") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + TIMEOUT
        try:
            while not trained_a_step(workdir):
                err.seek(0)
                assert proc.poll() is None, f"the demo exited {proc.returncode}:\n{err.read()}"
                assert time.monotonic() < deadline, "no train step in time"
                time.sleep(0.05)
        finally:
            proc.kill()
            proc.wait()
    with open(os.path.join(workdir, "log.txt")) as f:
        assert "mesh: {'dp': 1, 'mp': 1}" in f.read()
