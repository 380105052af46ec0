"""Several processes on 127.0.0.1, joined by ``jax.distributed`` through the ``ip`` launcher,
train like one process with the same total number of devices: to 1e-5, since an all-reduce across
processes sums in another order than one within a process (about one float32 ulp apart)."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from multihost_helpers import (
    TOTAL_DEVICES,
    WORKER,
    assert_trains_like_reference,
    free_port,
    launch,
    read_results,
    wait_until,
    worker_env,
)

CAUGHT = "SIGTERM caught"  # what JAX's preemption notifier logs once it caught a SIGTERM


def test_two_processes_train_like_one_process(two_processes, reference):
    assert_trains_like_reference(two_processes, 2, "ip", reference)


def test_four_processes_splitting_each_sequence_train_like_one_process(reference, tmp_path):
    """4 processes of 2 devices: dp 2 x cp 2 x mp 2, each sequence split over 2 processes."""
    launch(4, str(tmp_path), REDCO_TEST_CONTEXT_SHARDS="2")
    assert_trains_like_reference(str(tmp_path), 4, "ip", reference, 2)


def assert_ends_like_reference_and_reads_back(workdir: str, fmt: str, reference) -> None:
    """The resumed run ended where one uninterrupted run ends, and its ``step_8`` (in ``fmt``),
    read back here on 1 device, holds exactly the params it wrote."""
    import jax
    import optax
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "core"))
    from helpers import lm_model

    from redco import checkpointing
    from redco.sharding import named_leaves
    saved = np.load(os.path.join(workdir, "params.npz"))
    for name, value in reference[1].items():
        np.testing.assert_allclose(saved[name], value, rtol=1e-5, atol=1e-5, err_msg=name)
    _, params = lm_model()
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one_device),
                          {"params": params,
                           "opt_state": optax.sgd(0.1, momentum=0.9).init(params)})
    tree, meta = checkpointing.load(os.path.join(workdir, "ckpts", "step_8"), target)
    assert (meta["step"], meta["format"]) == (8, fmt)
    restored = dict(named_leaves(tree["params"]))
    assert sorted(restored) == sorted(saved)
    for name, value in restored.items():
        np.testing.assert_array_equal(np.asarray(value), saved[name])


@pytest.mark.parametrize("fmt", ["orbax", "safetensors",
                                 pytest.param("msgpack", marks=pytest.mark.slow)])
def test_a_run_stopped_mid_epoch_resumes_on_another_process_count(fmt, reference, tmp_path):
    """1 process is stopped by SIGTERM mid-epoch (its checkpoint, in ``fmt``, saves where in
    the data it stands, in examples); 2 processes resume it: they train only the updates left
    and end with the params of one uninterrupted run. Their checkpoint, read back on 1 device,
    holds exactly the params they wrote. orbax (the default format) moves by its own
    multi-process code; safetensors by redco's (every process gathers with ``host_arrays``,
    process 0 writes, ``place`` reads each process's part), which msgpack shares: msgpack in
    the slow tier (``REDCO_SLOW_TESTS=1``), its own reading and writing guarded by
    ``tests/formats`` and ``plugins/msgpack/tests``."""
    workdir = str(tmp_path)
    one = subprocess.run([sys.executable, WORKER, "0", "1", "0", str(TOTAL_DEVICES), workdir],
                         env=worker_env(REDCO_TEST_TERM_AT_STEP="2", REDCO_TEST_CKPT_FORMAT=fmt),
                         capture_output=True, text=True, timeout=600)
    assert one.returncode == 143, one.stdout[-3000:] + one.stderr[-3000:]
    with open(os.path.join(workdir, "log.txt")) as f:
        step = int(re.search(r"Stopped by SIGTERM after step (\d+): saved", f.read()).group(1))
    assert step < 4, "stopped mid-epoch 1 (4 updates an epoch)"
    launch(2, workdir, REDCO_TEST_CKPT_FORMAT=fmt)
    assert [len(r["losses"]) for r in read_results(workdir, 2)] == [8 - step] * 2  # resumed
    assert_ends_like_reference_and_reads_back(workdir, fmt, reference)


def test_a_busy_port_is_refused_with_a_clear_error(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code = ("from redco import Deployer\n"
                f"Deployer(jax_seed=0, n_processes=2, host0_address='127.0.0.1', host0_port={port},"
                f" process_id=0, workdir={str(tmp_path)!r})")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=120, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert out.returncode != 0
    assert f"host0_port={port} is already in use on this host" in out.stderr


@pytest.mark.parametrize("victim", [1, pytest.param(0, marks=pytest.mark.slow)])
def test_a_killed_process_stops_the_others_quickly_naming_it(victim, tmp_path):
    """SIGKILL one process at step 3: the survivor exits non-zero within 60 s, saying which
    process was lost. Process 0 killed: slow tier (``REDCO_SLOW_TESTS=1``; JAX's own agent may
    abort first); in CI a lost coordinator is named by redco's watchdog in
    ``test_a_stopped_process_makes_the_other_exit_within_twice_the_hang_timeout[0]``, and redco's
    message of a failed collective by this test's process 1 case."""
    port, workdir = free_port(), str(tmp_path)
    procs = [subprocess.Popen(
        [sys.executable, WORKER, str(i), "2", str(port), "4", workdir], stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
        env=worker_env(REDCO_TEST_KILL_AT_STEP="3") if i == victim else worker_env())
        for i in range(2)]
    survivor = procs[1 - victim]
    procs[victim].wait(timeout=600)
    killed_at = time.monotonic()
    out = survivor.communicate(timeout=120)[0]
    assert procs[victim].returncode == -9
    assert survivor.returncode != 0
    assert time.monotonic() - killed_at < 60
    if victim == 1:  # redco's error, or jax's own abort if it comes first; both name it
        assert re.search(r"Lost process 1 of 2|stopped sending heartbeats\):\s*1\b", out), \
            out[-3000:]
    else:  # jax's own agent aborts first, naming the coordination service (process 0)
        assert ("Lost another process (or the coordinator" in out
                or "Failed to send RPC to coordination service" in out), out[-3000:]


@pytest.mark.parametrize("noticed_by,during", [pytest.param(1, "step", marks=pytest.mark.slow),
                                               (0, "save")])
def test_sigterm_to_one_process_stops_both_after_the_same_step_and_resumes_bitwise(
        noticed_by, during, tmp_path, two_processes):
    """One of 2 processes gets SIGTERM (a preemption notice) at the end of step 2, or twice
    while its save of the epoch's checkpoint step_4 is held midway (state written, meta.json and
    the rename to come): JAX's preemption service tells the other, both finish the same later
    step, write its checkpoint together (the save under way completes) and exit 143; the same
    command again resumes and ends with the params of an uninterrupted 2-process run, bit for
    bit. (Process 0 told between steps while writing in the background: the SIGTERM of
    ``test_background_checkpoints``.) Process 1 told at the end of a step: slow tier
    (``REDCO_SLOW_TESTS=1``); in CI a SIGTERM to process 1 between updates, both stopping at the
    same boundary and rerunning to the bits of an uninterrupted run, is guarded by
    ``test_zoo_loops_processes``' FedAvg case (and ``trainer.fit``'s stop by the ``save`` case)."""
    preempted = str(tmp_path / "preempted")
    port = free_port()
    notice = {"REDCO_TEST_TERM_AT_STEP": "2"} if during == "step" else \
        {"REDCO_TEST_TERM_DURING_SAVE": "4"}
    # a held save holds training too, so the SIGTERMs come while it is held (every process
    # writes the same way: the blocking one meets on the devices, the background on the side)
    blocking = {"REDCO_TEST_BLOCKING_CKPTS": "1"} if during == "save" else {}
    logs = [tmp_path / f"process_{i}.log" for i in range(2)]
    procs = []
    for i, log in enumerate(logs):
        with open(log, "w") as out:
            procs.append(subprocess.Popen(
                [sys.executable, WORKER, str(i), "2", str(port), "4", preempted], stdout=out,
                stderr=subprocess.STDOUT, env=worker_env(**blocking, **notice) if i == noticed_by
                else worker_env(**blocking)))
    if during == "save":
        term_while_save_is_held(procs[noticed_by], logs[noticed_by], preempted, "step_4")
    for p in procs:
        p.wait(timeout=600)
    outputs = [log.read_text() for log in logs]
    assert [p.returncode for p in procs] == [143, 143], "\n".join(o[-2000:] for o in outputs)
    if during == "save":  # held when the SIGTERMs were sent, and unfinished after them
        assert re.search(rf"save of step_4 in progress.*{CAUGHT}.*save of step_4 goes on after the "
                         r"test sent two SIGTERMs and JAX caught them; step_4\.tmp unfinished: "
                         r"True", outputs[noticed_by], re.S), outputs[noticed_by][-3000:]
    with open(os.path.join(preempted, "log.txt")) as f:
        step = int(re.search(r"Stopped by SIGTERM after step (\d+): saved", f.read()).group(1))
    assert (2 if during == "step" else 4) < step < 8
    assert os.listdir(os.path.join(preempted, "ckpts")) == [f"step_{step}"]
    launch(2, preempted)
    assert [len(r["losses"]) for r in read_results(preempted, 2)] == [8 - step] * 2  # resumed
    a = np.load(os.path.join(two_processes, "params.npz"))
    b = np.load(os.path.join(preempted, "params.npz"))
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(b[name], a[name], err_msg=name)


def term_while_save_is_held(proc: subprocess.Popen, log: Path, workdir: str, name: str) -> None:
    """Once the worker says its save of ``name`` is in progress (held midway, see worker.py),
    send it two SIGTERMs; once JAX's preemption notifier logs that it caught them, let the save
    go on (the notifier looks once a second: released at once, a fast run could end first)."""
    def printed(line: str):
        return lambda: line in log.read_text() or proc.poll() is not None
    held = f"save of {name} in progress"
    wait_until(printed(held), f"the worker printed '{held}'", 600)
    assert proc.poll() is None, f"the worker ended before its save of {name} was held:\n" + \
        log.read_text()[-3000:]
    for _ in range(2):
        proc.send_signal(signal.SIGTERM)
    wait_until(printed(CAUGHT), f"JAX's preemption notifier logged '{CAUGHT}'", 60)
    go_on = os.path.join(workdir, "go_on_saving")
    with open(go_on + ".tmp", "w") as f:
        f.write("sent two SIGTERMs and JAX caught them")
    os.rename(go_on + ".tmp", go_on)  # whole when it appears


def last_printed_step(path: str) -> int:
    with open(path) as f:
        found = re.findall(r"finished step (\d+)\n", f.read())  # after a progress bar, maybe
    return int(found[-1]) if found else 0


@pytest.mark.parametrize("victim", [1, 0])
def test_a_stopped_process_makes_the_other_exit_within_twice_the_hang_timeout(victim, tmp_path):
    """SIGSTOP one of 2 processes once it finished step 2 (it hangs, alive, holding its sockets):
    the other exits by itself with status 124 within 2x REDCO_HANG_TIMEOUT, naming the stopped
    one: process 1 with the last step it finished, or process 0, the coordinator, which then
    cannot answer."""
    timeout_s, port, workdir = 5, free_port(), str(tmp_path)
    outs = [str(tmp_path / f"out_{i}.txt") for i in range(2)]
    procs = [subprocess.Popen(
        [sys.executable, WORKER, str(i), "2", str(port), "4", workdir], stdout=open(outs[i], "w"),
        stderr=subprocess.STDOUT, env=worker_env(REDCO_HANG_TIMEOUT=str(timeout_s), **(
            {"REDCO_TEST_STOPPABLE_AT_STEP": "2"} if i == victim else {})))
        for i in range(2)]
    stopped, survivor = procs[victim], procs[1 - victim]
    try:
        def heartbeat_says_step_2() -> bool:
            assert stopped.poll() is None, open(outs[victim]).read()[-3000:]
            return "heartbeat says step 2\n" in open(outs[victim]).read()
        wait_until(heartbeat_says_step_2, f"process {victim} published its heartbeat of step 2", 600)
        stopped.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        survivor.wait(timeout=120)
        took = time.monotonic() - stopped_at
        out = open(outs[1 - victim]).read()
        assert survivor.returncode == 124, out[-3000:]
        assert took < 2 * timeout_s, f"exited {took:.1f} s after the SIGSTOP\n{out[-3000:]}"
        print(f"process {1 - victim} exited {took:.2f} s after process {victim} was stopped")
        step = last_printed_step(outs[victim])
        own = last_printed_step(outs[1 - victim])
        head = (rf"No train step finished for {timeout_s} s on process {1 - victim} of 2 \(last "
                rf"finished step {own}\)\. Stuck: ")
        if victim == 1:
            message = head + rf"process 1 \(last step {step}, no heartbeat for \d+ s\)\. Exiting"
            with open(os.path.join(workdir, "log.txt")) as f:
                assert re.search(message, f.read())
            with open(os.path.join(workdir, "metrics.jsonl")) as f:  # process 0's steps
                logged = max(json.loads(line)["step"] for line in f if line.strip())
            assert own == logged and step == 2 and logged in (2, 3)
        else:
            message = head + r"process 0 \(the coordinator\) does not answer\. Exiting"
            assert own in (2, 3)
        assert re.search(message, out), out[-3000:]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_process_stuck_between_steps_is_named_with_its_last_step(tmp_path):
    """Process 1's on_step_end never returns after step 2 (its heartbeats go on), so it is the
    one behind: both processes stop within 2x the timeout of the hang, and whichever gives up
    first exits 124 naming process 1 and step 2 (the other may be ended by JAX first, as its
    coordinator or peer went away; if it exits 124 too, it names the same, or, when the
    coordinator went with the first, says it could not read the heartbeats)."""
    timeout_s, port, workdir = 5, free_port(), str(tmp_path)
    outs = [str(tmp_path / f"out_{i}.txt") for i in range(2)]
    procs = [subprocess.Popen(
        [sys.executable, WORKER, str(i), "2", str(port), "4", workdir], stdout=open(outs[i], "w"),
        stderr=subprocess.STDOUT, env=worker_env(REDCO_HANG_TIMEOUT=str(timeout_s), **(
            {"REDCO_TEST_HANG_AT_STEP": "2"} if i == 1 else {})))
        for i in range(2)]
    try:
        ended = {}

        def both_ended() -> bool:
            ended.update({i: time.time() for i, p in enumerate(procs)
                          if i not in ended and p.poll() is not None})
            return len(ended) == 2
        wait_until(both_ended, "both processes ended after process 1 hung", 600)
        texts = [open(out).read() for out in outs]
        hung_at = float(re.search(r"hangs at ([\d.]+)\n", texts[1]).group(1))
        first = min(ended, key=ended.get)
        assert procs[first].returncode == 124, texts[first][-3000:]
        named = []  # the processes whose 124 named process 1 and its step
        for i, text in enumerate(texts):
            assert procs[i].returncode != 0 and ended[i] - hung_at < 2 * timeout_s, \
                f"process {i}: status {procs[i].returncode} {ended[i] - hung_at:.1f} s after the hang"
            print(f"process {i} exited {procs[i].returncode} {ended[i] - hung_at:.2f} s after "
                  "process 1 hung")
            if procs[i].returncode == 124:
                said = rf"No train step finished for {timeout_s} s on process {i} of 2 \(last " \
                    rf"finished step {last_printed_step(outs[i])}\)\. Stuck: "
                if re.search(said + r"process 1 \(last step 2, the lowest; all heartbeats live\)"
                             r"\. Exiting", text):
                    named.append(i)
                else:  # the later of two: the coordinator may have gone with the other process
                    assert re.search(said + "unknown: this process could not read the heartbeats",
                                     text), text[-3000:]
        assert named, "no process that exited 124 named process 1 and step 2:\n" + \
            "\n".join(t[-2000:] for t in texts)
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_processes_that_disagree_on_background_writes_are_refused_before_training(tmp_path):
    """One process writing step checkpoints in the background and the other while training
    waits would meet at different barriers and hang at the first save: both refuse at the
    start, naming the setting, and nothing trains or is saved."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, WORKER, str(i), "2", str(port), "4",
                               str(tmp_path)], env=worker_env(**blocking),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i, blocking in enumerate(({}, {"REDCO_TEST_BLOCKING_CKPTS": "1"}))]
    try:  # (refused within seconds; without the check, a hang at the first save)
        outputs = [p.communicate(timeout=150)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode != 0, f"process {i} trained:\n{out[-2000:]}"
        assert re.search(r"writes step checkpoints (in the background|while training waits), "
                         r"and another process the other way: give every process the same "
                         r"async_checkpoints", out), out[-3000:]
    assert not os.path.exists(os.path.join(tmp_path, "ckpts")) or \
        not os.listdir(os.path.join(tmp_path, "ckpts"))
